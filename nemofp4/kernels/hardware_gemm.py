"""The ``hardware`` GEMM mode: the UE5M3 paper's probe-matched model of a native FP4 GEMM.

For ``C = A @ B^T`` with both operands block-quantized along K (the paper, section 6):

1. every product ``(E2M1 value x block scale)_a * (E2M1 value x block scale)_b`` is exact;
2. K is split into groups of 64 products in physical order (the last group may be shorter);
   each group's exact sum is rounded once to FP32 with round-to-nearest-even;
3. the group partials are added in K order, starting from +0, in FP32 with round-toward-zero
   on every inexact addition;
4. optionally the result is snapped to the 1/1024 lattice, ``round(1024 c) / 1024`` (RNE);
5. only then is it multiplied by the tensor-scale product ``alpha`` (FP32), computed from the two
   amaxes as the paper's ``probe_matched_fp4_gemm`` does (``_encoded_global_alpha``; TE's order
   for NVFP4 operands): :func:`nemofp4.formats.tensor_scale_product`.

:func:`hardware_gemm_reference` computes this in slow, exact PyTorch/Python integer arithmetic;
:func:`triton_hardware_gemm` is the Triton kernel and :func:`hardware_gemm_torch` its vectorized
PyTorch twin (the CPU path). They agree bit for bit whenever their float64 group sums are exact, i.e. whenever the block scales met inside one 64-group span
fewer than about 2^31 (any realistic tensor; a group that mixes scales 2^-9 and 448 on both
operands would not qualify). Operands are :class:`~nemofp4.formats.QuantizedBlocks` (or the quant
module's packed operands) of 2-D tensors ``[rows, K]``; ``b_transposed=True`` reads a 16x16-tiled
``[K, rows]`` tensor as its transpose (the dgrad weight).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from nemofp4.formats import SCALE_FORMAT_TABLE, QuantizedBlocks, tensor_scale_product

__all__ = [
    "GROUP_SIZE",
    "hardware_gemm_reference",
    "hardware_gemm_torch",
    "round_exact_to_float32",
    "rtz_add_f32",
    "triton_hardware_gemm",
]

GROUP_SIZE = 64
HARDWARE_BLOCK_SIZES = (16, 32, 64)
_FLT_MAX = float(torch.finfo(torch.float32).max)


# ------------------------------------------------------------------------------------ reference
def hardware_gemm_reference(a_q, b_q, *, b_transposed: bool = False, lattice_snap: bool = False) -> torch.Tensor:
    """float32 ``[M, N]``: A @ B^T under the probe-matched model, step by step and exactly (slow:
    test-sized operands only). ``a_q``/``b_q`` are 2-D quantized operands with blocks along K."""
    a = _scaled_f64(a_q, transposed=False)
    b = _scaled_f64(b_q, transposed=b_transposed)
    _check_k(a_q, b_q, b_transposed)
    k = max(a.shape[1], b.shape[1])
    a = torch.nn.functional.pad(a, (0, k - a.shape[1]))
    b = torch.nn.functional.pad(b, (0, k - b.shape[1]))
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    for start in range(0, k, GROUP_SIZE):
        products = a[:, None, start : start + GROUP_SIZE] * b[None, :, start : start + GROUP_SIZE]
        acc = rtz_add_f32(acc, _exact_sum_to_f32(products))
    if lattice_snap:
        acc = torch.round(acc * 1024) / 1024
    return acc * tensor_scale_product(a_q, b_q).detach().cpu()


def rtz_add_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise float32 ``a + b`` rounded toward zero, exactly (IEEE semantics for Inf/NaN;
    overflow gives +-FLT_MAX, as round-toward-zero does).

    The float64 sum of two float32 numbers is exact when their exponents differ by less than 29;
    otherwise its rounding error ``err`` (Knuth's TwoSum, exact in float64) decides: the exact sum
    is ``s + err``, so it lies strictly inside the float32 interval around ``s`` unless ``s`` is
    itself a float32 number, and then it is just below (toward zero) iff ``err`` has the opposite
    sign of ``s``.
    """
    assert a.dtype == b.dtype == torch.float32
    a64, b64 = a.double(), b.double()
    s = a64 + b64
    bb = s - a64
    err = (a64 - (s - bb)) + (b64 - bb)
    t = _truncate_to_f32(s)
    on_grid = t.double() == s
    below = on_grid & (err != 0) & (torch.signbit(err) != torch.signbit(s))
    t = torch.where(below, torch.nextafter(t, torch.zeros_like(t)), t)
    finite = torch.isfinite(a) & torch.isfinite(b)
    return torch.where(finite, t, a + b)


