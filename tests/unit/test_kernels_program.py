"""The torch quantization program (nemofp4.kernels.program) compiled by Inductor against the
reference quantize_blocks and the same program run eagerly: bitwise, for every scale format and
rounding; and the backend setting that chooses the path."""

import warnings

import pytest
import torch

from nemofp4 import kernels
from nemofp4.formats import quantize_blocks
from nemofp4.kernels import OperandRequest, cpu_compile_available, native, program, toolchain
from nemofp4.kernels import backend as kernel_backends
from nemofp4.kernels.program import COMPILED, EAGER, quantize_operand
from nemofp4.quant import OperandQuant
from tests.conftest import QUANT_CASES as CASES
from tests.conftest import quant_inputs as _inputs

pytestmark = pytest.mark.usefixtures("one_thread")

needs_compiler = pytest.mark.skipif(not cpu_compile_available(), reason="needs a C++ compiler for torch.compile")


def slow(*values):
    """A parameter set that runs only with the slow tests (each compiles a graph of its own)."""
    return pytest.param(*values, marks=pytest.mark.slow)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _cores(compiled: bool):
    return COMPILED if compiled else EAGER


def _forward(x, w, op_x, op_xt, op_w, *, x_amax=None, w_amax=None, pack_x=False, values_xt=True, pack_w=False, **call):
    """X, X^T (``op_xt`` None: not asked for) and W as one program call, what a linear's forward asks."""
    requests = [OperandRequest(x, op_x, pack=pack_x, tensor_amax=x_amax)]
    if op_xt is not None:
        requests.append(OperandRequest(x, op_xt, layout="tokens", pack=True, values=values_xt, tensor_amax=x_amax))
    requests.append(OperandRequest(w, op_w, pack=pack_w, tensor_amax=w_amax))
    qx, *qxt, qw = program.quantize(requests, **call)
    return qx, (qxt[0] if qxt else None), qw


# Every case compiles a graph (about 10 s each on a cold machine): by default every scale format,
# every rounding, both block layouts and both scale targets once; the whole table as slow tests.
FAST = {
    ("e4m3", 16, False, "sr_exact"),
    ("ue5m3", 16, False, "sr8"),
    ("ue5m3_cuda", 16, True, "rne"),
    ("ue8m0", 32, True, "sr"),
}
COMPILED_CASES = [c if c[:4] in FAST else slow(*c) for c in CASES]
# A BF16 operand is read in its own dtype, so it compiles a graph of its own: by default for one case.
FAST_WITH_BF16 = ("ue5m3", 16, False, "sr8")


@needs_compiler
@pytest.mark.parametrize("fmt,block,two_d,rounding,target", COMPILED_CASES)
def test_compiled_program_is_bitwise_the_reference_and_the_eager_program(fmt, block, two_d, rounding, target):
    op = OperandQuant(scale_format=fmt, block_size=block, two_d=two_d, rounding=rounding, scale_target=target)
    for label, x in _inputs():
        if x.dtype != torch.float32 and (fmt, block, two_d, rounding) in FAST - {FAST_WITH_BF16}:
            continue
        references = [None] if fmt == "ue8m0" else [None, torch.tensor(0.5), torch.tensor(40.0)]
        for reference in references:
            seeds = [torch.Generator().manual_seed(11) for _ in range(3)]
            ref = quantize_blocks(x, fmt, block, two_d, target, reference, rounding, seeds[0])
            eager = quantize_operand(x, op, tensor_amax=reference, generator=seeds[1], pack=True)
            fast = quantize_operand(x, op, tensor_amax=reference, generator=seeds[2], pack=True, cores=COMPILED)
            where = f"{label}, reference={reference}"
            assert torch.equal(fast.scaled, ref.scaled_values()), where
            assert torch.equal(_bits(fast.scaled), _bits(eager.scaled)), where  # signed zeros too
            assert torch.equal(fast.tensor_scale, ref.tensor_scale), where
            assert torch.equal(fast.tensor_amax, eager.tensor_amax), where
            assert torch.equal(fast.packed.codes, ref.codes), where
            assert torch.equal(fast.packed.scale_codes, ref.scale_codes), where
            assert torch.equal(fast.packed.unpack().scaled, fast.scaled), where
            expected = ref.stats()
            assert fast.stats() == {k: expected[k] for k in ("saturated_blocks", "underflow_blocks", "zero_blocks")}
            assert fast.num_blocks == eager.num_blocks and fast.shape == eager.shape, where
            # the same draws, and the same number of them
            assert torch.equal(torch.rand(4, generator=seeds[0]), torch.rand(4, generator=seeds[2])), where


