"""The torch quantization program (nemofp4.kernels.program), run eagerly, against the reference
quantize_blocks: bitwise."""

import pytest
import torch

from nemofp4.formats import QuantizedBlocks, quantize_blocks
from nemofp4.kernels.program import quantize_operand
from nemofp4.quant import OperandQuant
from tests.conftest import QUANT_CASES as CASES
from tests.conftest import quant_inputs as _inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("fmt,block,two_d,rounding,target", CASES)
def test_fast_quantizer_is_bitwise_the_reference(fmt, block, two_d, rounding, target):
    for label, x in _inputs():
        references = [None] if fmt == "ue8m0" else [None, torch.tensor(0.5), torch.tensor(40.0)]
        for reference in references:
            seed = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
            ref = quantize_blocks(x, fmt, block, two_d, target, reference, rounding, seed[0])
            op = OperandQuant(scale_format=fmt, block_size=block, two_d=two_d, rounding=rounding, scale_target=target)
            fast = quantize_operand(x, op, tensor_amax=reference, generator=seed[1], pack=True)
            where = f"{label}, reference={reference}"
            assert torch.equal(fast.scaled, ref.scaled_values()), where
            assert torch.equal(fast.tensor_scale, ref.tensor_scale), where
            assert torch.equal(fast.dequantize(), ref.dequantize()), where
            assert torch.equal(fast.packed.codes, ref.codes), where
            assert torch.equal(fast.packed.scale_codes, ref.scale_codes), where
            assert torch.equal(fast.packed.unpack().scaled, fast.scaled), where
            expected = ref.stats()
            assert fast.stats() == {k: expected[k] for k in ("saturated_blocks", "underflow_blocks", "zero_blocks")}
            # both consumed the generator identically (same draws, same count)
            assert torch.equal(torch.rand(4, generator=seed[0]), torch.rand(4, generator=seed[1])), where


def test_scaled_values_are_exact_in_bfloat16():
    """The premise of the scaled GEMM: E2M1 value x block scale loses nothing in BF16."""
    x = torch.randn(64, 256) * torch.logspace(-5, 5, 256)
    for fmt in ("e4m3", "ue5m3", "ue8m0"):
        q = quantize_operand(x, OperandQuant(scale_format=fmt, block_size=16))
        assert torch.equal(q.scaled.bfloat16().float(), q.scaled), fmt


def test_edge_cases_the_tests_rely_on_occur():
    """The edge inputs above really exercise saturation, underflow and zero blocks."""
    x = dict(_inputs())["edge blocks"]
    q = quantize_operand(x, OperandQuant(scale_format="ue5m3"), tensor_amax=torch.tensor(0.5))
    stats = q.stats()
    assert stats["saturated_blocks"] > 0 and stats["zero_blocks"] > 0
    q = quantize_operand(x, OperandQuant(scale_format="e4m3"))
    assert q.stats()["underflow_blocks"] > 0


def test_non_finite_input_gives_non_finite_output_not_a_crash():
    x = torch.randn(16, 32)
    x[2, 3] = float("nan")
    q = quantize_operand(x, OperandQuant(scale_format="ue5m3"))
    assert torch.isnan(q.dequantize()).any()


def test_packed_operand_survives_the_saved_tensor_round_trip():
    x = torch.randn(40, 64)
    q = quantize_operand(x, OperandQuant(scale_format="ue5m3", two_d=True), pack=True)
    again = QuantizedBlocks.from_tensors(q.packed.tensors(), q.packed.meta()).unpack()
    assert torch.equal(again.scaled, q.scaled)
    assert torch.equal(again.dequantize(), q.dequantize())
    # 4.5 bits per element: half a byte of codes plus one scale byte per 16x16 tile
    assert q.packed.codes.numel() == 48 * 64 // 2 and q.packed.scale_codes.numel() == 3 * 4
