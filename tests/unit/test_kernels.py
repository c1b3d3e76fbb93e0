"""Triton FP4 quantization kernels, run by Triton's CPU interpreter: bitwise equal to
``nemofp4.formats.quantize_blocks`` for RNE (codes, scale codes, tensor scale, statistics) on
random and edge-case inputs, the fused transposed quantization, the amax reduction, stochastic
rounding (exact 8-bit rule given the kernel's own draws, unbiasedness, determinism), the
quant-operand adapter and the dispatch switch.

tests/conftest.py turns the interpreter on for the whole session on a machine without CUDA,
before any test module is imported; on a CUDA machine these tests skip (tests/gpu run the
kernels compiled, in a session of their own).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from nemofp4 import kernels
from nemofp4.formats import E2M1, SCALE_FORMATS, amax, quantize_blocks, unpack_fp4
from nemofp4.kernels import OperandRequest
from nemofp4.quant.config import OperandQuant
from tests.conftest import TRITON_INTERPRETER, assert_interpreted, needs_triton_interpreter

if TRITON_INTERPRETER:
    from nemofp4.kernels import _quantize_kernels
    from nemofp4.kernels.quantize import (
        triton_amax,
        triton_quantize,
        triton_quantize_blocks,
        triton_quantize_with_draws,
    )

    assert_interpreted(_quantize_kernels.quantize_kernel)

# x * enc overflowing to inf (then saturating to +-6) is part of the reference's arithmetic too
pytestmark = [
    needs_triton_interpreter,
    pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning"),
]

FORMATS = ["e4m3", "ue5m3", "ue5m3_cuda", "ue8m0"]
FLT_MAX = np.float32(np.finfo(np.float32).max)


def make_input(rows: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Gaussian rows with log-normal magnitudes, an outlier, a zero block, a tiny block (subnormal
    or underflowing scales), fp32-subnormal values, negative zeros and a mixed block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))
    x[0, 3] = 40.0
    x[1, :16] = 0.0
    x[1, 5] = -0.0
    x[2, 16:32] = torch.randn(16, generator=g) * 1e-6
    x[3, :8] = 1e-30
    x[4, :4] = 1e-41  # float32 subnormals
    return x.to(dtype)


def assert_same(ours, ref) -> None:
    """Every field a GEMM or the statistics read, bit for bit."""
    assert ours.shape == ref.shape and ours.padded_shape == ref.padded_shape
    assert ours.block_size == ref.block_size and ours.two_d == ref.two_d
    assert ours.codes.shape == ref.codes.shape and ours.scale_codes.shape == ref.scale_codes.shape
    mismatch = (ours.codes != ref.codes).nonzero()
    assert mismatch.numel() == 0, f"codes differ at {mismatch[:4].tolist()}"
    mismatch = (ours.scale_codes != ref.scale_codes).nonzero()
    assert mismatch.numel() == 0, f"scale codes differ at {mismatch[:4].tolist()}"
    assert ours.tensor_scale.dim() == 0 and ours.tensor_amax.dim() == 0
    assert torch.equal(ours.tensor_scale.view(torch.int32), ref.tensor_scale.view(torch.int32))
    assert torch.equal(ours.tensor_amax.view(torch.int32), ref.tensor_amax.float().view(torch.int32))
    assert ours.stats() == ref.stats()
    assert torch.equal(ours.dequantize(), ref.dequantize())


# --------------------------------------------------------------------------- RNE: bitwise
@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
def test_rne_matches_reference_bitwise(scale_format, two_d):
    dtype = [torch.bfloat16, torch.float32, torch.float16][FORMATS.index(scale_format) % 3]
    x = make_input(45, 83, seed=FORMATS.index(scale_format), dtype=dtype)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    assert_same(
        triton_quantize_blocks(x, scale_format=scale_format, two_d=two_d),
        quantize_blocks(x, scale_format, two_d=two_d),
    )
    if scale_format != "ue8m0":  # a held reference 300x too small: saturating blocks (UE5M3 holds 137x)
        g = float(x.float().abs().max()) / 300
        ours = triton_quantize_blocks(x, scale_format=scale_format, two_d=two_d, tensor_amax=g)
        ref = quantize_blocks(x, scale_format, two_d=two_d, tensor_amax=g)
        assert ref.stats()["saturated_blocks"] > 0
        assert_same(ours, ref)


@pytest.mark.parametrize("scale_format", FORMATS)
def test_transposed_in_the_same_launch_matches_quantizing_the_transpose(scale_format):
    """also_transposed=True: blocks along dim 0 (the tokens), zero-padded, same reference, and an
    optional separate scale target (the recipe's T = 2048 on some wgrad dY)."""
    x = make_input(37, 50, seed=10 + FORMATS.index(scale_format), dtype=torch.bfloat16)
    q, q_t = triton_quantize_blocks(x, scale_format=scale_format, also_transposed=True)
    assert_same(q, quantize_blocks(x, scale_format))
    assert_same(q_t, quantize_blocks(x.t(), scale_format))
    if scale_format != "ue8m0":
        g = torch.tensor(float(x.float().abs().max()) / 3)
        q, q_t = triton_quantize_blocks(
            x, scale_format=scale_format, also_transposed=True, tensor_amax=g, transposed_scale_target=2048.0
        )
        assert_same(q, quantize_blocks(x, scale_format, tensor_amax=g))
        assert_same(q_t, quantize_blocks(x.t(), scale_format, tensor_amax=g, scale_target=2048.0))


def test_edge_cases_match_reference():
    # all zeros: g = 0 (e4m3: G = FLT_MAX, zero scale codes; UE5M3: G = 1, codes of 1.0)
    zeros = torch.zeros(3, 40)
    for scale_format in FORMATS:
        assert_same(triton_quantize_blocks(zeros, scale_format=scale_format), quantize_blocks(zeros, scale_format))
    # every E2M1 tie (enc = 1 exactly: block amax 6, g = 448 * 6) and their negatives, -0
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.1, 5.9]
    x = torch.tensor([ties, [-v for v in ties[:15]] + [-0.0]])
    for scale_format in ("e4m3", "ue5m3"):
        ours = triton_quantize_blocks(x, scale_format=scale_format, tensor_amax=2688.0)
        assert_same(ours, quantize_blocks(x, scale_format, tensor_amax=2688.0))
    assert unpack_fp4(ours.codes)[0, 1:8].tolist() == [0, 2, 2, 4, 4, 6, 6]  # ties to even codes
    assert unpack_fp4(ours.codes)[1, 15] == 8  # -0 keeps its sign bit
    # extreme magnitudes: near FLT_MAX, fp32 subnormals, and a held reference far too small / large
    x = make_input(20, 64, seed=3)
    x[5, :] = 3.0e38
    x[6, :] = 1e-44
    for scale_format in FORMATS:
        assert_same(triton_quantize_blocks(x, scale_format=scale_format), quantize_blocks(x, scale_format))
    for g in (1e-30, 1e30):
        for scale_format in ("e4m3", "ue5m3"):
            ours = triton_quantize_blocks(x, scale_format=scale_format, tensor_amax=g)
            assert_same(ours, quantize_blocks(x, scale_format, tensor_amax=g))