@needs_compiler
@pytest.mark.parametrize("rounding", [slow("rne"), "sr8", "sr", slow("sr_exact")])
def test_outputs_without_packing_or_statistics_are_the_same(rounding):
    """The cheaper variants (no codes, no counts) compute the same values."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 3
    op = OperandQuant(scale_format="ue5m3", rounding=rounding)
    kw = dict(cores=COMPILED)
    full = quantize_operand(x, op, generator=torch.Generator().manual_seed(5), pack=True, stats=True, **kw)
    lean = quantize_operand(x, op, generator=torch.Generator().manual_seed(5), pack=False, stats=False, **kw)
    assert torch.equal(_bits(full.scaled), _bits(lean.scaled))
    assert lean.packed is None and lean.counts == {}


@needs_compiler
def test_statistics_on_and_off_share_one_graph():
    """Collecting statistics only on logging steps must not compile another graph variant."""
    op = OperandQuant(scale_format="ue5m3_cuda", rounding="sr8")
    x = torch.randn(32, 64)
    quantize_operand(x, op, generator=torch.Generator().manual_seed(1), stats=False, cores=COMPILED)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    quantize_operand(x, op, generator=torch.Generator().manual_seed(1), stats=True, cores=COMPILED)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@needs_compiler
def test_one_graph_serves_every_operand_shape():
    """Sizes are dynamic: new shapes (ragged ones padded) reuse the compiled graph."""
    op = OperandQuant(scale_format="ue5m3", rounding="rne")
    core = program._compiled((program.CoreSpec("ue5m3", 16, False, "rne", False, True),))
    quantize_operand(torch.randn(48, 64), op, stats=False, cores=COMPILED)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for shape in [(80, 160), (33, 40), (256, 32), (16, 1024)]:
        x = torch.randn(*shape)
        out = quantize_operand(x, op, stats=False, cores=COMPILED)
        assert torch.equal(out.scaled, quantize_operand(x, op, stats=False).scaled), shape
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert core is program._compiled((program.CoreSpec("ue5m3", 16, False, "rne", False, True),))


@needs_compiler
def test_the_program_leaves_the_process_recompile_limit_alone():
    """A run quantizes a dozen operand kinds or more, more than dynamo's recompile limit (8 graphs per
    code object): each kind compiles a function with a code object of its own, so no kind's graph
    counts against another's and no limit is raised."""
    before = torch._dynamo.config.recompile_limit
    for fmt in ("e4m3", "ue5m3"):
        quantize_operand(torch.randn(16, 32), OperandQuant(scale_format=fmt), cores=COMPILED)
    assert torch._dynamo.config.recompile_limit == before
    specs = [
        program.CoreSpec(fmt, 16, two_d, rounding, False, True)
        for fmt in ("e4m3", "ue5m3")
        for two_d in (False, True)
        for rounding in ("rne", "sr", "sr8")
    ]
    codes = {program._compiled((spec,))._torchdynamo_orig_callable.__code__ for spec in specs}
    assert len(codes) == len(specs) > before


# (format, block, rounding, Hadamard, compiled in the default set): each runs eagerly, and compiled
# (a compile each, about 10 s) by default for two of them, the others as slow tests.
TOKEN_CASES = [
    ("e4m3", 16, "sr", True, True),
    ("ue5m3", 16, "sr8", False, True),
    ("e4m3", 16, "rne", True, False),
    ("ue5m3", 16, "rne", False, False),
    ("ue8m0", 32, "sr", True, False),
    ("e4m3", 16, "sr_exact", False, False),
]
TOKEN_PARAMS = [
    pytest.param(
        *case[:4],
        compiled,
        marks=[needs_compiler] + ([] if case[4] else [pytest.mark.slow]) if compiled else [],
        id=f"{'-'.join(map(str, case[:4]))}-{'compiled' if compiled else 'eager'}",
    )
    for case in TOKEN_CASES
    for compiled in (False, True)
]


@pytest.mark.parametrize("fmt,block,rounding,hadamard,compiled", TOKEN_PARAMS)
def test_tokens_operand_is_bitwise_the_quantization_of_the_padded_transpose(fmt, block, rounding, hadamard, compiled):
    """quantize_tokens_operand(x) reads x [T, D] in its own layout (blocks down the columns, the
    Hadamard transform inside the loop) and must equal the reference quantization of the
    materialized wgrad operand: pad the tokens to 16, transpose, transform; the same random draws."""
    from nemofp4.formats import wgrad_hadamard_transform
    from nemofp4.kernels.program import quantize_tokens_operand

    op = OperandQuant(scale_format=fmt, block_size=block, rounding=rounding, hadamard=hadamard)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(39, 48, generator=g) * torch.logspace(-3, 3, 48)  # 39 tokens: padded to 48
    x[:, 5] = 0.0  # a zero column: zero blocks
    for reference in [None] if fmt == "ue8m0" else [None, torch.tensor(7.0)]:
        seeds = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
        t = torch.nn.functional.pad(x, (0, 0, 0, 9)).t()
        if hadamard:
            t = wgrad_hadamard_transform(t)
        ref = quantize_blocks(t.contiguous(), fmt, block, False, 448.0, reference, rounding, seeds[0])
        ours = quantize_tokens_operand(
            x, op, tensor_amax=reference, generator=seeds[1], pack=True, cores=_cores(compiled)
        )
        where = f"reference={reference}"
        assert ours.shape == (48, 48) and ours.padded_shape == ref.padded_shape, where
        assert torch.equal(_bits(ours.scaled), _bits(ref.scaled_values())), where
        assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scale_codes, ref.scale_codes), where
        assert torch.equal(ours.tensor_scale, ref.tensor_scale) and torch.equal(ours.tensor_amax, ref.tensor_amax), (
            where
        )
        assert torch.equal(ours.dequantize(), ref.dequantize()), where
        expected = ref.stats()
        assert ours.stats() == {k: expected[k] for k in ("saturated_blocks", "underflow_blocks", "zero_blocks")}, where
        # the same number of draws from the generator
        assert torch.equal(torch.rand(4, generator=seeds[0]), torch.rand(4, generator=seeds[1])), where


