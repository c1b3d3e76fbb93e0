"""The ``hardware`` GEMM model (UE5M3 paper, section 6): exact building blocks (RNE of an exact
sum, round-toward-zero addition) against rational arithmetic, the model's semantics on
hand-built operands, and the Triton kernel (CPU interpreter) and the PyTorch twin bitwise equal
to the slow reference on random shapes.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from nemofp4 import kernels
from nemofp4.formats import E2M1, SCALE_FORMATS, QuantizedBlocks, pack_fp4, quantize_blocks
from nemofp4.kernels.hardware_gemm import (
    hardware_gemm_reference,
    hardware_gemm_torch,
    round_exact_to_float32,
    rtz_add_f32,
    triton_hardware_gemm,
)
from tests.conftest import TRITON_INTERPRETER, assert_interpreted, needs_triton_interpreter

F32_MAX = float(np.finfo(np.float32).max)


if TRITON_INTERPRETER:  # tests/conftest.py chose the interpreter for the session
    from nemofp4.kernels import _gemm_kernels

    assert_interpreted(_gemm_kernels.hardware_gemm_kernel)
needs_interpreter = needs_triton_interpreter


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def make_operand(values, scales, *, scale_format="ue5m3", tensor_scale=1.0, block=16) -> QuantizedBlocks:
    """A quantized operand from exact E2M1 values [rows, K] and block scales [rows, K / block]."""
    values = torch.as_tensor(values, dtype=torch.float32)
    scales = torch.as_tensor(scales, dtype=torch.float32)
    assert torch.equal(E2M1.round(values), values), "values must be E2M1 grid points"
    fmt = SCALE_FORMATS[scale_format]
    assert torch.equal(fmt.round(scales), scales), "scales must be on the scale grid"
    rows, k = values.shape
    return QuantizedBlocks(
        codes=pack_fp4(E2M1.encode(values)),
        scale_codes=fmt.encode(scales),
        tensor_scale=torch.tensor(tensor_scale, dtype=torch.float32),
        tensor_amax=torch.tensor(tensor_scale * 2688.0),  # the reference g that gives it (T = 448)
        shape=torch.Size([rows, k]),
        padded_shape=torch.Size([rows, k]),
        block_size=block,
        two_d=False,
        scale_format=scale_format,
        num_blocks=scales.numel(),
        num_elements=values.numel(),
    )


def one_hot_operand(entries: dict[int, tuple[float, float]], k: int = 128) -> QuantizedBlocks:
    """One row: ``{k_index: (E2M1 value, block scale)}``; other elements 0 with scale 1."""
    values = torch.zeros(1, k)
    scales = torch.ones(1, k // 16)
    for index, (value, scale) in entries.items():
        values[0, index] = value
        scales[0, index // 16] = scale
    return make_operand(values, scales)


def all_paths(a, b, **kw) -> list[torch.Tensor]:
    out = [hardware_gemm_reference(a, b, **kw), hardware_gemm_torch(a, b, **kw)]
    if TRITON_INTERPRETER:
        out.append(triton_hardware_gemm(a, b, **kw))
    return out


# --------------------------------------------------------------------------- exact building blocks
def _rtz_exact(a: float, b: float) -> float:
    """Round-toward-zero of the rational a + b onto float32, by search (the obviously-correct way)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return float(np.float32(a) + np.float32(b))
    exact = Fraction(a) + Fraction(b)
    if exact == 0:  # the sign of an exact zero: +0 unless both are -0, in every rounding mode
        return float(np.float32(a) + np.float32(b))
    with np.errstate(over="ignore"):
        return _rtz_search(exact)


def _rtz_search(exact: Fraction) -> float:
    t = np.float32(float(exact)) if abs(exact) <= F32_MAX else np.float32(math.copysign(F32_MAX, exact))
    zero = np.float32(0)
    while abs(Fraction(float(t))) > abs(exact):  # outward: step toward zero
        t = np.nextafter(t, zero)
    while True:  # the next float32 away from zero must exceed the exact sum
        away = np.nextafter(t, np.float32(math.copysign(math.inf, float(exact))))
        if not math.isfinite(away) or abs(Fraction(float(away))) > abs(exact):
            break
        t = away
    return float(t)