@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_block_sizes_leading_dims_and_mx_ceil(block_size):
    x = make_input(3 * 7, 100, seed=block_size).view(3, 7, 100)
    for scale_format in ("ue5m3", "ue8m0"):
        assert_same(
            triton_quantize_blocks(x, scale_format=scale_format, block_size=block_size),
            quantize_blocks(x, scale_format, block_size),
        )
    x2 = x.reshape(21, 100)
    x2[0, :block_size] = 1e-45  # amax / 6 underflows to 0 in float32
    for mode in ("floor", "ceil"):
        ours = triton_quantize_blocks(x2, scale_format="ue8m0", block_size=block_size, mx_scale_mode=mode)
        assert_same(ours, quantize_blocks(x2, "ue8m0", block_size, mx_scale_mode=mode))


def test_scaled_output_is_value_times_block_scale():
    """The optional fused output a block-scaled GEMM consumes: exact in float32 and in bf16."""
    x = make_input(33, 70, seed=5, dtype=torch.bfloat16)
    ref = quantize_blocks(x, "ue5m3")
    for dtype in (torch.float32, torch.bfloat16):
        rows, cols = triton_quantize(x, scale_format="ue5m3", transposed=True, scaled_dtype=dtype)
        assert torch.equal(rows.scaled.float(), ref.scaled_values())
        assert torch.equal(cols.scaled.float(), quantize_blocks(x.t(), "ue5m3").scaled_values())
    rows, _ = triton_quantize(x.float()[:32, :64], scale_format="e4m3", two_d=True, scaled_dtype=torch.float32)
    assert torch.equal(rows.scaled, quantize_blocks(x.float()[:32, :64], "e4m3", two_d=True).scaled_values())