# (format, rounding, held reference, compiled): eager cases are cheap; each compiled one builds a graph.
PAIR_PARAMS = [
    ("ue5m3", "sr8", True, False),
    ("e4m3", "sr_exact", False, False),
    pytest.param("ue5m3", "sr8", True, True, marks=needs_compiler),
    pytest.param("ue5m3", "sr8", False, True, marks=[needs_compiler, pytest.mark.slow]),
    pytest.param("e4m3", "rne", True, True, marks=[needs_compiler, pytest.mark.slow]),
]


@pytest.mark.parametrize("fmt,rounding,held,compiled", PAIR_PARAMS)
def test_the_pair_is_bitwise_x_and_its_padded_transpose_quantized_one_after_the_other(fmt, rounding, held, compiled):
    """quantize_operand_pair (one call, one compiled graph) must equal the reference quantization of X
    along K and then of the padded transpose along the tokens, with one tensor reference and the
    random bits drawn in that order; ragged and whole token counts (the graph's two inputs then share
    their memory) must use the same graph."""
    from nemofp4.kernels.program import quantize_operand_pair

    op = OperandQuant(scale_format=fmt, rounding=rounding)
    graphs = None
    for tokens in (39, 64, 80):  # 39: padded to 48 for X^T only
        x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens)) * torch.logspace(-3, 3, 48)
        reference = torch.tensor(7.0) if held else None
        seeds = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
        ref_x = quantize_blocks(x, fmt, 16, False, 448.0, reference, rounding, seeds[0])
        t = torch.nn.functional.pad(x, (0, 0, 0, -tokens % 16)).t().contiguous()
        ref_xt = quantize_blocks(t, fmt, 16, False, 448.0, reference, rounding, seeds[0])
        qx, qxt = quantize_operand_pair(
            x, op, op, tensor_amax=reference, generator=seeds[1], pack_x=True, cores=_cores(compiled)
        )
        for ours, ref in ((qx, ref_x), (qxt, ref_xt)):
            where = f"tokens={tokens}, {'X' if ours is qx else 'X^T'}"
            assert ours.shape == ref.shape and ours.padded_shape == ref.padded_shape, where
            assert torch.equal(_bits(ours.scaled), _bits(ref.scaled_values())), where
            assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scale_codes, ref.scale_codes), where
            assert torch.equal(ours.tensor_scale, ref.tensor_scale), where
            expected = ref.stats()
            assert ours.stats() == {k: expected[k] for k in ("saturated_blocks", "underflow_blocks", "zero_blocks")}, (
                where
            )
        assert torch.equal(torch.rand(4, generator=seeds[0]), torch.rand(4, generator=seeds[1])), tokens
        if compiled:
            graphs = graphs or torch._dynamo.utils.counters["stats"]["unique_graphs"]
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, tokens


def test_the_pair_refuses_a_hadamard_transform_on_x_transposed():
    from nemofp4.kernels.program import quantize_operand_pair

    op = OperandQuant(scale_format="e4m3")
    with pytest.raises(ValueError, match="without a Hadamard transform on X"):
        quantize_operand_pair(torch.randn(16, 16), op, OperandQuant(scale_format="e4m3", hadamard=True))


_FORWARD_SPECS = {
    "ue5m3 tiles, held references": (
        OperandQuant(scale_format="ue5m3"),
        OperandQuant(scale_format="ue5m3", two_d=True),
        torch.tensor(7.0),
        torch.tensor(0.5),
    ),
    "e4m3, sr8 everywhere, measured": (
        OperandQuant(scale_format="e4m3", rounding="sr8"),
        OperandQuant(scale_format="e4m3", rounding="sr8"),
        None,
        None,
    ),
    "ue8m0": (OperandQuant(scale_format="ue8m0"), OperandQuant(scale_format="ue8m0"), None, None),
}


# eager: every case; compiled (a graph each): one in the suite, one more behind the slow marker
FORWARD_PARAMS = [(case, with_xt, False) for case in _FORWARD_SPECS for with_xt in (True, False)] + [
    pytest.param("e4m3, sr8 everywhere, measured", True, True, marks=needs_compiler),
    pytest.param("ue5m3 tiles, held references", False, True, marks=[needs_compiler, pytest.mark.slow]),
]


