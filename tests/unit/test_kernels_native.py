"""The native CPU quantizer (nemofp4.kernels.native) against the reference quantize_blocks and the
quantization program it is the kernel of: bit for bit (values, codes, scale codes, tensor scale,
counts, random draws) for every layout, scale format and rounding it covers, split across threads or
not; the operands it does not cover go to the program; the library's build and its fallback."""

import stat
import warnings

import pytest
import torch

from nemofp4 import kernels
from nemofp4.formats import amax, quantize_blocks
from nemofp4.kernels import OperandRequest, native, program
from nemofp4.kernels import backend as kernel_backends
from nemofp4.quant import OperandQuant
from tests.conftest import quant_inputs

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not native.available(), reason="needs a C++ compiler to build the native quantizer"),
]

FORMATS = ["e4m3", "ue5m3", "ue5m3_cuda"]
ROUNDINGS = ["rne", "sr", "sr8"]
LAYOUTS = ["rows", "tiles", "tokens"]
OUTPUTS = [(False, True), (True, True), (True, False)]  # (pack, values)
_program_cores = program._quantize_cores
NATIVE = native.NativeCores(program.EAGER)
"""The native kernel, the eager program for what it does not cover."""


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 and t.dim() else t


def assert_same_bits(native_q, program_q, where: str) -> None:
    """Every tensor of two QuantizedBlocks bit for bit (a NaN's payload aside), and their counts."""
    for name in ("scaled", "codes", "scale_codes", "tensor_scale", "tensor_amax"):
        a, b = getattr(native_q, name), getattr(program_q, name)
        assert (a is None) == (b is None), f"{where}: {name}"
        if a is None:
            continue
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype, f"{where}: {name} layout"
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan()), f"{where}: {name} NaNs"
            a, b = torch.where(a.isnan(), 0.0, a), torch.where(b.isnan(), 0.0, b)
        assert torch.equal(_bits(a), _bits(b)), f"{where}: {name}"
    assert {k: int(v) for k, v in native_q.counts.items()} == {k: int(v) for k, v in program_q.counts.items()}, where
    assert native_q.shape == program_q.shape and native_q.num_blocks == program_q.num_blocks, where


def _quantize(layout: str, x: torch.Tensor, op: OperandQuant, **options):
    if layout == "tokens":
        return program.quantize_tokens_operand(x, op, **options)
    return program.quantize_operand(x, op, two_d=layout == "tiles", **options)


@pytest.fixture
def native_calls(monkeypatch):
    """The specs the native kernel quantized, and fails the test if the program's core ran instead."""
    calls = []
    real = native.quantize_core
    monkeypatch.setattr(native, "quantize_core", lambda spec, *a: calls.append(spec) or real(spec, *a))

    def no_program(*args):
        raise AssertionError("an operand the native kernel covers went to the program")

    monkeypatch.setattr(program, "_quantize_cores", no_program)
    return calls


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_covered_operand_is_the_programs_and_the_references(layout, fmt, rounding, native_calls):
    op = OperandQuant(scale_format=fmt, rounding=rounding)
    for label, x in quant_inputs():
        if x.dtype != torch.float32:
            continue
        for reference in (None, torch.tensor(0.5), torch.tensor(40.0)):  # measured, held (saturating), held
            for pack, values in OUTPUTS:
                where = f"{layout} {fmt} {rounding}, {label}, reference={reference}, pack={pack}, values={values}"
                options = dict(tensor_amax=reference, pack=pack, values=values)
                calls = len(native_calls)
                fast = _quantize(layout, x, op, cores=NATIVE, generator=torch.Generator().manual_seed(3), **options)
                assert len(native_calls) == calls + 1, where
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(program, "_quantize_cores", _program_cores)
                    slow = _quantize(layout, x, op, generator=torch.Generator().manual_seed(3), **options)
                assert_same_bits(fast, slow, where)
                if values:  # and the float64-checked reference, whose operand is the padded transpose
                    source = program.tokens_transposed(x) if layout == "tokens" else x
                    ref = quantize_blocks(
                        source.contiguous(),
                        fmt,
                        16,
                        layout == "tiles",
                        448.0,
                        reference,
                        rounding,
                        torch.Generator().manual_seed(3),
                    )
                    assert torch.equal(_bits(fast.scaled), _bits(ref.scaled_values())), where


