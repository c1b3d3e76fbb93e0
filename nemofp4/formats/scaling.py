"""The scaling formulas every FP4 block quantizer shares, written once.

The float64-checked reference (:func:`nemofp4.formats.quantize_blocks`) and the torch program
that runs eagerly and under ``torch.compile`` (:mod:`nemofp4.kernels.program`) both call these
functions, so the FP32 order of operations that makes NVFP4 and UE5M3 bit-faithful lives in
one place. (The Triton kernels restate them in Triton's language; tests hold them equal.)

* :func:`global_scales`: the tensor scale ``1/G`` and the block-code multiplier ``G * fp32(1/6)``;
  ``G = fp32(T * 6) / g`` capped at FLT_MAX, with each recipe's rule for a zero amax.
* :func:`round_scale_rne` / :func:`encode_scales`: a block scale rounded onto an E4M3/UE5M3 grid
  and its uint8 code, as integer operations on the float32 bits (they compile to vector code).
* :func:`mx_floor_exponent`: OCP MX's exact power-of-two block exponent.
* :func:`fp8_tensor_scale` / :func:`mx_fp8_scale_codes`: the FP8 recipes' scales, as Transformer
  Engine computes them (per-tensor current scaling; MXFP8's round-up E8M0 block exponent).
* :func:`gemm_alpha`: the factor a scaled GEMM multiplies its block-scaled product by, in each
  source's order of operations (not ``tensor_scale_a * tensor_scale_b``, one ulp away).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .minifloat import FloatFormat
from .spec import ELEMENT_FORMATS, SCALE_FORMAT_TABLE, SCALE_FORMATS

__all__ = [
    "E2M1_EMAX",
    "FLT_MAX",
    "FP4_MAX",
    "ScaleGrid",
    "element_grid",
    "encode_scales",
    "fp8_max",
    "fp8_tensor_scale",
    "gemm_alpha",
    "global_scales",
    "nvfp4_dequantize_scale",
    "mx_floor_exponent",
    "mx_fp8_encode",
    "mx_fp8_scale_codes",
    "round_scale_rne",
    "scale_grid",
    "scaled_target",
]

FP4_MAX = 6.0
FLT_MAX = torch.finfo(torch.float32).max
E2M1_EMAX = 2  # floor(log2(6)): OCP MX's shared-exponent offset for FP4 payloads


@functools.lru_cache(maxsize=64)
def _scaled_target(scale_target: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(scale_target * FP4_MAX, dtype=torch.float32, device=device)


def scaled_target(scale_target: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32(T * 6) as a cached 0-d tensor: T * 6 in double, rounded once (TE's ``fp32(448*6)``).

    A tensor, not a Python number: ``number / tensor`` in torch is ``reciprocal(tensor) * number``,
    which rounds differently from the division the recipes specify."""
    return _scaled_target(float(scale_target), torch.device(device))


def global_scales(zero_code_to_one: bool, g: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor_scale = 1/G, G * fp32(1/6)) for the tensor reference ``g`` (float32 0-d).

    ``target`` is :func:`scaled_target`; ``zero_code_to_one`` the scale format's rule for zeros
    (:class:`nemofp4.formats.spec.ScaleFormat`). TE (e4m3, False): g = 0 gives FLT_MAX and only a
    zero multiplier (g = inf) becomes 1; the UE5M3 emulator (True): g = 0 gives G = 1.
    """
    multiplier = torch.clamp(target / g, max=FLT_MAX)
    if zero_code_to_one:
        multiplier = torch.where(g == 0, 1.0, multiplier)
    else:
        multiplier = torch.where(multiplier == 0, 1.0, multiplier)
    return torch.reciprocal(multiplier), multiplier * (1.0 / FP4_MAX)


class ScaleGrid(NamedTuple):
    """A block-scale format as Python numbers (a compiled caller sees constants)."""

    mantissa_bits: int
    bias: int
    min_normal: float
    min_subnormal: float
    max_finite: float


def _grid(fmt: FloatFormat) -> ScaleGrid:
    return ScaleGrid(fmt.mantissa_bits, fmt.bias, fmt.min_normal, fmt.min_subnormal, fmt.max_finite)


@functools.lru_cache(maxsize=16)
def scale_grid(scale_format: str) -> ScaleGrid:
    """The grid of a block-scale format's codes."""
    return _grid(SCALE_FORMATS[scale_format])