@pytest.mark.parametrize("case,with_xt,compiled", FORWARD_PARAMS)
def test_the_forward_operands_are_bitwise_the_pair_then_the_weight(case, with_xt, compiled):
    """The forward's three requests (one call, one compiled graph) equal X and X^T (quantize_operand_pair,
    or X alone) and then W (quantize_operand), each with its own tensor reference, the random bits
    drawn in that order, W's padded rows and columns included."""
    from nemofp4.kernels.program import quantize_operand_pair

    op_x, op_w, x_amax, w_amax = _FORWARD_SPECS[case]
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(39, 48, generator=gen), torch.randn(40, 48, generator=gen) * 0.01
    seeds = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    if with_xt:
        expected = quantize_operand_pair(x, op_x, op_x, tensor_amax=x_amax, generator=seeds[0], pack_x=True)
    else:
        expected = quantize_operand(x, op_x, tensor_amax=x_amax, generator=seeds[0], pack=True), None
    expected += (quantize_operand(w, op_w, tensor_amax=w_amax, generator=seeds[0], pack=True),)
    ours = _forward(
        x,
        w,
        op_x,
        op_x if with_xt else None,
        op_w,
        x_amax=x_amax,
        w_amax=w_amax,
        generator=seeds[1],
        pack_x=True,
        pack_w=True,
        cores=_cores(compiled),
    )
    assert (ours[1] is None) is not with_xt
    for name, q, ref in zip(("X", "X^T", "W"), ours, expected, strict=True):
        if ref is None:
            continue
        assert q.shape == ref.shape and q.padded_shape == ref.padded_shape and q.two_d == ref.two_d, name
        assert torch.equal(_bits(q.scaled), _bits(ref.scaled)), name
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scale_codes, ref.scale_codes), name
        assert torch.equal(q.tensor_scale, ref.tensor_scale) and torch.equal(q.tensor_amax, ref.tensor_amax), name
    assert torch.equal(torch.rand(4, generator=seeds[0]), torch.rand(4, generator=seeds[1]))


_PACKED_ALONE_CASES = [
    ("rows", "ue5m3", False, False),
    ("tokens", "ue5m3", False, False),
    ("tokens", "e4m3", True, False),
    ("pair", "ue5m3", False, False),
    ("forward", "e4m3", False, False),
    pytest.param("forward", "ue5m3", False, True, marks=needs_compiler),
]


@pytest.mark.parametrize("entry,fmt,hadamard,compiled", _PACKED_ALONE_CASES)
def test_an_operand_only_saved_for_backward_comes_packed_alone(entry, fmt, hadamard, compiled):
    """``values=False`` (``values_xt=False``): the operand (X^T) has no scaled values, and everything
    else (its packed and scale codes, tensor scale and reference, X and W, the random bits drawn) is
    bitwise what the same call with values gives; its dequantize (decoded from the codes) too."""
    from nemofp4.kernels.program import quantize_operand_pair, quantize_tokens_operand

    op = OperandQuant(scale_format=fmt, rounding="sr8", hadamard=hadamard)
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(39, 48, generator=gen), torch.randn(40, 48, generator=gen) * 0.01
    seeds = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)

    def run(values: bool, seed: torch.Generator):
        options = dict(generator=seed, cores=_cores(compiled))
        if entry == "rows":
            return (quantize_operand(x, op, pack=True, values=values, **options),)
        if entry == "tokens":
            return (quantize_tokens_operand(x, op, pack=True, values=values, **options),)
        if entry == "pair":
            return quantize_operand_pair(x, op, op, values_xt=values, **options)[::-1]
        xt_first = _forward(
            x, w, op, op, OperandQuant(scale_format=fmt, two_d=True), pack_w=True, values_xt=values, **options
        )
        return xt_first[1], xt_first[0], xt_first[2]

    (ours_xt, *ours_rest), (ref_xt, *ref_rest) = run(False, seeds[0]), run(True, seeds[1])
    assert ours_xt.scaled is None and ref_xt.scaled is not None
    for name in ("codes", "scale_codes", "tensor_scale", "tensor_amax"):
        assert torch.equal(getattr(ours_xt, name), getattr(ref_xt, name)), name
    assert ours_xt.meta() == ref_xt.meta()
    assert torch.equal(_bits(ours_xt.dequantize()), _bits(ref_xt.dequantize()))
    for ours, ref in zip(ours_rest, ref_rest, strict=True):
        assert torch.equal(_bits(ours.scaled), _bits(ref.scaled))
    assert torch.equal(torch.rand(4, generator=seeds[0]), torch.rand(4, generator=seeds[1]))


def test_an_operand_without_values_must_be_packed():
    from nemofp4.kernels.program import quantize_tokens_operand

    with pytest.raises(ValueError, match="values=False keeps only the packed form: it needs pack=True"):
        quantize_tokens_operand(torch.randn(16, 16), OperandQuant(scale_format="ue5m3"), values=False)