def test_rtz_add_is_exact_against_rational_arithmetic():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 2**32, size=(3000, 2), dtype=np.uint64).astype(np.uint32).view(np.float32)
    raw = raw[np.isfinite(raw).all(axis=1)]
    # same-binade neighbours, exponent gaps of 20..60 (beyond float64's exactness), cancellation
    close = rng.standard_normal((1000, 2)).astype(np.float32)
    gaps = np.stack([rng.standard_normal(1000), rng.standard_normal(1000) * 2.0 ** rng.integers(-60, -20, 1000)], 1)
    cancel = np.stack([close[:, 0], -close[:, 0] * np.float32(1 + 2**-20)], 1)
    special = np.array(
        [
            [1.0, -(2.0**-60)],
            [1.0, 2.0**-60],
            [-1.0, 2.0**-60],
            [F32_MAX, F32_MAX],
            [-F32_MAX, -F32_MAX],
            [1e-45, -1e-45],
            [1e-45, 1e-45],
            [-0.0, 0.0],
            [-0.0, -0.0],
            [3.0, -3.0],
            [2.0**127, 2.0**-149],
        ],
    )
    pairs = np.concatenate([raw, close, gaps, cancel, special]).astype(np.float32)
    a, b = torch.from_numpy(pairs[:, 0].copy()), torch.from_numpy(pairs[:, 1].copy())
    ours = rtz_add_f32(a, b)
    expected = torch.tensor([_rtz_exact(float(x), float(y)) for x, y in pairs], dtype=torch.float32)
    assert torch.equal(bits(ours), bits(expected))  # bitwise: signed zeros included
    # the float64 sum alone is not enough: 1 - 2^-60 rounds to 1.0 in float64, its RTZ is 1 - 2^-24
    assert float(rtz_add_f32(torch.tensor([1.0]), torch.tensor([-(2.0**-60)]))) == 1 - 2**-24
    assert float(rtz_add_f32(torch.tensor([F32_MAX]), torch.tensor([F32_MAX]))) == F32_MAX  # no Inf in RTZ


def test_round_exact_to_float32():
    rng = np.random.default_rng(1)
    for _ in range(2000):  # values exact in float64: numpy's float64 -> float32 cast is one RNE
        mantissa = int(rng.integers(-(2**52), 2**52))
        exponent = int(rng.integers(-220, 100))
        with np.errstate(over="ignore"):
            expected = float(np.float32(math.ldexp(mantissa, exponent)))
        assert round_exact_to_float32(mantissa, exponent) == expected
    big = 2**60  # 24 kept bits: the last kept bit is 2^37, a tie is 2^36
    assert round_exact_to_float32(big + 2**36, 0) == float(big)  # tie, even stays
    assert round_exact_to_float32(big + 2**37 + 2**36, 0) == float(big + 2**38)  # tie, odd goes up
    assert round_exact_to_float32(big + 2**36 + 1, 0) == float(big + 2**37)  # just above the tie
    assert round_exact_to_float32(3, -151) == 2.0**-149  # 0.75 of the smallest subnormal
    assert round_exact_to_float32(1, -150) == 0.0  # half of it: tie to even (zero)
    assert round_exact_to_float32(-(2**24 - 1), 104) == -F32_MAX  # FLT_MAX itself
    assert round_exact_to_float32(2**26 - 3, 102) == F32_MAX  # FLT_MAX + ulp/4
    assert round_exact_to_float32(2**25 - 1, 103) == math.inf  # FLT_MAX + ulp/2: ties to 2^128


# --------------------------------------------------------------------------- model semantics
def test_group_partials_add_with_round_toward_zero():
    """1 (group 0) + 0.75 ulp(1) (group 1): RNE would give 1 + ulp, the model keeps 1."""
    a = one_hot_operand({0: (1.0, 1.0), 64: (1.5, 2.0**-12)})
    b = one_hot_operand({0: (1.0, 1.0), 64: (1.0, 2.0**-12)})
    for out in all_paths(a, b):
        assert float(out) == 1.0
    assert float(a.dequantize() @ b.dequantize().t()) == 1 + 2**-23  # the decoded FP32 product


def test_each_group_is_summed_exactly_then_rounded_once():
    """1 + 2^-24 + 2^-24 inside one group is exactly 1 + 2^-23; the same products split over two
    groups give 1.0 (1 + 2^-24 ties to even, then the RTZ addition drops the second 2^-24)."""
    small = (1.0, 2.0**-12)
    one_group = {0: (1.0, 1.0), 16: small, 32: small}
    two_groups = {0: (1.0, 1.0), 16: small, 64: small}
    for entries, expected in ((one_group, 1 + 2**-23), (two_groups, 1.0)):
        a = one_hot_operand(entries)
        b = one_hot_operand({i: (1.0, s) for i, (_, s) in entries.items()})
        for out in all_paths(a, b):
            assert float(out) == expected


def test_lattice_snap_and_tensor_scales_come_last():
    a = one_hot_operand({0: (1.0, 1.0), 16: (1.0, 2.0**-12), 32: (1.0, 2.0**-12)})
    b = one_hot_operand({0: (1.0, 1.0), 16: (1.0, 2.0**-12), 32: (1.0, 2.0**-12)})
    for out in all_paths(a, b, lattice_snap=True):
        assert float(out) == 1.0  # round(1024 * (1 + 2^-23)) / 1024
    third = one_hot_operand({0: (1.5, 0.203125)})
    small = one_hot_operand({0: (1.0, 2.0**-5)})  # product 0.009521484375 = 9.75 / 1024 -> 10 / 1024
    a.tensor_scale, a.tensor_amax = torch.tensor(3.0), torch.tensor(3.0 * 2688)
    b.tensor_scale, b.tensor_amax = torch.tensor(0.5), torch.tensor(0.5 * 2688)
    # alpha from the amaxes as the paper's _encoded_global_alpha (on CUDA): fl(g_a g_b) * fl(1 / 2688^2)
    alpha = np.float32(np.float32(3.0 * 2688) * np.float32(0.5 * 2688)) * (np.float32(1) / np.float32(2688.0**2))
    for out in all_paths(a, b):
        assert float(out) == np.float32(1 + 2**-23) * alpha  # applied last, in FP32
    for out in all_paths(third, small, lattice_snap=True):
        assert float(out) == 10 / 1024