@pytest.mark.parametrize("layout", LAYOUTS)
def test_threads_split_an_operand_without_changing_a_bit(layout, native_calls):
    """An operand split across two threads (each takes at least 2^15 elements) gives the bits of one
    thread, and of the program."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1040, 1008, generator=g) * torch.logspace(-6, 6, 1008)
    op = OperandQuant(scale_format="ue5m3", rounding="sr8")
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(_quantize(layout, x, op, cores=NATIVE, pack=True, generator=torch.Generator().manual_seed(1)))
    torch.set_num_threads(1)
    assert_same_bits(results[1], results[0], f"{layout}: two threads against one")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(program, "_quantize_cores", _program_cores)
        slow = _quantize(layout, x, op, pack=True, generator=torch.Generator().manual_seed(1))
    assert_same_bits(results[1], slow, f"{layout}: against the program")


# Where each layout puts element (1, 3) of x: its block, as [rows, cols] slices of the result.
_BLOCK_OF_1_3 = {
    "rows": (slice(1, 2), slice(0, 16)),
    "tiles": (slice(0, 16), slice(0, 16)),
    "tokens": (slice(3, 4), slice(0, 16)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_finite_inputs_give_the_programs_results(layout, native_calls):
    """Infinities give the program's bits, with the tensor reference measured (infinite), held below
    them or infinite; a NaN (not checked here: the trainer's checks catch it) makes its own value
    NaN and leaves every other block as the program quantizes it."""
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    x[17, 40] = float("inf")
    x[33, 20] = -float("inf")
    op = OperandQuant(scale_format="ue5m3", rounding="sr8")

    def both(t, reference):
        fast = _quantize(
            layout, t, op, cores=NATIVE, pack=True, tensor_amax=reference, generator=torch.Generator().manual_seed(4)
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(program, "_quantize_cores", _program_cores)
            slow = _quantize(
                layout, t, op, pack=True, tensor_amax=reference, generator=torch.Generator().manual_seed(4)
            )
        return fast, slow

    for reference in (None, torch.tensor(3.0), torch.tensor(float("inf"))):
        assert_same_bits(*both(x, reference), f"{layout}, infinities, reference={reference}")
    x[1, 3] = float("nan")
    fast, slow = both(x, torch.tensor(3.0))
    assert (fast.scaled.t() if layout == "tokens" else fast.scaled)[3 if layout == "tokens" else 1, 3].isnan()
    rows, cols = _BLOCK_OF_1_3[layout]
    for q in (fast, slow):
        q.scaled[rows, cols] = 0.0
        q.codes[rows, cols.start // 2 : cols.stop // 2] = 0
        q.scale_codes[rows.start // (16 if layout == "tiles" else 1), 0] = 0
        q.counts = {}
    assert_same_bits(fast, slow, f"{layout}, a NaN: the other blocks")


def test_the_pair_and_the_forward_call_are_the_programs_draw_for_draw(native_calls):
    """X and X^T, and X, X^T and W, in one call each: the same bits and the same generator state after
    (each operand's key drawn in the program's order)."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(40, 96, generator=g), torch.randn(80, 96, generator=g)
    dy_op = OperandQuant(scale_format="ue5m3", rounding="sr8")
    x_op, w_op = OperandQuant(scale_format="ue5m3"), OperandQuant(scale_format="ue5m3", two_d=True, rounding="sr8")
    calls = {
        "pair": lambda **k: program.quantize_operand_pair(
            x, dy_op, dy_op, tensor_amax=torch.tensor(9.0), pack_xt=False, **k
        ),
        "forward": lambda **k: program.quantize(
            (
                OperandRequest(x, x_op),
                OperandRequest(x, x_op, layout="tokens", pack=True, values=False),
                OperandRequest(w, w_op),
            ),
            **k,
        ),
    }
    for name, call in calls.items():
        generators = [torch.Generator().manual_seed(8) for _ in range(2)]
        fast = call(cores=NATIVE, generator=generators[0])
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(program, "_quantize_cores", _program_cores)
            slow = call(generator=generators[1])
        for i, (a, b) in enumerate(zip(fast, slow)):
            assert_same_bits(a, b, f"{name}, operand {i}")
        assert torch.equal(generators[0].get_state(), generators[1].get_state()), name


def test_operands_it_does_not_cover_go_to_the_program():
    """MX scales, the Hadamard transform, sr_exact, blocks of 32, BF16 and fake tensors: the program
    (the same call, the same bits)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    cases = [
        ("quantize_operand", x, OperandQuant(scale_format="ue8m0", block_size=32)),
        ("quantize_tokens_operand", x, OperandQuant(scale_format="e4m3", hadamard=True)),
        ("quantize_operand", x, OperandQuant(scale_format="e4m3", rounding="sr_exact")),
        ("quantize_operand", x, OperandQuant(scale_format="e4m3", block_size=32)),
        ("quantize_operand", x.bfloat16(), OperandQuant(scale_format="ue5m3")),
    ]
    for name, t, op in cases:
        operand = program._prepared(OperandRequest(t, op, layout="rows" if name == "quantize_operand" else "tokens"))
        assert not native.supports(operand.spec, operand.blocks), op
        fast = getattr(program, name)(t, op, cores=NATIVE, generator=torch.Generator().manual_seed(1))
        slow = getattr(program, name)(t, op, generator=torch.Generator().manual_seed(1))
        assert_same_bits(fast, slow, str(op))
    with FakeTensorMode():  # the planner's simulation
        fake = program._prepared(OperandRequest(torch.empty(32, 64), OperandQuant(scale_format="ue5m3")))
        assert not native.supports(fake.spec, fake.blocks)


def test_native_amax_is_the_exact_amax():
    x = torch.randn(1000, 33, generator=torch.Generator().manual_seed(3)) * 1e20
    assert torch.equal(native.amax(x), amax(x))
    assert torch.equal(native.amax(-x.abs()), amax(x))
    assert torch.equal(native.amax(torch.full((5,), -0.0)).view(torch.int32), torch.tensor(0, dtype=torch.int32))
    backend = kernels.backend_for("native", "cpu")
    assert torch.equal(backend.amax(x[:, :5]), amax(x[:, :5]))  # not contiguous: the program's
    x[500, 7] = -float("inf")
    assert native.amax(x) == float("inf")
    x[3, 1] = float("nan")
    assert native.amax(x).isnan()
    assert not native.supports_amax(torch.empty(0)) and not native.supports_amax(x.t())
    assert not native.supports_amax(x.double())


def test_a_training_step_on_the_native_kernel_is_the_programs(monkeypatch):
    """Two ue5m3 steps of the stand-in model (sr8 gradients, held references, 16x16 weight tiles),
    native against the eager program: the same losses and gradients, and no compiled graph built."""
    from nemofp4.quant import set_quant_backend, set_step
    from nemofp4.recipes import apply_recipe, get_recipe
    from tests.conftest import StandInModel

    compiled = []
    monkeypatch.setattr(program, "_run_compiled", lambda specs, *a: compiled.append(specs) or _program_cores(specs, *a))
    results = {}
    for backend in ("native", "eager"):
        torch.manual_seed(0)
        model = StandInModel()
        apply_recipe(model, get_recipe("ue5m3"), log=False)
        set_quant_backend(model, backend)
        ids = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
        out = []
        for step in (1, 2):
            set_step(model, step)
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            out += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        results[backend] = out
    assert not compiled
    for a, b in zip(results["native"], results["eager"], strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_the_library_is_built_once_into_the_cache_and_loaded_from_it(empty_native_cache, monkeypatch):
    """The build leaves the library and its record (size, SHA-256) and nothing else; a second process
    checks the library against the record and loads it, building nothing."""
    assert native.available()
    built = sorted(p.name for p in empty_native_cache.iterdir())
    assert len(built) == 2 and built[0].startswith("cpu_quantize-") and built[0].endswith(".json"), built
    assert built[1] == built[0].removesuffix(".json") + ".so", built
    native._load.cache_clear()  # a second process: loads the file, builds nothing
    monkeypatch.setattr(native, "_build", lambda *a: pytest.fail("built a library that was already there"))
    assert native.available()
    assert sorted(p.name for p in empty_native_cache.iterdir()) == built


def test_a_compiler_that_fails_is_one_warning_for_auto_and_one_error_for_native(
    empty_native_cache, monkeypatch, tmp_path
):
    """The failed build is tried once per process; ``auto`` warns once, naming the compiler's failure,
    and the compiled program quantizes (the same bits); an explicit ``native`` is an error naming it."""
    broken = tmp_path / "broken-c++"
    broken.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo broken 1.0; exit 0; fi\necho "no" >&2\nexit 1\n')
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(broken))
    builds = []
    real_build = native._build
    monkeypatch.setattr(native, "_build", lambda *a: builds.append(a) or real_build(*a))
    monkeypatch.setattr(kernel_backends, "cpu_compile_available", lambda: True)
    with pytest.warns(
        UserWarning,
        match="kernels='auto': could not build the native CPU FP4 quantizer .*broken-c\\+\\+ "
        "failed: no\\); the compiled torch program quantizes instead",
    ) as caught:
        assert kernels.resolve_backend("auto", "cpu") == "compiled"
    assert len(caught) == 1
    with warnings.catch_warnings():  # once: the result is kept, no second build and no second warning
        warnings.simplefilter("error")
        assert not native.available()
        assert kernels.resolve_backend("auto", "cpu") == "compiled"
    assert len(builds) == 1
    with pytest.raises(
        ValueError,
        match="kernels='native' .* cannot run here: could not build .*broken-c\\+\\+ failed"
        ".*; use 'auto', 'compiled' .* or 'eager'",
    ):
        kernels.resolve_backend("native", "cpu")
    assert not list(empty_native_cache.glob("*"))  # no partial library left behind
    x, op = torch.randn(16, 32), OperandQuant(scale_format="ue5m3")
    # (not compiled here: torch.compile takes the same broken CXX, and would mark the spec failed for the process)
    q = program.quantize_operand(x, op, cores=NATIVE)
    assert torch.equal(q.scaled, program.quantize_operand(x, op).scaled)