@pytest.mark.parametrize("hadamard", [False, True])
def test_nvfp4_dequantize_of_a_wgrad_operand_without_codes_is_the_reference_one(hadamard):
    """Without packed codes NVFP4's dequantize divides the scaled form by the block scales; a wgrad
    operand's scaled form is a transposed view, divided in its memory order (no copy): the same bits
    as the reference's dequantize of the materialized operand, returned as the same transposed layout."""
    from nemofp4.formats import wgrad_hadamard_transform
    from nemofp4.kernels.program import quantize_tokens_operand

    x = torch.randn(39, 48, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 3, 48)
    x[:, 5] = 0.0  # zero blocks: a zero scale divides only zeros
    t = torch.nn.functional.pad(x, (0, 0, 0, 9)).t()
    t = wgrad_hadamard_transform(t) if hadamard else t
    ref = quantize_blocks(t.contiguous(), "e4m3", 16)
    ours = quantize_tokens_operand(x, OperandQuant(scale_format="e4m3", hadamard=hadamard))
    assert ours.codes is None and ours.scaled.stride() == (1, 48)
    dequantized = ours.dequantize()
    assert dequantized.shape == (48, 48) and dequantized.stride() == (1, 48)
    assert torch.equal(_bits(dequantized), _bits(ref.dequantize()))


def test_non_2d_input_is_refused_by_name():
    with pytest.raises(ValueError, match="2-D tensor"):
        quantize_operand(torch.randn(16), OperandQuant(scale_format="ue5m3"))


@pytest.mark.parametrize("rounding", ["sr8", "sr"])
def test_stochastic_rounding_refuses_an_operand_beyond_its_32_bit_element_index(rounding):
    """The random bytes are hashed from 32-bit element indices: 2^33 elements (a meta tensor, no memory)
    would repeat them, so both the program and the reference's draws refuse it, naming the count."""
    from nemofp4.formats import sr8_draws

    x = torch.empty(1 << 17, 1 << 16, device="meta")
    with pytest.raises(ValueError, match=f"{1 << 33} elements is more than 2\\^32"):
        quantize_operand(x, OperandQuant(scale_format="ue5m3", rounding=rounding))
    with pytest.raises(ValueError, match=f"{1 << 33} elements is more than 2\\^32"):
        sr8_draws((1 << 33,), None, "meta")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_compiler)], ids=["eager", "compiled"])
def test_sr8_bytes_are_the_unsigned_32_bit_hash_for_every_key_and_index(compiled):
    """The hash runs in int32 words: the multiplies wrap and the right shifts are masked to act as
    unsigned ones. Keys and indices with the top bit set (negative as int32), and indices near 2^32,
    give numpy's uint32 arithmetic's bytes, eagerly and in Inductor's vector loop (a tail of 5
    elements included); an unmasked (arithmetic) shift or a product kept in 64 bits would not."""
    import numpy as np

    from nemofp4.formats import sr8_bytes_at

    top_bit, last = torch.arange((1 << 31) - 2, (1 << 31) + 2), torch.arange((1 << 32) - 4096, 1 << 32)
    index = torch.cat([torch.arange(4099), top_bit, last])

    def documented(key: int) -> np.ndarray:
        x = index.numpy().astype(np.uint32) ^ np.uint32(key)
        for _ in range(3):
            x = ((x >> np.uint32(16)) ^ x) * np.uint32(0x45D9F3B)
        return (x >> np.uint32(24)).astype(np.uint8)

    def bytes_at(key, index):
        return sr8_bytes_at(key, index).to(torch.uint8)

    run = torch.compile(bytes_at, fullgraph=True, dynamic=False) if compiled else bytes_at
    for key in (0, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF):
        got = run(torch.tensor(key, dtype=torch.int64), index)
        np.testing.assert_array_equal(got.numpy(), documented(key), err_msg=f"key {key:#x}")


@needs_compiler
def test_backend_setting_picks_the_path(monkeypatch):
    calls = []
    real = program.quantize
    monkeypatch.setattr(program, "quantize", lambda *a, **k: calls.append(k["cores"]) or real(*a, **k))
    monkeypatch.setattr(kernel_backends, "cpu_compile_available", lambda: True)
    x = torch.randn(16, 32)
    for backend in ("auto", "native", "compiled", "eager"):
        kernels.quantize_operand(x, OperandQuant(scale_format="ue5m3"), backend=backend)
    native_cores = kernel_backends.NativeBackend.cores
    auto = native_cores if native.available() else COMPILED
    assert calls == [auto, native_cores, COMPILED, EAGER]
    assert native_cores.rest is COMPILED  # the native runner hands what it does not cover to the compiled program
    # the native build failed: auto warns and takes the compiled program, native is an error
    monkeypatch.setattr(native, "_load", lambda: (None, "the build failed"))
    monkeypatch.setattr(kernel_backends, "_warned", set())
    with pytest.warns(UserWarning, match="kernels='auto': the build failed; the compiled torch program"):
        assert kernels.resolve_backend("auto", "cpu") == "compiled"
    with pytest.raises(ValueError, match="kernels='native' .* cannot run here: the build failed; use 'auto'"):
        kernels.resolve_backend("native", "cpu")
    monkeypatch.setattr(kernel_backends, "cpu_compile_available", lambda: False)
    with pytest.warns(UserWarning, match="kernels='auto': no C\\+\\+ compiler .*; the eager torch program"):
        assert kernels.resolve_backend("auto", "cpu") == "eager"
    for explicit in ("compiled", "native"):  # no compiler: an explicit compiling path is one clear error
        with pytest.raises(ValueError, match=f"kernels='{explicit}' .* cannot run here: no C\\+\\+ compiler"):
            kernels.resolve_backend(explicit, "cpu")
    with pytest.raises(
        ValueError,
        match="kernels='native' .* cannot run here: it quantizes CPU tensors, and these "
        "are on cuda; use 'auto', 'triton', 'compiled' or 'eager'",
    ):
        kernels.resolve_backend("native", "cuda")
    with pytest.raises(
        ValueError, match="unknown FP4 kernel backend 'fast'; valid: auto, triton, native, compiled, eager"
    ):
        kernels.quantize_operand(x, OperandQuant(scale_format="ue5m3"), backend="fast")