def test_amax_reduction():
    x = make_input(50, 77, seed=8, dtype=torch.bfloat16)
    assert triton_amax(x).dim() == 0 and triton_amax(x).dtype == torch.float32
    assert torch.equal(triton_amax(x), amax(x))
    assert torch.equal(triton_amax(-x.abs()), amax(x))
    big = torch.randn(5 * 4096 + 3)  # several programs, each looping over several chunks
    big[-1] = -9.5
    assert float(triton_amax(big)) == 9.5
    y = x.clone()
    y[7, 7] = math.nan
    assert torch.isnan(triton_amax(y))  # NaN wins: a poisoned tensor is not silently scaled
    with pytest.raises(ValueError, match="empty"):
        triton_amax(torch.zeros(0))


# --------------------------------------------------------------------------- stochastic rounding
def _expected_sr8(x_pad: np.ndarray, encode: np.ndarray, draws: np.ndarray, rounding: str = "sr8") -> np.ndarray:
    """E2M1 codes from y = fp32(x * enc) by the paper's sr8 rule, away iff fp32(frac + (2r + 1) / 512) >= 1
    (frac exact, one float32 addition), or TE's cvt.rs rule (sr), away iff frac + r / 256 >= 1."""
    y = (x_pad.astype(np.float32) * encode.astype(np.float32)).astype(np.float64)
    grid = np.array(E2M1._magnitude_values_f64)
    a = np.minimum(np.abs(y), 6.0)
    lower = np.searchsorted(grid, a, side="right") - 1
    upper = np.minimum(lower + 1, grid.size - 1)
    spacing = np.where(upper > lower, grid[upper] - grid[lower], 1.0)
    frac = ((a - grid[lower]) / spacing).astype(np.float32)
    if rounding == "sr":
        away = frac.astype(np.float64) + draws / 256 >= 1  # exact in float64
    else:
        away = frac + ((2 * draws + 1) / 512).astype(np.float32) >= np.float32(1)
    magnitude = np.where(away, upper, lower)
    return (magnitude | (np.signbit(y) << 3)).astype(np.uint8)


def _encode_per_element(ref, b: int) -> np.ndarray:
    """min(1 / (scale * tensor_scale), FLT_MAX) per element of the padded tensor, float32."""
    scale = ref.block_scales().numpy().astype(np.float32)
    ts = np.float32(ref.tensor_scale)
    with np.errstate(divide="ignore"):
        encode = np.minimum(np.float32(1) / (scale * ts), FLT_MAX)
    return np.repeat(encode, b, axis=-1)


@pytest.mark.parametrize("scale_format,rounding", [("ue5m3", "sr8"), ("e4m3", "sr8"), ("e4m3", "sr")])
def test_sr8_follows_the_8bit_rule_given_the_kernels_draws(scale_format, rounding):
    x = make_input(40, 56, seed=21)
    (rows, rows_draws), (cols, cols_draws) = triton_quantize_with_draws(
        x, scale_format=scale_format, rounding=rounding, seed=1234, transposed=True
    )
    for ours, ours_draws, source in ((rows, rows_draws, x), (cols, cols_draws, x.t())):
        ref = quantize_blocks(source, scale_format)  # scale codes never depend on the payload rounding
        assert torch.equal(ours.scale_codes, ref.scale_codes)
        draws = ours_draws.numpy()
        assert draws.min() >= 0 and draws.max() <= 255
        x_pad = np.zeros(ref.padded_shape, dtype=np.float32)
        x_pad[: source.shape[0], : source.shape[1]] = source.numpy()
        expected = _expected_sr8(x_pad, _encode_per_element(ref, 16), draws, rounding)
        np.testing.assert_array_equal(unpack_fp4(ours.codes).numpy(), expected)
    # the two directions draw independent streams; the draws look uniform on 0..255, per lane too
    assert not np.array_equal(rows_draws[:40, :40].numpy(), cols_draws[:40, :40].numpy().T)
    draws = np.concatenate([rows_draws.numpy().ravel(), cols_draws.numpy().ravel()]).astype(np.float64)
    sigma = math.sqrt((256**2 - 1) / 12)
    assert abs(draws.mean() - 127.5) <= 4 * sigma / math.sqrt(draws.size)
    lanes = rows_draws.numpy().reshape(-1, 16).astype(np.float64)
    assert np.all(np.abs(lanes.mean(0) - 127.5) <= 4 * sigma / math.sqrt(lanes.shape[0]))


