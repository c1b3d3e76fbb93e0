"""The compiled Triton kernels on a CUDA device: bitwise equal to the PyTorch references on the
same device (quantization, amax, the hardware GEMM model), stochastic rounding's rule and
statistics, the quant-operand adapter, and that the dispatchers pick Triton on CUDA.

They need the kernels compiled, so they skip in a process with TRITON_INTERPRET set (tests/conftest.py
sets it only where there is no CUDA device; ``scripts/gpu/gpu_check.sh`` unsets it).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nemofp4 import kernels
from nemofp4.formats import E2M1, amax, quantize_blocks, unpack_fp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set in this process (run tests/gpu separately from tests/unit)",
    ),
]

FORMATS = ["e4m3", "ue5m3", "ue5m3_cuda", "ue8m0"]


def make_input(rows: int, cols: int, seed: int, dtype=torch.bfloat16, edge_cases: bool = True) -> torch.Tensor:
    """Rows of log-normal magnitude; with ``edge_cases`` an outlier, a zero block and tiny blocks
    (left out for the GEMM tests: the float64 group sums are exact only within a 2^31 span)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device="cuda")
    x *= torch.exp(2 * torch.randn(rows, 1, generator=g, device="cuda"))
    if not edge_cases:
        return x.to(dtype)
    x[0, 3] = 40.0
    x[1, :16] = 0.0
    x[2, 16:32] *= 1e-6
    x[3, :8] = 1e-30
    return x.to(dtype)


def assert_same(ours, ref) -> None:
    assert ours.shape == ref.shape and ours.padded_shape == ref.padded_shape
    assert torch.equal(ours.codes, ref.codes), "codes differ"
    assert torch.equal(ours.scale_codes, ref.scale_codes), "scale codes differ"
    assert torch.equal(ours.tensor_scale.view(torch.int32), ref.tensor_scale.view(torch.int32))
    assert torch.equal(ours.tensor_amax.float(), ref.tensor_amax.float())
    assert ours.stats() == ref.stats()


@pytest.mark.parametrize("scale_format", FORMATS)
def test_quantize_matches_reference_on_cuda(scale_format):
    from nemofp4.kernels.quantize import triton_quantize_blocks

    x = make_input(1000, 4104, seed=FORMATS.index(scale_format))  # 4104: not a multiple of 16 x 8
    assert_same(triton_quantize_blocks(x, scale_format=scale_format), quantize_blocks(x, scale_format))
    w = make_input(1030, 520, seed=7).float()
    assert_same(
        triton_quantize_blocks(w, scale_format=scale_format, two_d=True),
        quantize_blocks(w, scale_format, two_d=True),
    )
    q, q_t = triton_quantize_blocks(x, scale_format=scale_format, also_transposed=True)
    assert_same(q, quantize_blocks(x, scale_format))
    assert_same(q_t, quantize_blocks(x.t(), scale_format))
    if scale_format != "ue8m0":
        g = torch.tensor(float(x.float().abs().max()) / 300, device="cuda")  # saturating blocks
        ref = quantize_blocks(x, scale_format, tensor_amax=g)
        assert ref.stats()["saturated_blocks"] > 0
        assert_same(triton_quantize_blocks(x, scale_format=scale_format, tensor_amax=g), ref)


def test_amax_on_cuda():
    from nemofp4.kernels.quantize import triton_amax

    x = make_input(4096, 3000, seed=3)
    assert torch.equal(triton_amax(x), amax(x))
    y = torch.randn(50_000_017, device="cuda")  # many programs x iterations, a ragged tail
    y[-1] = -123.5
    assert float(triton_amax(y)) == 123.5
    y[7] = float("nan")
    assert torch.isnan(triton_amax(y))