def test_no_compiler_on_path_means_no_compiled_program(monkeypatch):
    toolchain.cpu_compile_available.cache_clear()
    try:
        monkeypatch.setenv("PATH", "")
        monkeypatch.delenv("CXX", raising=False)
        assert not toolchain.cpu_compile_available()
    finally:
        toolchain.cpu_compile_available.cache_clear()


@needs_compiler
@pytest.mark.parametrize(
    "shape,two_d", [slow((16, 16), True), ((5, 16), False), slow((1, 32), False), ((1, 1), False), ((3, 7), True)]
)
def test_single_block_and_tiny_operands(shape, two_d):
    """One block row or column (size-1 dims, which the compiler specializes) and padding."""
    op = OperandQuant(scale_format="ue5m3", two_d=two_d)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    fast, eager = quantize_operand(x, op, pack=True, cores=COMPILED), quantize_operand(x, op, pack=True)
    assert torch.equal(_bits(fast.scaled), _bits(eager.scaled))
    assert torch.equal(fast.packed.codes, eager.packed.codes)
    assert torch.equal(fast.packed.scale_codes, eager.packed.scale_codes)


def test_a_failed_build_warns_falls_back_and_keeps_the_numerics(monkeypatch):
    """A toolchain that cannot build the kernel must not stop training: the call warns naming the
    spec, returns the eager result from the same random draws, and later calls of that spec skip the
    compiled path; another spec still compiles (the fallback is not process-wide)."""
    builds = []

    def broken(spec):
        builds.append(spec)

        def build(*args):
            raise torch._dynamo.exc.BackendCompilerFailed("inductor", RuntimeError("no working C++ compiler"), None)

        return build

    monkeypatch.setattr(program, "_compiled", broken)
    monkeypatch.setattr(program, "_failed_builds", set())
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
    op = OperandQuant(scale_format="ue5m3", rounding="sr8")
    with pytest.warns(
        UserWarning, match=r"(?s)could not build the CPU FP4 quantizer for ue5m3 blocks of 16, sr8.*no working C"
    ):
        fast = quantize_operand(x, op, generator=torch.Generator().manual_seed(3), pack=True, cores=COMPILED)
    eager = quantize_operand(x, op, generator=torch.Generator().manual_seed(3), pack=True)
    assert torch.equal(_bits(fast.scaled), _bits(eager.scaled))
    assert torch.equal(fast.packed.codes, eager.packed.codes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the spec runs eagerly without another attempt
        quantize_operand(x, op, generator=torch.Generator().manual_seed(3), pack=True, cores=COMPILED)
    assert len(builds) == 1
    with pytest.warns(UserWarning, match="for ue5m3 blocks of 16, rne"):  # another spec still tries to compile
        quantize_operand(x, OperandQuant(scale_format="ue5m3"), cores=COMPILED)
    assert len(builds) == 2
    assert toolchain.cpu_compile_available() == (toolchain.compiler() is not None)


def test_describe_names_the_path_the_backend_takes(monkeypatch):
    monkeypatch.setattr(kernel_backends, "cpu_compile_available", lambda: True)
    assert "compiled torch program" in kernels.describe("cpu")
    assert "kernels=eager" in kernels.describe("cpu", "eager")
    monkeypatch.setattr(kernel_backends, "cpu_compile_available", lambda: False)
    monkeypatch.setattr(kernel_backends, "_warned", set())
    with pytest.warns(UserWarning, match="kernels='auto': no C\\+\\+ compiler"):
        assert "eager torch program (no Triton" in kernels.describe("cpu")


def test_train_kernels_takes_every_backend_and_reference_is_a_deprecated_alias():
    from nemofp4.training.config import TrainConfig

    for backend in kernels.BACKENDS:
        assert TrainConfig(kernels=backend).kernels == backend
    with pytest.warns(FutureWarning, match="train.kernels=reference is deprecated; it means train.kernels=eager"):
        assert TrainConfig(kernels="reference").kernels == "eager"
    with pytest.raises(ValueError, match="train.kernels='fast'; valid: auto, triton, native, compiled, eager"):
        TrainConfig(kernels="fast")


def test_the_planner_plans_the_quantizer_the_kernels_resolve_for_a_gpu_job():
    """The planner does not read the knob itself: ``kernels.gpu_quantizer`` names the quantizer of a
    CUDA job for every setting, and refuses a name outside ``BACKENDS``."""
    assert {b: kernels.gpu_quantizer(b) for b in kernels.BACKENDS} == {
        "auto": "triton",
        "triton": "triton",
        "native": "triton",
        "compiled": "triton",
        "eager": "eager",
    }
    with pytest.raises(ValueError, match="train.kernels='fast'; valid"):
        kernels.gpu_quantizer("fast")


def test_set_quant_backend_reaches_every_linear_and_refuses_unknown_names():
    from nemofp4.models import build_model, get_model_config
    from nemofp4.quant import quant_linears, set_quant_backend
    from nemofp4.recipes import apply_recipe, get_recipe

    model = build_model(get_model_config("tiny"), device="meta")
    apply_recipe(model, get_recipe("ue5m3"), log=False)
    set_quant_backend(model, "eager")
    cpu = torch.device("cpu")
    assert {(m.quant_backend, m.quant_state.kernels_for(cpu).name) for _, m in quant_linears(model)} == {
        ("eager", "eager")
    }
    set_quant_backend(model, "auto")  # stored once per module: a new setting replaces what it resolved to
    assert {m.quant_state.kernels_for(cpu).name for _, m in quant_linears(model)} == {
        kernels.resolve_backend("auto", cpu)
    }
    with pytest.raises(ValueError, match="unknown FP4 kernel backend 'reference'"):
        set_quant_backend(model, "reference")


@needs_compiler
@pytest.mark.parametrize("shape", [(64, 48), slow((16, 16)), slow((40, 1024)), (64, 13)])
def test_compiled_hadamard_transform_is_bitwise_the_eager_one(shape):
    from nemofp4.formats import wgrad_hadamard_transform
    from nemofp4.kernels.program import compiled_hadamard_transform

    x = torch.randn(shape[1] + 3, shape[0], generator=torch.Generator().manual_seed(7)) * 100
    xt = torch.nn.functional.pad(x, (0, 0, 0, -x.shape[0] % 16)).t()  # as QuantLinear calls it: [K, Tp], a view
    assert torch.equal(_bits(compiled_hadamard_transform(xt)), _bits(wgrad_hadamard_transform(xt)))


@pytest.mark.parametrize("source", ["e4m3", "ue5m3", "ue8m0"])
def test_a_new_scale_format_is_one_row_of_the_table(source, monkeypatch):
    """A copy of a table row under a new name quantizes (reference and torch program), decodes and
    scales a GEMM bit for bit as the original: no quantizer or GEMM branches on a format's name."""
    import dataclasses

    from nemofp4.formats import SCALE_FORMAT_TABLE, SCALE_FORMATS, tensor_scale_product

    new = f"copy_of_{source}"
    monkeypatch.setitem(SCALE_FORMAT_TABLE, new, dataclasses.replace(SCALE_FORMAT_TABLE[source], name=new))
    monkeypatch.setitem(SCALE_FORMATS, new, SCALE_FORMATS[source])
    if source in program._SCALE_GRIDS:  # built from the table at import, as a new row's would be
        monkeypatch.setitem(program._SCALE_GRIDS, new, program._SCALE_GRIDS[source])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g) * torch.logspace(-6, 6, 64)
    x[3] = 0.0
    block = SCALE_FORMAT_TABLE[source].default_block_size
    quantized = {}
    for fmt in (source, new):
        op = OperandQuant(scale_format=fmt, block_size=block, rounding="sr8")
        quantized[fmt] = (
            quantize_blocks(x, fmt, rounding="sr8", generator=torch.Generator().manual_seed(4)),
            quantize_operand(x, op, generator=torch.Generator().manual_seed(4), pack=True),
        )
    for reference, copied in zip(quantized[source], quantized[new]):
        assert copied.scale_format == new
        assert torch.equal(copied.codes, reference.codes) and torch.equal(copied.scale_codes, reference.scale_codes)
        assert torch.equal(_bits(copied.tensor_scale), _bits(reference.tensor_scale))
        assert torch.equal(_bits(copied.dequantize()), _bits(reference.dequantize()))
        assert {k: int(v) for k, v in copied.counts.items()} == {k: int(v) for k, v in reference.counts.items()}
    a, b = quantized[source][0], quantized[new][0]
    assert torch.equal(_bits(tensor_scale_product(b, b)), _bits(tensor_scale_product(a, a)))
    assert torch.equal(_bits(tensor_scale_product(a, b)), _bits(tensor_scale_product(a, a)))  # one family