@functools.lru_cache(maxsize=16)
def element_grid(element_format: str) -> ScaleGrid:
    """The grid of an FP8 payload format (E4M3, E5M2): :func:`round_scale_rne` and
    :func:`encode_scales` round and encode its magnitudes as they do a scale's."""
    return _grid(ELEMENT_FORMATS[element_format])


def round_scale_rne(v: torch.Tensor, grid: ScaleGrid) -> torch.Tensor:
    """RNE of non-negative float32 ``v`` (<= max_finite) onto an (U)E?M3-style scale grid.

    Normals: round the float32 significand to the format's mantissa bits (integer RNE on the
    bits; carries into the exponent are correct). Subnormals: ``(v + C) - C`` with ulp(C)
    equal to the smallest subnormal, one IEEE addition that rounds to that grid, ties to even.
    """
    drop = 23 - grid.mantissa_bits
    bits = v.view(torch.int32)
    half = (1 << (drop - 1)) - 1
    normal = ((bits + half + ((bits >> drop) & 1)) & ~((1 << drop) - 1)).view(torch.float32)
    magic = 1.5 * 2.0 ** (23 + math.log2(grid.min_subnormal))
    subnormal = (v + magic) - magic
    return torch.where(v < grid.min_normal, subnormal, normal)


def encode_scales(scale: torch.Tensor, grid: ScaleGrid) -> torch.Tensor:
    """uint8 codes of non-negative float32 values that lie on the scale format's grid."""
    bits = scale.view(torch.int32)
    m = grid.mantissa_bits
    exponent = ((bits >> 23) & 0xFF) - 127 + grid.bias
    normal = (exponent << m) | ((bits >> (23 - m)) & ((1 << m) - 1))
    subnormal = (scale * (1.0 / grid.min_subnormal)).int()
    return torch.where(scale < grid.min_normal, subnormal, normal).to(torch.uint8)


def mx_floor_exponent(block_amax: torch.Tensor, element_emax: int = E2M1_EMAX) -> torch.Tensor:
    """OCP MX's block exponent ``floor(log2(amax_b)) - emax`` (-127 for a zero block), unclamped,
    int32, computed exactly from the float32 exponent (a float ``log2`` can be one off). ``emax`` is the
    payload's largest exponent: 2 for E2M1, 8 for E4M3, 15 for E5M2 (torchao's FLOOR mode for MXFP8)."""
    _, exp = torch.frexp(block_amax)  # amax = mantissa * 2^exp, mantissa in [0.5, 1)
    return torch.where(block_amax > 0, exp - 1 - element_emax, -127)


def fp8_max(element_format: str) -> float:
    """The largest finite value of an FP8 payload format (448 for E4M3, 57,344 for E5M2)."""
    return ELEMENT_FORMATS[element_format].max_finite


def fp8_tensor_scale(amax: torch.Tensor, max_value: torch.Tensor, power_of_two: bool) -> torch.Tensor:
    """The per-tensor FP8 scale of Transformer Engine's current scaling: ``compute_scale_from_amax``
    (``common/recipe/recipe_common.cuh``, amax epsilon 0), float32 0-d.

    ``scale = max / amax`` (one IEEE division, ``__fdiv_rn``; ``max_value`` a float32 0-d tensor: a
    Python number over a tensor would multiply by a rounded reciprocal); 1 for an amax that is 0,
    Inf or NaN; FLT_MAX where the quotient overflows; with ``power_of_two`` the mantissa bits
    cleared (``scale_bits &= 0xFF800000``). The payload is ``x * scale``; the decode factor
    (TE's ``scale_inv``) is ``1 / scale``.
    """
    scale = max_value / amax
    scale = torch.where(torch.isinf(scale), FLT_MAX, scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(amax), 1.0, scale)
    if power_of_two:
        scale = (scale.view(torch.int32) & -(1 << 23)).view(torch.float32)  # 0xFF800000: sign and exponent
    return scale


