"""The Inductor-compiled CPU operand quantizer (nemofp4.kernels.compiled) against the reference
quantize_blocks and the eager fast path: bitwise, for every format and rounding it compiles."""

import itertools

import pytest
import torch

from nemofp4 import kernels
from nemofp4.formats import quantize_blocks
from nemofp4.kernels import compiled
from nemofp4.kernels.compiled import compiled_quantize_operand, cpu_compile_available
from nemofp4.quant import OperandQuant
from nemofp4.quant.blocks import quantize_operand
from tests.unit.test_quant_blocks import _inputs
from tests.unit.test_quant_standin import one_thread  # noqa: F401 (autouse fixture)

needs_compiler = pytest.mark.skipif(not cpu_compile_available(), reason="needs a C++ compiler for torch.compile")

CASES = [
    (fmt, 16, two_d, rounding, 448.0)
    for fmt, two_d, rounding in itertools.product(["e4m3", "ue5m3", "ue5m3_cuda"], [False, True], ["rne", "sr8"])
] + [("ue5m3", 16, False, "sr8", 2048.0), ("e4m3", 32, False, "rne", 448.0)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@needs_compiler
@pytest.mark.parametrize("fmt,block,two_d,rounding,target", CASES)
def test_compiled_quantizer_is_bitwise_the_reference(fmt, block, two_d, rounding, target):
    op = OperandQuant(scale_format=fmt, block_size=block, two_d=two_d, rounding=rounding, scale_target=target)
    for label, x in _inputs():
        for reference in (None, torch.tensor(0.5), torch.tensor(40.0)):
            seeds = [torch.Generator().manual_seed(11) for _ in range(3)]
            ref = quantize_blocks(x, fmt, block, two_d, target, reference, rounding, seeds[0])
            eager = quantize_operand(x, op, tensor_amax=reference, generator=seeds[1], pack=True)
            fast = compiled_quantize_operand(x, op, tensor_amax=reference, generator=seeds[2], pack=True)
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
@pytest.mark.parametrize("rounding", ["rne", "sr8"])
def test_outputs_without_packing_or_statistics_are_the_same(rounding):
    """The cheaper variants (no codes, no counts) compute the same values."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 3
    op = OperandQuant(scale_format="ue5m3", rounding=rounding)
    full = compiled_quantize_operand(x, op, generator=torch.Generator().manual_seed(5), pack=True, stats=True)
    lean = compiled_quantize_operand(x, op, generator=torch.Generator().manual_seed(5), pack=False, stats=False)
    assert torch.equal(_bits(full.scaled), _bits(lean.scaled))
    assert lean.packed is None and lean.counts == {}


@needs_compiler
def test_one_graph_serves_every_operand_shape():
    """Sizes are dynamic: new shapes (ragged ones padded) reuse the compiled graph."""
    op = OperandQuant(scale_format="ue5m3", rounding="rne")
    core = compiled._compiled(compiled._Spec("ue5m3", 16, False, "rne", False, False))
    compiled_quantize_operand(torch.randn(48, 64), op, stats=False)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for shape in [(80, 160), (33, 40), (256, 32), (16, 1024)]:
        x = torch.randn(*shape)
        out = compiled_quantize_operand(x, op, stats=False)
        assert torch.equal(out.scaled, quantize_operand(x, op, stats=False).scaled), shape
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert core is compiled._compiled(compiled._Spec("ue5m3", 16, False, "rne", False, False))


@needs_compiler
def test_the_eager_core_is_the_compiled_core():
    """``compile=False`` runs the same function eagerly: the compiler changed nothing."""
    x = torch.randn(40, 80, generator=torch.Generator().manual_seed(2))
    for op in (OperandQuant(scale_format="e4m3", rounding="sr8"), OperandQuant(scale_format="ue5m3", two_d=True)):
        args = dict(tensor_amax=torch.tensor(2.0), pack=True)
        a = compiled_quantize_operand(x, op, generator=torch.Generator().manual_seed(9), **args)
        b = compiled_quantize_operand(x, op, generator=torch.Generator().manual_seed(9), compile=False, **args)
        assert torch.equal(_bits(a.scaled), _bits(b.scaled))
        assert torch.equal(a.packed.codes, b.packed.codes) and torch.equal(a.packed.scale_codes, b.packed.scale_codes)


def test_unsupported_operands_are_refused_by_name():
    with pytest.raises(ValueError, match="'ue8m0' with 'rne'"):
        compiled_quantize_operand(torch.randn(16, 32), OperandQuant(scale_format="ue8m0", block_size=32))
    with pytest.raises(ValueError, match="'ue5m3' with 'sr'"):
        compiled_quantize_operand(torch.randn(16, 32), OperandQuant(scale_format="ue5m3", rounding="sr"))
    with pytest.raises(ValueError, match="2-D tensor"):
        compiled_quantize_operand(torch.randn(16), OperandQuant(scale_format="ue5m3"))


def test_dispatch_picks_the_compiled_path_on_cpu_and_the_switch_turns_it_off(monkeypatch):
    calls = []
    monkeypatch.setattr(compiled, "compiled_quantize_operand", lambda *a, **k: calls.append("compiled"))
    monkeypatch.setattr(compiled, "cpu_compile_available", lambda: True)
    x = torch.randn(16, 32)
    kernels.quantize_operand(x, OperandQuant(scale_format="ue5m3"))
    assert calls == ["compiled"]
    # formats and roundings it does not compile, and the reference switch, take the eager path
    assert kernels.quantize_operand(x, OperandQuant(scale_format="ue8m0", block_size=32)).scaled.shape == (16, 32)
    assert kernels.quantize_operand(x, OperandQuant(scale_format="ue5m3", rounding="sr")).scaled.shape == (16, 32)
    with kernels.using_triton(False):
        assert kernels.quantize_operand(x, OperandQuant(scale_format="ue5m3")).scaled.shape == (16, 32)
    assert calls == ["compiled"]


def test_environment_switch_disables_compilation(monkeypatch):
    compiled.cpu_compile_available.cache_clear()
    try:
        monkeypatch.setenv("NEMOFP4_CPU_COMPILE", "0")
        assert not compiled.cpu_compile_available()
        monkeypatch.setenv("NEMOFP4_CPU_COMPILE", "1")
        monkeypatch.setenv("PATH", "")
        monkeypatch.delenv("CXX", raising=False)
        compiled.cpu_compile_available.cache_clear()
        assert not compiled.cpu_compile_available()  # no compiler to be found
    finally:
        compiled.cpu_compile_available.cache_clear()


@needs_compiler
@pytest.mark.parametrize("shape,two_d", [((16, 16), True), ((5, 16), False), ((1, 32), False), ((1, 1), False), ((3, 7), True)])
def test_single_block_and_tiny_operands(shape, two_d):
    """One block row or column (size-1 dims, which the compiler specializes) and padding."""
    op = OperandQuant(scale_format="ue5m3", two_d=two_d)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    fast, eager = compiled_quantize_operand(x, op, pack=True), quantize_operand(x, op, pack=True)
    assert torch.equal(_bits(fast.scaled), _bits(eager.scaled))
    assert torch.equal(fast.packed.codes, eager.packed.codes)
    assert torch.equal(fast.packed.scale_codes, eager.packed.scale_codes)


def test_a_failed_build_warns_falls_back_and_keeps_the_numerics(monkeypatch):
    """A toolchain that cannot build the kernel must not stop training: the call warns, returns
    the eager result from the same random draws, and later calls skip the compiled path."""

    def broken(spec):
        def build(*args):
            raise torch._dynamo.exc.BackendCompilerFailed("inductor", RuntimeError("no working C++ compiler"), None)

        return build

    monkeypatch.setattr(compiled, "_compiled", broken)
    monkeypatch.setattr(compiled, "_compile_failed", False)
    compiled.cpu_compile_available.cache_clear()
    try:
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
        op = OperandQuant(scale_format="ue5m3", rounding="sr8")
        with pytest.warns(UserWarning, match=r"(?s)could not build the CPU FP4 quantizer.*no working C"):
            fast = compiled_quantize_operand(x, op, generator=torch.Generator().manual_seed(3), pack=True)
        eager = quantize_operand(x, op, generator=torch.Generator().manual_seed(3), pack=True)
        assert torch.equal(_bits(fast.scaled), _bits(eager.scaled))
        assert torch.equal(fast.packed.codes, eager.packed.codes)
        assert not compiled.cpu_compile_available()
    finally:
        compiled.cpu_compile_available.cache_clear()


def test_describe_names_the_path_the_dispatcher_takes(monkeypatch):
    monkeypatch.setattr(compiled, "cpu_compile_available", lambda: True)
    assert "compiled CPU quantizer" in kernels.describe("cpu")
    monkeypatch.setattr(compiled, "cpu_compile_available", lambda: False)
    assert "eager PyTorch path (no C++ compiler" in kernels.describe("cpu")
    with kernels.using_triton(False):
        assert "switched off" in kernels.describe("cpu")