@pytest.mark.parametrize("fmt", ["e4m3", "ue5m3"])
def test_a_bf16_operand_quantizes_as_its_float32_copy_and_dequantizing_leaves_it_alone(fmt):
    """The program reads a BF16 operand in its own dtype (converted exactly where it is read, no
    float32 copy): the same bits as quantizing ``x.float()``, both layouts. And dequantize() (in place
    on a fresh tensor) leaves the operand's scaled form unchanged, so it can be called twice."""
    from nemofp4.kernels.program import quantize_tokens_operand

    x = (torch.randn(39, 64, generator=torch.Generator().manual_seed(8)) * torch.logspace(-3, 3, 64)).bfloat16()
    for quantize, op in (
        (quantize_operand, OperandQuant(scale_format=fmt, two_d=True)),
        (quantize_tokens_operand, OperandQuant(scale_format=fmt, rounding="sr8", hadamard=fmt == "e4m3")),
    ):
        ours = quantize(x, op, generator=torch.Generator().manual_seed(2), pack=True)
        copy = quantize(x.float(), op, generator=torch.Generator().manual_seed(2), pack=True)
        assert torch.equal(_bits(ours.scaled), _bits(copy.scaled)) and torch.equal(ours.codes, copy.codes)
        assert torch.equal(ours.scale_codes, copy.scale_codes) and torch.equal(ours.tensor_amax, copy.tensor_amax)
        scaled = ours.scaled.clone()
        first = ours.dequantize()
        assert torch.equal(_bits(ours.scaled), _bits(scaled))
        assert torch.equal(_bits(ours.dequantize()), _bits(first))
        assert torch.equal(_bits(ours.packed.dequantize()), _bits(first))  # from the codes, in place too