@pytest.mark.parametrize("rounding", ["sr8", "sr", "sr_exact"])
def test_stochastic_rounding_is_unbiased(rounding):
    """The reference's test: mean of many draws vs the exact expectation, within 4 standard
    errors (60 checks at 4 sigma, fixed seed). Each 16-block starts with a 6 and the reference is
    g = 448 * 6, so enc = 1 exactly and y = x; the other 15 elements sit at random fractions
    between E2M1 grid points, and each row draws fresh bits for them."""
    rng = np.random.default_rng(3)
    grid = np.array(E2M1._magnitude_values_f64)
    lower = rng.integers(0, grid.size - 1, size=(4, 15))
    frac = rng.uniform(0, 1, size=(4, 15))
    values = (grid[lower] + frac * (grid[lower + 1] - grid[lower])).astype(np.float32)
    row = np.concatenate([np.full((4, 1), 6.0, dtype=np.float32), values], axis=1).reshape(-1)  # 64
    draws = 2048
    x = torch.from_numpy(np.tile(row, (draws, 1)))
    q = triton_quantize_blocks(x, scale_format="e4m3", tensor_amax=2688.0, rounding=rounding, seed=1)
    samples = q.dequantize().double().numpy().reshape(draws, 4, 16)[:, :, 1:]
    exact_frac = (values.astype(np.float64) - grid[lower]) / (grid[lower + 1] - grid[lower])
    p_up = {
        "sr_exact": exact_frac,
        "sr": np.floor(exact_frac * 256) / 256,  # TE's cvt.rs: 8 random bits, carry out rounds away
        "sr8": np.floor(exact_frac * 256 + 0.5) / 256,
    }[rounding]
    spacing = grid[lower + 1] - grid[lower]
    expected = grid[lower] + p_up * spacing
    std_error = spacing * np.sqrt(np.maximum(p_up * (1 - p_up), 1e-12) / draws)
    assert np.all(np.abs(samples.mean(0) - expected) <= 4 * std_error + 1e-12)
    assert set(np.unique(samples)) <= set(grid)


def test_stochastic_rounding_is_deterministic_per_seed():
    x = make_input(32, 64, seed=2)
    run = lambda seed, rounding="sr8": triton_quantize_blocks(x, rounding=rounding, seed=seed).codes
    assert torch.equal(run(5), run(5)) and not torch.equal(run(5), run(6))
    assert torch.equal(run(5), run(torch.tensor([5])))  # a device-tensor seed (no host sync)
    for sr in ("sr", "sr_exact"):
        assert torch.equal(run(5, sr), run(5, sr)) and not torch.equal(run(5, sr), run(6, sr))
    rne = triton_quantize_blocks(x).codes
    assert not torch.equal(run(5), rne) and (run(5) == rne).float().mean() > 0.3
    # on-grid values never move
    on_grid = torch.tensor([[6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2] * 8)
    q = triton_quantize_blocks(on_grid, scale_format="e4m3", tensor_amax=2688.0, rounding="sr8", seed=3)
    assert torch.equal(q.dequantize(), on_grid)


# --------------------------------------------------------------------------- errors
def test_bad_arguments_raise():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="block_size 12"):
        triton_quantize_blocks(x, block_size=12)
    with pytest.raises(ValueError, match="also_transposed needs a 2-D"):
        triton_quantize_blocks(x.view(2, 2, 32), also_transposed=True)
    with pytest.raises(ValueError, match="also_transposed needs a 2-D"):
        triton_quantize_blocks(x, two_d=True, also_transposed=True)
    with pytest.raises(ValueError, match="valid: e4m3, ue5m3, ue5m3_cuda, ue8m0"):
        triton_quantize_blocks(x, scale_format="e8m0")
    with pytest.raises(ValueError, match="rne, sr8, sr"):
        triton_quantize_blocks(x, rounding="stochastic")
    with pytest.raises(ValueError, match="tensor_amax must be finite"):
        triton_quantize_blocks(x, tensor_amax=math.inf)
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        triton_quantize_blocks(x.double())
    with pytest.raises(ValueError, match="seed"):
        triton_quantize_blocks(x, rounding="sr8", seed=2**64)
    with pytest.raises(ValueError, match="needs a stochastic rounding"):
        triton_quantize_with_draws(x)
    with pytest.warns(UserWarning, match="no effect"):
        triton_quantize_blocks(x, scale_format="ue8m0", tensor_amax=1.0)


