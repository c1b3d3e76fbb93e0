"""Triton kernel of :func:`nemofp4.kernels.hardware_gemm.triton_hardware_gemm` (imported on first launch).

For a tile of outputs and each 64-wide group of the reduction dim, the group's exact sum is
built from sub-blocks that have one block scale per operand: ``D = sum(2a * 2b)`` over the
sub-block is a dot product of small integers (|2a|, |2b| <= 12), exact in any FP32
accumulation order, and the group sum is ``sum(D * scale_a * scale_b) / 4`` in float64 (each
term exact). That sum is rounded once to FP32 (RNE), then added to the running output with
round-toward-zero: an FP32 TwoSum gives the rounding error of the RNE sum exactly, and when it
points toward zero the result steps one ulp toward zero.
"""

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
GROUP = tl.constexpr(64)
TWO_POW_23 = tl.constexpr(8388608.0)


@triton.jit
def _e2m1_times_two(codes_ptr, stride, r, k, r_ok, k_ok, TRANSPOSED: tl.constexpr):
    """[len(r), len(k)] float16: 2 x the E2M1 value of operand element (row r, reduction index k).

    Stored row-major ``[rows, K/2]`` (two codes per byte, even element low), or for a
    transposed operand ``[K, rows/2]``."""
    ok = r_ok[:, None] & k_ok[None, :]
    if TRANSPOSED:
        byte = tl.load(codes_ptr + k[None, :].to(tl.int64) * stride + r[:, None] // 2, mask=ok, other=0)
        nibble = (byte.to(tl.int32) >> ((r[:, None] & 1) * 4)) & 15
    else:
        byte = tl.load(codes_ptr + r[:, None].to(tl.int64) * stride + k[None, :] // 2, mask=ok, other=0)
        nibble = (byte.to(tl.int32) >> ((k[None, :] & 1) * 4)) & 15
    mag = nibble & 7
    twice = tl.where(mag < 4, mag, tl.where(mag < 6, 2 * mag - 4, 4 * mag - 16))  # 0,1,..,12
    return tl.where((nibble & 8) != 0, -twice, twice).to(tl.float16)


@triton.jit
def _block_scale_f64(
    scales_ptr,
    stride,
    r,
    kb,
    r_ok,
    BS: tl.constexpr,
    TWO_D: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    IS_MX: tl.constexpr,
    BIAS: tl.constexpr,
    MANT: tl.constexpr,
    SUB_STEP: tl.constexpr,
):
    """[len(r)] float64 decoded block scale of rows r for reduction block kb (exact)."""
    if TWO_D:
        if TRANSPOSED:
            offs = kb * stride + r // BS
        else:
            offs = (r // BS).to(tl.int64) * stride + kb
    else:
        offs = r.to(tl.int64) * stride + kb
    code = tl.load(scales_ptr + offs, mask=r_ok, other=0).to(tl.int64)
    if IS_MX:
        return ((code + (1023 - 127)) << 52).to(tl.float64, bitcast=True)
    else:
        exponent = code >> MANT
        mantissa = code & ((1 << MANT) - 1)
        normal = (((exponent - BIAS + 1023) << 52) | (mantissa << (52 - MANT))).to(tl.float64, bitcast=True)
        return tl.where(exponent == 0, mantissa.to(tl.float64) * SUB_STEP, normal)


@triton.jit
def _add_round_toward_zero(a, b):
    """a + b rounded toward zero (float32), exactly: s = rne(a + b) and its exact error (TwoSum);
    an error of the opposite sign means s overshot away from zero, so step one ulp back."""
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    finite = tl.abs(s) < float("inf")
    toward_zero = finite & (err != 0.0) & ((err < 0.0) != (s < 0.0))
    result = tl.where(toward_zero, (s.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), s)
    overflow = (~finite) & (tl.abs(a) < float("inf")) & (tl.abs(b) < float("inf"))
    return tl.where(overflow, tl.where(s < 0.0, -FLT_MAX, FLT_MAX), result)


@triton.jit
def _round_half_even(v):
    """torch.round for float32: half-to-even via one addition of 2^23 (exact below 2^23)."""
    mag = tl.abs(v)
    rounded = tl.where(mag < TWO_POW_23, (mag + TWO_POW_23) - TWO_POW_23, mag)
    return tl.where(v < 0.0, -rounded, rounded)


@triton.jit
def hardware_gemm_kernel(
    a_codes,
    a_scales,
    b_codes,
    b_scales,
    out_ptr,
    a_ts_ptr,
    b_ts_ptr,
    M,
    N,
    K_a,
    K_b,
    K,
    stride_a_codes,
    stride_a_scales,
    stride_b_codes,
    stride_b_scales,
    stride_out,
    A_BS: tl.constexpr,
    A_TWO_D: tl.constexpr,
    A_TRANSPOSED: tl.constexpr,
    A_IS_MX: tl.constexpr,
    A_BIAS: tl.constexpr,
    A_MANT: tl.constexpr,
    A_SUB_STEP: tl.constexpr,
    B_BS: tl.constexpr,
    B_TWO_D: tl.constexpr,
    B_TRANSPOSED: tl.constexpr,
    B_IS_MX: tl.constexpr,
    B_BIAS: tl.constexpr,
    B_MANT: tl.constexpr,
    B_SUB_STEP: tl.constexpr,
    SUB: tl.constexpr,
    LATTICE_SNAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """out[M, N] = A @ B^T under the probe-matched model; K_a/K_b are the operands' stored
    (padded) reduction lengths, K the common one (a multiple of the block sizes)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, GROUP):
        group_sum = tl.zeros((BM, BN), dtype=tl.float64)
        for s in tl.static_range(GROUP // SUB):
            ks = k0 + s * SUB
            kk = ks + tl.arange(0, SUB)
            a2 = _e2m1_times_two(a_codes, stride_a_codes, rm, kk, m_ok, kk < K_a, A_TRANSPOSED)
            b2 = _e2m1_times_two(b_codes, stride_b_codes, rn, kk, n_ok, kk < K_b, B_TRANSPOSED)
            quarter_units = tl.dot(a2, tl.trans(b2), out_dtype=tl.float32)  # 4 * sum(a * b), exact
            scale_a = _block_scale_f64(
                a_scales,
                stride_a_scales,
                rm,
                ks // A_BS,
                m_ok & ((rm * 0 + ks) < K_a),
                A_BS,
                A_TWO_D,
                A_TRANSPOSED,
                A_IS_MX,
                A_BIAS,
                A_MANT,
                A_SUB_STEP,
            )
            scale_b = _block_scale_f64(
                b_scales,
                stride_b_scales,
                rn,
                ks // B_BS,
                n_ok & ((rn * 0 + ks) < K_b),
                B_BS,
                B_TWO_D,
                B_TRANSPOSED,
                B_IS_MX,
                B_BIAS,
                B_MANT,
                B_SUB_STEP,
            )
            group_sum += quarter_units.to(tl.float64) * (scale_a[:, None] * scale_b[None, :])
        partial = (group_sum * 0.25).to(tl.float32)  # the group's FP32 partial sum, RNE
        acc = _add_round_toward_zero(acc, partial)
    if LATTICE_SNAP:
        acc = _round_half_even(acc * 1024.0) * (1.0 / 1024.0)
    alpha = tl.load(a_ts_ptr) * tl.load(b_ts_ptr)
    out = acc * alpha
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_out + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])