def test_the_bitwise_sign_is_copysign_bit_for_bit():
    """The core applies an element's sign by a bitwise or where its compiled loop is float32-wide (and
    by copysign itself elsewhere): it must be copysign(|m|, x) exactly, for negative zeros,
    infinities and subnormals of x and for every E2M1 magnitude, zero included."""
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, float("inf"), float("-inf"), 3.5, -3.5])
    x = torch.cat([specials, torch.randn(1000, generator=torch.Generator().manual_seed(4))])
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]).repeat_interleave(2).repeat(64)[: x.numel()]
    ours = program._copysign(magnitudes, x, bitwise=True)
    assert torch.equal(_bits(ours), _bits(torch.copysign(magnitudes, x)))


@pytest.mark.parametrize("backend", ["eager", pytest.param("native", marks=needs_compiler)])
def test_kernels_quantize_blocks_runs_the_backend_not_the_reference(backend, monkeypatch):
    """``kernels.quantize_blocks(..., backend=)`` quantizes on the path the setting resolves to (never
    the float64 reference) and equals the reference bit for bit: codes, scale codes, tensor scale and
    reference, the decoded tensor and the block counts, for any leading dims, tiles, MX blocks, a held
    reference and stochastic rounding (the same draws: the generators agree after). ``native`` hands the
    cases its kernel does not cover (MX blocks, exact stochastic rounding) to the compiled program, so it
    runs both; the compiled program alone compiles a graph per case for no other path."""
    real = quantize_blocks
    cases = [
        ((2, 5, 70), dict(scale_format="ue5m3")),
        ((37, 50), dict(scale_format="e4m3", two_d=True)),
        ((70,), dict(scale_format="ue8m0")),
        ((9, 48), dict(scale_format="ue5m3", tensor_amax=3.0)),
        ((33, 64), dict(scale_format="ue5m3", rounding="sr8")),
        ((33, 64), dict(scale_format="e4m3", rounding="sr_exact")),
    ]
    references = []
    for shape, kw in cases:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))) * 5
        seeds = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
        references.append((x, kw, seeds, real(x, generator=seeds[0], **kw)))

    def no_reference(*args, **kwargs):
        raise AssertionError("kernels.quantize_blocks ran the float64 reference")

    monkeypatch.setattr(kernel_backends, "quantize_blocks", no_reference)
    monkeypatch.setattr("nemofp4.formats.block.quantize_with_spec", no_reference)
    for x, kw, seeds, ref in references:
        ours = kernels.quantize_blocks(x, generator=seeds[1], backend=backend, **kw)
        where = f"{tuple(x.shape)} {kw}"
        assert ours.shape == ref.shape and ours.padded_shape == ref.padded_shape and ours.two_d == ref.two_d, where
        assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scale_codes, ref.scale_codes), where
        assert torch.equal(_bits(ours.tensor_scale), _bits(ref.tensor_scale)), where
        assert torch.equal(_bits(ours.tensor_amax), _bits(ref.tensor_amax)), where
        assert torch.equal(_bits(ours.dequantize()), _bits(ref.dequantize())), where
        expected = {k: v for k, v in ref.stats().items() if k != "clipped_elements"}
        assert ours.stats() == expected and ours.num_blocks == ref.num_blocks, where
        assert torch.equal(torch.rand(4, generator=seeds[0]), torch.rand(4, generator=seeds[1])), where