# --------------------------------------------------------------------------- random operands
CASES = [
    # (M, N, K, scale_format, block, B read transposed from 16x16 tiles)
    (24, 16, 1000, "ue5m3", 16, False),  # K not a multiple of 64 (nor of the block)
    (33, 17, 128, "e4m3", 16, False),
    (20, 36, 96, "ue8m0", 32, False),
    (24, 40, 48, "ue5m3", 16, True),  # dgrad: dY [24, 48] @ W [48, 40]
    (16, 16, 64, "ue5m3_cuda", 16, False),
]


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[3]}{'-T' if c[5] else ''}")
def test_fast_paths_equal_the_reference_bitwise(case, impl):
    m, n, k, scale_format, block, b_transposed = case
    g = torch.Generator().manual_seed(m * n + k)
    # block magnitudes spread over ~2^+-5 within a row: group sums and their K-order additions are
    # then inexact in FP32 (with uniform magnitudes and small K every addition can be exact)
    spread = torch.exp(1.5 * torch.randn(m, -(-k // block), generator=g)).repeat_interleave(block, 1)[:, :k]
    x = torch.randn(m, k, generator=g) * spread
    qa = quantize_blocks(x, scale_format, block)
    if b_transposed:
        w = torch.randn(k, n, generator=g)
        qb = quantize_blocks(w, scale_format, block, two_d=True)
        decoded = qa.dequantize() @ qb.dequantize()
    else:
        w = torch.randn(n, k, generator=g) * 0.02
        held = float(w.abs().max()) * 3  # a held reference: small block scales
        qb = quantize_blocks(w, scale_format, block, tensor_amax=None if scale_format == "ue8m0" else held)
        decoded = qa.dequantize() @ qb.dequantize().t()
    fast = triton_hardware_gemm if impl == "triton" else hardware_gemm_torch
    for snap in (True, False):
        ref = hardware_gemm_reference(qa, qb, b_transposed=b_transposed, lattice_snap=snap)
        out = fast(qa, qb, b_transposed=b_transposed, lattice_snap=snap)
        assert ref.shape == out.shape == (m, n) and out.dtype == torch.float32
        assert torch.equal(bits(out), bits(ref))
    # sanity (unsnapped): the model differs from the decoded FP32 product by FP32-rounding-sized amounts
    relative = float((ref.double() - decoded.double()).norm() / decoded.double().norm())
    assert relative < 1e-5
    if scale_format != "ue8m0":
        assert relative > 0  # the two roundings differ somewhere on random data


def test_dispatch_on_cpu_uses_the_torch_twin():
    qa = quantize_blocks(torch.randn(8, 64), "ue5m3")
    qb = quantize_blocks(torch.randn(12, 64), "ue5m3")
    assert torch.equal(kernels.gemm_hardware(qa, qb), hardware_gemm_reference(qa, qb))


def test_bad_operands_raise():
    qa = quantize_blocks(torch.randn(8, 64), "ue5m3")
    with pytest.raises(ValueError, match="reduction dims differ"):
        hardware_gemm_reference(qa, quantize_blocks(torch.randn(8, 80), "ue5m3"))
    with pytest.raises(ValueError, match="two_d"):
        hardware_gemm_reference(qa, quantize_blocks(torch.randn(64, 8), "ue5m3"), b_transposed=True)
    with pytest.raises(ValueError, match="block_size 8"):
        triton_hardware_gemm(
            quantize_blocks(torch.randn(8, 64), "ue5m3", 8), quantize_blocks(torch.randn(8, 64), "ue5m3", 8)
        )


@needs_interpreter
def test_the_gemm_launch_is_a_torch_library_op_with_a_fake_and_compiles_without_a_graph_break():
    qa = quantize_blocks(torch.randn(24, 64), "ue5m3")
    qb = quantize_blocks(torch.randn(20, 64), "e4m3", two_d=True)
    args = (
        qa.codes,
        qa.scale_codes,
        qb.codes,
        qb.scale_codes,
        qa.tensor_scale.reshape(1),
        qb.tensor_scale.reshape(1),
        24,
        20,
        64,
        64,
        64,
        "ue5m3",
        16,
        False,
        False,
        "e4m3",
        16,
        True,
        False,
        False,
        64,
        64,
    )
    op = torch.ops.nemofp4.triton_hardware_gemm.default
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    assert torch.equal(bits(op(*args)), bits(hardware_gemm_reference(qa, qb)))

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: triton_hardware_gemm(a, b), backend=backend, fullgraph=True)
    out = compiled(qa, qb)
    assert len(graphs) == 1
    assert "nemofp4.triton_hardware_gemm" in {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert torch.equal(bits(out), bits(hardware_gemm_reference(qa, qb)))
    torch._dynamo.reset()