# --------------------------------------------------------------------------- quant adapter, dispatch
def test_quant_operand_adapter_matches_quantize_operand():
    from nemofp4.kernels.operand import triton_quantize_operand, triton_quantize_operand_pair
    from nemofp4.kernels.program import quantize_operand

    x = make_input(50, 72, seed=4, dtype=torch.bfloat16)
    ops = [
        OperandQuant(scale_format="ue5m3", reference_interval=50),
        OperandQuant(scale_format="e4m3", two_d=True),
        OperandQuant(scale_format="ue8m0", block_size=32),
    ]
    for op in ops:
        ref = quantize_operand(x, op, pack=True)
        ours = triton_quantize_operand(x, op, pack=True)
        assert torch.equal(ours.scaled, ref.scaled) and ours.shape == ref.shape
        assert ours.stats() == ref.stats() and ours.num_blocks == ref.num_blocks
        assert torch.equal(ours.packed.codes, ref.packed.codes)
        assert torch.equal(ours.packed.scale_codes, ref.packed.scale_codes)
        assert ours.packed.padded_shape == ref.packed.padded_shape
        assert torch.equal(ours.tensor_scale, ref.tensor_scale)
    # X for fprop and X^T (tokens padded to 16) for wgrad from one read, T = 2048 on X^T
    op_x, op_xt = ops[0], OperandQuant(scale_format="ue5m3", reference_interval=50, scale_target=2048.0)
    g = torch.tensor(3.0)
    qx, qxt = triton_quantize_operand_pair(x, op_x, op_xt, tensor_amax=g)
    rx = quantize_operand(x, op_x, tensor_amax=g)
    rxt = quantize_operand(torch.nn.functional.pad(x, (0, 0, 0, 14)).t(), op_xt, tensor_amax=g, pack=True)
    assert torch.equal(qx.scaled, rx.scaled) and torch.equal(qxt.scaled, rxt.scaled)
    assert qxt.shape == rxt.shape and qxt.stats() == rxt.stats() and qx.stats() == rx.stats()
    assert torch.equal(qxt.packed.codes, rxt.packed.codes)


@pytest.mark.parametrize("values_xt", [True, False])
def test_the_triton_backends_forward_operands_are_the_programs(values_xt):
    """TritonBackend.quantize of a forward's requests (its launches: the X / X^T pair, then W) gives what
    the torch program's one-graph call gives (RNE: the same bits), with and without X^T, and X^T's
    packed form alone when asked (``values=False``)."""
    from nemofp4.kernels.backend import EagerBackend, TritonBackend

    x = make_input(50, 72, seed=5, dtype=torch.bfloat16)
    w = make_input(40, 72, seed=6)
    op_x, op_w = OperandQuant(scale_format="ue5m3"), OperandQuant(scale_format="ue5m3", two_d=True)
    x_amax = torch.tensor(3.0)
    for with_xt in (True, False):
        requests = [OperandRequest(x, op_x, tensor_amax=x_amax)]
        if with_xt:
            requests.append(OperandRequest(x, op_x, layout="tokens", pack=True, values=values_xt, tensor_amax=x_amax))
        requests.append(OperandRequest(w, op_w, pack=True))
        ours = TritonBackend().quantize(*requests)
        ref = EagerBackend().quantize(*requests)
        assert len(ours) == len(ref) == len(requests)
        if with_xt:
            assert (ref[1].scaled is None) == (not values_xt)
        for q, r in zip(ours, ref, strict=True):
            assert (q.scaled is None) == (r.scaled is None)  # X and W always have theirs; X^T as asked
            assert torch.equal(q.scaled_values(), r.scaled_values()) and q.shape == r.shape and q.stats() == r.stats()
            assert torch.equal(q.tensor_scale, r.tensor_scale) and (q.codes is None) == (r.codes is None)
            assert r.codes is None or torch.equal(q.codes, r.codes)  # X^T's and W's (packed), not X's