def test_sr8_rule_statistics_and_determinism_on_cuda():
    from nemofp4.kernels.quantize import triton_quantize_blocks, triton_quantize_with_draws

    # enc = 1 exactly (block amax 6, g = 448 * 6), so y = x and the rule is checkable directly
    grid = np.array(E2M1._magnitude_values_f64)
    rng = np.random.default_rng(0)
    lower = rng.integers(0, grid.size - 1, size=(4, 15))
    values = (grid[lower] + rng.uniform(0, 1, size=(4, 15)) * (grid[lower + 1] - grid[lower])).astype(np.float32)
    row = np.concatenate([np.full((4, 1), 6.0, np.float32), values], axis=1).reshape(-1)
    draws = 65536
    x = torch.from_numpy(np.tile(row, (draws, 1))).cuda()
    (rows, rows_draws), _ = triton_quantize_with_draws(
        x, scale_format="e4m3", tensor_amax=2688.0, rounding="sr8", seed=1
    )
    r = rows_draws.cpu().numpy().reshape(draws, 4, 16)[:, :, 1:].astype(np.float64)
    frac = (values.astype(np.float64) - grid[lower]) / (grid[lower + 1] - grid[lower])
    away = frac + (2 * r + 1) / 512 >= 1
    magnitude = unpack_fp4(rows.codes).cpu().numpy().reshape(draws, 4, 16)[:, :, 1:] & 7
    np.testing.assert_array_equal(magnitude, np.where(away, lower + 1, lower))
    p_up = np.floor(frac * 256 + 0.5) / 256
    std_error = np.sqrt(np.maximum(p_up * (1 - p_up), 1e-12) / draws)
    assert np.all(np.abs(away.mean(0) - p_up) <= 4 * std_error + 1e-12)
    a = triton_quantize_blocks(x, scale_format="e4m3", tensor_amax=2688.0, rounding="sr8", seed=5)
    b = triton_quantize_blocks(x, scale_format="e4m3", tensor_amax=2688.0, rounding="sr8", seed=5)
    c = triton_quantize_blocks(x, scale_format="e4m3", tensor_amax=2688.0, rounding="sr8", seed=6)
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)


@pytest.mark.parametrize("scale_format", ["ue5m3", "e4m3", "ue8m0"])
def test_hardware_gemm_on_cuda(scale_format):
    from nemofp4.kernels.hardware_gemm import (
        hardware_gemm_reference,
        hardware_gemm_torch,
        triton_hardware_gemm,
    )

    block = 32 if scale_format == "ue8m0" else 16
    qa = quantize_blocks(make_input(300, 1000, seed=1, edge_cases=False).float(), scale_format, block)
    qb = quantize_blocks(make_input(200, 1000, seed=2, edge_cases=False).float() * 0.02, scale_format, block)
    ours = triton_hardware_gemm(qa, qb)
    assert torch.equal(ours.view(torch.int32), hardware_gemm_torch(qa, qb).view(torch.int32))
    small_a = quantize_blocks(make_input(40, 520, seed=3, edge_cases=False).float(), scale_format, block)
    small_b = quantize_blocks(make_input(24, 520, seed=4, edge_cases=False).float(), scale_format, block)
    ref = hardware_gemm_reference(small_a, small_b, lattice_snap=True)
    assert torch.equal(triton_hardware_gemm(small_a, small_b, lattice_snap=True).cpu(), ref)
    w = quantize_blocks(make_input(520, 72, seed=5, edge_cases=False).float(), scale_format, block, two_d=True)
    ref = hardware_gemm_reference(small_a, w, b_transposed=True)
    assert torch.equal(triton_hardware_gemm(small_a, w, b_transposed=True).cpu(), ref)


def test_operand_adapter_and_dispatch_on_cuda(monkeypatch):
    from nemofp4.kernels import operand, quantize
    from nemofp4.kernels.program import quantize_operand
    from nemofp4.quant.config import OperandQuant

    x = make_input(2000, 1024, seed=9)
    for op in (
        OperandQuant(scale_format="ue5m3", reference_interval=50),
        OperandQuant(scale_format="e4m3", two_d=True),
        OperandQuant(scale_format="ue8m0", block_size=32),
    ):
        ref = quantize_operand(x, op, pack=True)
        ours = operand.triton_quantize_operand(x, op, pack=True)
        assert torch.equal(ours.scaled, ref.scaled) and ours.stats() == ref.stats()
        assert torch.equal(ours.packed.codes, ref.packed.codes)
    calls = []
    original = quantize.triton_quantize
    monkeypatch.setattr(quantize, "triton_quantize", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(operand, "triton_quantize", quantize.triton_quantize)
    kernels.quantize_blocks(x, "ue5m3")
    kernels.quantize_operand(x, OperandQuant(scale_format="ue5m3"))
    assert len(calls) == 2
    kernels.quantize_blocks(x, "ue5m3", backend="eager")
    kernels.quantize_operand(x, OperandQuant(scale_format="ue5m3"), backend="compiled")
    assert len(calls) == 2