def _truncate_to_f32(s: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounding toward zero: the RNE result, stepped back if it went outward
    (this also turns an overflow to Inf into FLT_MAX)."""
    t = s.float()
    outward = t.double().abs() > s.abs()
    return torch.where(outward, torch.nextafter(t, torch.zeros_like(t)), t)


def round_exact_to_float32(mantissa: int, exponent: int) -> float:
    """RNE of the exact value ``mantissa * 2**exponent`` to float32 (returned as a Python float):
    24 significant bits, subnormals down to 2^-149, overflow to +-Inf."""
    if mantissa == 0:
        return 0.0
    sign = -1.0 if mantissa < 0 else 1.0
    n = abs(mantissa)
    lsb = max(exponent + n.bit_length() - 24, -149)  # weight of the last kept bit
    shift = lsb - exponent
    if shift > 0:
        q, r = divmod(n, 1 << shift)
        half = 1 << (shift - 1)
        if r > half or (r == half and q & 1):
            q += 1
    else:
        q = n << -shift
    if q * 2.0**lsb > _FLT_MAX:  # q <= 2^24: the product is exact in float64
        return sign * math.inf
    return sign * math.ldexp(q, lsb)


def _exact_sum_to_f32(products: torch.Tensor) -> torch.Tensor:
    """[M, N, G] float64 exact products -> [M, N] float32: each row's exact sum, rounded once (RNE).

    Each double is ``m * 2^e`` with an integer ``m`` of at most 53 bits; aligned to the row's
    smallest exponent they sum exactly as Python integers.
    """
    mantissa, exponent = torch.frexp(products)  # products = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    ints = (mantissa * 2.0**53).to(torch.int64)  # exact
    exps = exponent.to(torch.int64) - 53
    big = torch.iinfo(torch.int64).max
    e_min = torch.where(ints != 0, exps, big).amin(dim=-1, keepdim=True)
    e_min = torch.where(e_min == big, 0, e_min)
    shifts = torch.where(ints != 0, exps - e_min, 0)
    ints_obj = ints.numpy().astype(object)
    total = np.left_shift(ints_obj, shifts.numpy().astype(object)).sum(axis=-1)
    rounded = np.frompyfunc(round_exact_to_float32, 2, 1)(total, e_min[..., 0].numpy().astype(object))
    return torch.from_numpy(rounded.astype(np.float64)).float()


def _scaled_f64(q, *, transposed: bool, device: str | None = "cpu") -> torch.Tensor:
    """float64 [rows, K_padded] of E2M1 value x block scale (exact), on ``device`` (None: q's)."""
    if not isinstance(q, QuantizedBlocks):
        raise ValueError(f"expected a QuantizedBlocks operand, got {type(q).__name__}")
    scaled = q.scaled_values()
    if scaled.dim() != 2:
        raise ValueError(f"the hardware GEMM takes 2-D operands, got padded shape {tuple(scaled.shape)}")
    scaled = scaled.detach().double().contiguous()  # the wgrad operands' scaled form is a transposed view
    if device is not None:
        scaled = scaled.to(device)
    rows = q.shape[1] if transposed else q.shape[0]
    return (scaled.t() if transposed else scaled)[:rows]


def _check_k(a_q, b_q, b_transposed: bool) -> None:
    if b_transposed and not b_q.two_d:
        raise ValueError("b_transposed=True needs a 16x16-tiled (two_d) operand: 1-D blocks run along one dim only")
    k_a = a_q.shape[1]
    k_b = b_q.shape[0] if b_transposed else b_q.shape[1]
    if k_a != k_b:
        raise ValueError(f"reduction dims differ: A has K={k_a}, B has K={k_b}")


def hardware_gemm_torch(a_q, b_q, *, b_transposed: bool = False, lattice_snap: bool = False) -> torch.Tensor:
    """The model with float64 group sums (one batched float64 matmul over all 64-groups) and the
    exact round-toward-zero chain: equals the reference whenever a group's sum fits float64's
    53 bits (see the module docstring). The CPU path of the ``hardware`` mode; float32 ``[M, N]``."""
    _check_k(a_q, b_q, b_transposed)
    a = _scaled_f64(a_q, transposed=False, device=None)
    b = _scaled_f64(b_q, transposed=b_transposed, device=None)
    k = -(-max(a.shape[1], b.shape[1]) // GROUP_SIZE) * GROUP_SIZE
    a = torch.nn.functional.pad(a, (0, k - a.shape[1])).view(a.shape[0], -1, GROUP_SIZE).transpose(0, 1)
    b = torch.nn.functional.pad(b, (0, k - b.shape[1])).view(b.shape[0], -1, GROUP_SIZE).transpose(0, 1)
    partials = torch.bmm(a, b.transpose(1, 2)).float()  # [groups, M, N]: each exact sum, rounded once
    acc = torch.zeros(partials.shape[1:], dtype=torch.float32, device=partials.device)
    for partial in partials:
        acc = rtz_add_f32(acc, partial)
    if lattice_snap:
        acc = torch.round(acc * 1024) / 1024
    return acc * tensor_scale_product(a_q, b_q).detach().to(acc.device)


# ------------------------------------------------------------------------------------ Triton
def triton_hardware_gemm(
    a_q, b_q, *, b_transposed: bool = False, lattice_snap: bool = False, block_m: int = 64, block_n: int = 64
) -> torch.Tensor:
    """The Triton kernel of the same model: float32 ``[M, N]`` on the operands' device.

    Operands need their packed codes (QuantizedBlocks from the reference, or quantized with
    ``pack=True``). Block sizes must be 16, 32 or 64.
    """
    a, b = _codes_of(a_q), _codes_of(b_q)
    _check_k(a, b, b_transposed)
    for name, q in (("A", a), ("B", b)):
        if len(q.shape) != 2:
            raise ValueError(f"{name}: the hardware GEMM takes 2-D operands, got shape {tuple(q.shape)}")
        if q.block_size not in HARDWARE_BLOCK_SIZES:
            raise ValueError(f"{name}: block_size {q.block_size} not supported; valid: {HARDWARE_BLOCK_SIZES}")
    if a.codes.device != b.codes.device:
        raise ValueError(f"operands on different devices: {a.codes.device} and {b.codes.device}")
    m = a.shape[0]
    n = b.shape[1] if b_transposed else b.shape[0]
    k_a = a.padded_shape[1]
    k_b = b.padded_shape[0] if b_transposed else b.padded_shape[1]
    k = max(k_a, k_b)
    return torch.ops.nemofp4.triton_hardware_gemm(
        a.codes.contiguous(),
        a.scale_codes.contiguous(),
        b.codes.contiguous(),
        b.scale_codes.contiguous(),
        # the kernel multiplies by a_ts * b_ts: passing (alpha, 1) applies alpha exactly
        tensor_scale_product(a, b).float().reshape(1),
        torch.ones(1, dtype=torch.float32, device=a.codes.device),
        m,
        n,
        k_a,
        k_b,
        k,
        a.scale_format,
        a.block_size,
        bool(a.two_d),
        False,
        b.scale_format,
        b.block_size,
        bool(b.two_d),
        b_transposed,
        lattice_snap,
        block_m,
        block_n,
    )


@torch.library.custom_op("nemofp4::triton_hardware_gemm", mutates_args=(), device_types=("cuda", "cpu"))
def _hardware_gemm_op(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    a_tensor_scale: torch.Tensor,
    b_tensor_scale: torch.Tensor,
    m: int,
    n: int,
    k_a: int,
    k_b: int,
    k: int,
    a_format: str,
    a_block_size: int,
    a_two_d: bool,
    a_transposed: bool,
    b_format: str,
    b_block_size: int,
    b_two_d: bool,
    b_transposed: bool,
    lattice_snap: bool,
    block_m: int,
    block_n: int,
) -> torch.Tensor:
    """The GEMM launch as an op (float32 ``[m, n]``), so compiled graphs hold it without a break."""
    device = a_codes.device
    out = torch.empty(m, n, dtype=torch.float32, device=device)
    grid = (-(-m // block_m), -(-n // block_n))
    interpreting = device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    from . import _gemm_kernels

    _gemm_kernels.hardware_gemm_kernel[grid](
        a_codes,
        a_scales,
        b_codes,
        b_scales,
        out,
        a_tensor_scale,
        b_tensor_scale,
        m,
        n,
        k_a,
        k_b,
        k,
        a_codes.stride(0),
        a_scales.stride(0),
        b_codes.stride(0),
        b_scales.stride(0),
        out.stride(0),
        **_operand_meta("A", a_format, a_block_size, a_two_d, a_transposed),
        **_operand_meta("B", b_format, b_block_size, b_two_d, b_transposed),
        SUB=min(a_block_size, b_block_size),
        LATTICE_SNAP=lattice_snap,
        BM=block_m,
        BN=block_n,
        # 8 warps: 192 registers per thread at 64x64 on sm_90 without spills (255 + spills at 4)
        **({} if interpreting else {"num_warps": 8, "enable_fp_fusion": False}),
    )
    return out


@_hardware_gemm_op.register_fake
def _(a_codes, a_scales, b_codes, b_scales, a_tensor_scale, b_tensor_scale, m, n, *_):
    return a_codes.new_empty(m, n, dtype=torch.float32)


def _codes_of(q):
    """The operand, checked to have its packed form."""
    if not isinstance(q, QuantizedBlocks):
        raise ValueError(f"expected a QuantizedBlocks operand, got {type(q).__name__}")
    if q.codes is None:
        raise ValueError(
            "the Triton hardware GEMM reads packed FP4 codes; this operand has none (quantize it with pack=True)"
        )
    return q


def _operand_meta(prefix: str, scale_format: str, block_size: int, two_d: bool, transposed: bool) -> dict:
    row = SCALE_FORMAT_TABLE[scale_format]
    fmt = row.codes
    return {
        f"{prefix}_BS": block_size,
        f"{prefix}_TWO_D": two_d,
        f"{prefix}_TRANSPOSED": transposed,
        f"{prefix}_IS_MX": row.power_of_two,
        f"{prefix}_BIAS": fmt.bias,
        f"{prefix}_MANT": fmt.mantissa_bits,
        f"{prefix}_SUB_STEP": fmt.min_subnormal,
    }