def test_the_triton_backends_packed_alone_wgrad_operand_is_the_programs():
    """X^T after the Hadamard transform, saved for backward (``pack=True, values=False``): the Triton
    launch writes no scaled values, and its codes are the program's."""
    from nemofp4.kernels.backend import EagerBackend, TritonBackend

    x = make_input(50, 64, seed=5)
    op = OperandQuant(scale_format="e4m3", hadamard=True)
    request = OperandRequest(x, op, layout="tokens", pack=True, values=False)
    (ours,), (ref,) = TritonBackend().quantize(request), EagerBackend().quantize(request)
    assert ours.scaled is None and ref.scaled is None
    assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scale_codes, ref.scale_codes)
    assert torch.equal(ours.dequantize(), ref.dequantize()) and ours.meta() == ref.meta()
    with pytest.raises(ValueError, match="values=False keeps only the packed form: it needs pack=True"):
        OperandRequest(x, op, layout="tokens", values=False)


def test_a_launch_under_a_fake_mode_leaves_later_real_launches_real(monkeypatch):
    """The planner runs the Triton glue under FakeTensorMode; buffers the glue keeps between launches
    must not carry fake tensors out of it, or every later real launch returns fake outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nemofp4.kernels import quantize as triton_glue

    monkeypatch.setattr(triton_glue, "_DUMMIES", {})
    x = make_input(32, 48, seed=7)
    with FakeTensorMode(allow_non_fake_inputs=True):
        triton_quantize_blocks(torch.empty(32, 48), scale_format="e4m3")
    q = triton_quantize_blocks(x, scale_format="e4m3")
    assert all(type(t) is torch.Tensor for t in (q.codes, q.scale_codes, q.tensor_scale, q.tensor_amax))
    assert_same(q, quantize_blocks(x, "e4m3"))


def test_dispatch_and_switch(monkeypatch):
    x = make_input(8, 32, seed=1)
    assert kernels.triton_available()  # importable, and TRITON_INTERPRET=1 here
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.triton_available() == torch.cuda.is_available()
    # CPU tensors always take the PyTorch reference (the interpreter is for tests only)
    calls = []
    monkeypatch.setattr("nemofp4.kernels.quantize.triton_quantize_blocks", lambda *a, **k: calls.append(1))
    ref = quantize_blocks(x, "ue5m3")  # the CPU path keeps the block counts alone
    assert_same(
        kernels.quantize_blocks(x, "ue5m3"),
        dataclasses.replace(ref, counts={k: v for k, v in ref.counts.items() if k != "clipped_elements"}),
    )
    assert torch.equal(kernels.amax(x), amax(x)) and not calls
    assert kernels.resolve_backend("auto", "cpu") in ("native", "compiled", "eager")
    with pytest.raises(ValueError, match="backend 'triton' needs CUDA tensors"):
        kernels.quantize_operand(x, OperandQuant(scale_format="ue5m3"), backend="triton")
    with pytest.raises(ValueError, match="unknown FP4 kernel backend 'reference'"):
        kernels.amax(x, backend="reference")
    assert set(SCALE_FORMATS) == set(FORMATS)


def test_a_planned_path_is_what_every_backend_resolves_to_inside_it_and_only_there():
    with kernels.planned_path("triton"):
        assert {kernels.resolve_backend(b, d) for b in kernels.BACKENDS for d in ("cpu", "cuda")} == {"triton"}
        with kernels.planned_path("eager"):
            assert kernels.resolve_backend("native", "cuda") == "eager"
        assert kernels.resolve_backend("auto", "cpu") == "triton"
        with pytest.raises(ValueError, match="unknown FP4 kernel backend 'reference'"):
            kernels.resolve_backend("reference", "cpu")
    with pytest.raises(ValueError, match="native.*these are on cuda"):
        kernels.resolve_backend("native", "cuda")
    with pytest.raises(ValueError, match="quantizer='compiled'; valid: triton, eager"):
        with kernels.planned_path("compiled"):
            pass


# --------------------------------------------------------------------------- the launches as torch.library ops
def _op_args(x, *, g, scale_format="ue5m3", two_d=False, transposed=False, scaled=1, rounding=0):
    """Positional arguments of ``nemofp4::triton_quantize`` for the interpreter's tile sizes."""
    config = _quantize_tile_config(16, two_d, transposed)
    seed = torch.full((1,), 7, dtype=torch.int64)
    return (
        x,
        g,
        seed,
        scale_format,
        16 if scale_format != "ue8m0" else 32,
        two_d,
        448.0 * 6,
        448.0 * 6,
        rounding,
        False,
        True,
        transposed,
        scaled,
        False,
        True,
        config["BM"],
        config["BK"],
        0,
        True,
    )