def mx_fp8_scale_codes(block_amax: torch.Tensor, max_reciprocal: float) -> torch.Tensor:
    """MXFP8's biased E8M0 block exponents as Transformer Engine computes them (int32): the block amax
    times ``fp32(1 / max)`` (``Quantized_Limits::max_norm_rcp``), rounded up to a power of two
    (``ptx::float_to_e8m0``, ``cvt.rp.satfinite.ue8m0x2.f32``): 0 for values up to 2^-127, 254 for
    Inf, 255 for NaN. The payload multiplier is :func:`mx_fp8_encode` of the code."""
    v = block_amax * max_reciprocal
    bits = v.view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + up.int()
    return torch.where(torch.isnan(v), 255, torch.where(torch.isinf(v), 254, code))


def mx_fp8_encode(code: torch.Tensor) -> torch.Tensor:
    """The payload multiplier of a biased E8M0 code, as TE's ``ptx::exp2f_rcp``: 1 for code 0, else
    the float32 whose bits are ``(254 - code) << 23`` (2^(127 - code); 0 for code 254)."""
    return torch.where(code == 0, 1.0, ((254 - code) << 23).view(torch.float32))


def gemm_alpha(
    scale_format_a: str,
    amax_a: torch.Tensor,
    target_a: float,
    tensor_scale_a: torch.Tensor,
    scale_format_b: str,
    amax_b: torch.Tensor,
    target_b: float,
    tensor_scale_b: torch.Tensor,
) -> torch.Tensor:
    """float32 0-d factor of ``(A_scaled @ B_scaled^T)``: the product of the two tensor scales as the
    recipe's source computes it from the tensor references (amaxes) ``g``, ``T`` the scale targets.

    * NVFP4 (``e4m3`` x ``e4m3``), TE ``compute_nvfp4_per_tensor_scale_kernel``
      (``common/recipe/nvfp4.cu``): ``fl(g_a * g_b) * fl(1 / fl(fl(36 * T_a) * T_b))``.
    * UE5M3, the paper's ``_encoded_global_alpha`` (``backends/triton/quantization.py``):
      ``fl(g_a * g_b) / ((6 T_a)(6 T_b))`` with the divisor a Python float; on the paper's CUDA
      tensors torch evaluates that as a multiply by ``fl(1 / fl32(divisor))`` (``div_true_kernel_cuda``
      in ATen's ``BinaryDivTrueKernel.cu``), which this reproduces on every device.
    * OCP MX (``ue8m0``, tensor scales 1) and mixed formats: ``tensor_scale_a * tensor_scale_b``.

    Which one is the scale formats' ``alpha`` column (:data:`nemofp4.formats.spec.SCALE_FORMAT_TABLE`).
    """
    alpha = SCALE_FORMAT_TABLE[scale_format_a].alpha
    if alpha is None or SCALE_FORMAT_TABLE[scale_format_b].alpha != alpha:
        return tensor_scale_a * tensor_scale_b
    inverse = _inverse_target_product(alpha == "te", float(target_a), float(target_b), amax_a.device)
    return (amax_a.float().reshape(()) * amax_b.float().reshape(()).to(amax_a.device)) * inverse


@functools.lru_cache(maxsize=64)
def _inverse_target_product(e4m3: bool, target_a: float, target_b: float, device: torch.device) -> torch.Tensor:
    """float32 0-d ``fl(1 / fl(fl(36 T_a) T_b))`` (TE) or ``fl(1 / fl32((6 T_a)(6 T_b)))`` (the paper), cached:
    a constant of the two targets, computed once instead of at every GEMM."""
    if e4m3:
        factor = torch.tensor(36.0, dtype=torch.float32) * target_a * target_b  # fp32 steps
    else:
        factor = torch.tensor((target_a * 6.0) * (target_b * 6.0), dtype=torch.float32)
    return torch.reciprocal(factor).to(device)


def nvfp4_dequantize_scale(block_scale: torch.Tensor, amax: torch.Tensor, target: float) -> torch.Tensor:
    """TE's per-block decode factor (``dequantize_fp4_kernel``, ``cast/nvfp4/dequantize_nvfp4.cuh``):
    ``fl(fl(block_scale * amax) * fl(1 / fl(6 * T)))``; a payload decodes to ``fl(value * factor)``."""
    inverse = torch.reciprocal(torch.tensor(FP4_MAX, dtype=torch.float32) * float(target)).to(block_scale.device)
    return (block_scale * amax.float().reshape(())) * inverse