def _quantize_tile_config(block_size, two_d, transposed):
    from nemofp4.kernels.quantize import _tile_config

    return _tile_config(block_size, two_d, transposed, True)


@pytest.mark.parametrize("case", ["rows", "rows+transposed", "tiles", "mx-measured", "sr8-bf16-scaled"])
def test_the_quantize_op_passes_opcheck_and_its_fake_matches_the_real_outputs(case):
    x = make_input(24, 64, seed=11)
    g = torch.tensor([5.0])
    kwargs = {
        "rows": {},
        "rows+transposed": {"transposed": True},
        "tiles": {"two_d": True, "scale_format": "e4m3"},
        "mx-measured": {"scale_format": "ue8m0", "g": None},
        "sr8-bf16-scaled": {"rounding": 1, "scaled": 2},
    }[case]
    args = _op_args(x, **{"g": g, **kwargs})
    op = torch.ops.nemofp4.triton_quantize.default
    # schema, fake-tensor (the fake's shapes/dtypes/strides equal the real launch's) and autograd registration
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    real = op(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    torch.library.opcheck(
        torch.ops.nemofp4.triton_amax.default, (x.view(-1),), test_utils=("test_schema", "test_faketensor")
    )


def test_the_quantize_op_is_what_triton_quantize_launches_and_equals_the_reference():
    x = make_input(40, 96, seed=12)
    g = torch.tensor([3.5])
    outs = torch.ops.nemofp4.triton_quantize(*_op_args(x, g=g, transposed=True))
    ref, ref_t = (
        quantize_blocks(x, "ue5m3", tensor_amax=g),
        quantize_blocks(torch.nn.functional.pad(x, (0, 0, 0, -40 % 16)).t().contiguous(), "ue5m3", tensor_amax=g),
    )
    assert torch.equal(outs[0], ref.codes) and torch.equal(outs[1], ref.scale_codes)
    assert torch.equal(outs[5].reshape(()), ref.tensor_scale)
    assert torch.equal(outs[6], ref_t.codes) and torch.equal(outs[7], ref_t.scale_codes)
    assert torch.equal(outs[2], ref.scaled_values()) and outs[3].numel() == 0 and outs[12].numel() == 0
    rows, cols = triton_quantize(x, scale_format="ue5m3", tensor_amax=g, transposed=True, scaled_dtype=torch.float32)
    assert torch.equal(rows.codes, outs[0]) and torch.equal(cols.codes, outs[6]) and torch.equal(rows.scaled, outs[2])


def test_compiling_a_function_that_calls_the_ops_has_no_graph_break():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def quantize_twice(x):
        q, _ = triton_quantize(x, scale_format="ue5m3", rounding="rne")  # measures the amax: a second op
        return q.codes, q.scale_codes, q.tensor_scale

    torch._dynamo.reset()
    compiled = torch.compile(quantize_twice, backend=backend, fullgraph=True)  # a break would raise
    x = make_input(16, 64, seed=13)
    codes, scales, scale = compiled(x)
    assert len(graphs) == 1
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert {"nemofp4.triton_quantize", "nemofp4.triton_amax"} <= targets, targets
    ref = quantize_blocks(x, "ue5m3")
    assert (
        torch.equal(codes, ref.codes) and torch.equal(scales, ref.scale_codes) and torch.equal(scale, ref.tensor_scale)
    )
    torch._dynamo.reset()
