"""Two-level FP4 block quantization: E2M1 payloads, per-block scales, an FP32 tensor scale.

One function, ``quantize_blocks``, covers three scale formats; they differ only in how the
per-block scale is chosen and encoded:

``e4m3`` (NVFP4, Transformer Engine's reference quantizer, operation for operation)
    s_enc = fp32(448*6) / g, capped at FLT_MAX, and 0 -> 1 (g = current amax unless given)
    tensor_scale = 1 / s_enc                                    (the FP32 global decode scale)
    ideal_b = amax_b * (s_enc * fp32(1/6))    <- one product with the folded 1/6, not amax_b/6*s_enc
    code_b  = e4m3_rne(min(ideal_b, 448))     <- no lower clamp: zero/underflowing blocks get code 0
    enc_b   = min(1 / (e4m3(code_b) * tensor_scale), FLT_MAX)   <- reciprocal, then multiply
    payload = e2m1_round(clamp(x * enc_b, -6, 6))
``ue5m3`` / ``ue5m3_cuda`` (the UE5M3 paper's recipe, its emulator's FP32 order)
    G = fp32(T*6) / g, with g = 0 -> G = 1, capped at FLT_MAX    (T = scale_target, default 448)
    tensor_scale = 1 / G
    code_b  = ue5m3_rne(min(amax_b * (G * fp32(1/6)), max_finite)), then a zero code -> 1.0
    enc_b and payload as above.
``ue8m0`` (OCP MX): no tensor scale (1.0); the block scale is a power of two 2^e_b with
    floor mode (OCP reference): e_b = floor(log2(amax_b)) - 2, amax_b = 0 -> -127;
    ceil mode (TE's pow-2 mode):  e_b = ceil(log2(fp32(amax_b / 6))), 0 -> -127;
    clamped to [-127, 127] and computed exactly from the float32 exponent (TE's reference
    uses a float ``log2``, which can be one off just above a power of two).

Load-bearing details a naive re-implementation gets wrong:
  * the 1/6 is folded into the global multiplier (``s_enc * fp32(1/6)``) before multiplying
    the block amax; ``amax_b / 6 * s_enc`` rounds differently near scale-code midpoints;
  * the payload multiplier is ``1 / (scale * tensor_scale)``, a rounded reciprocal, and the
    payload is ``x * that`` (not ``x / (scale * tensor_scale)``): the two differ by an ulp and
    can land on opposite sides of an E2M1 midpoint;
  * E2M1 ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4;
  * NVFP4 emits a zero scale code for zero (or underflowing) blocks (torchao clamps the scale
    to the smallest E4M3 subnormal instead); UE5M3 replaces a zero code by 1.0 before the
    reciprocal. Scale codes use RNE; only the payload rounding is selectable.
  * ``dequantize`` follows each source: NVFP4 as TE's dequantize kernel,
    payload * ((block scale * amax) * fl(1/2688)); UE5M3 as the paper's decoded output,
    (payload * block scale) * tensor_scale, whose first product is exact in float32.

Layout: blocks run along the last dim (``block_size`` contiguous elements), or 2-D tiles
``block_size x block_size`` for a 2-D weight (the tile amax sets the scale of every row of
the tile, as TE's 2-D mode). Dims that are not a multiple of the block are zero-padded; the
padded layout is what ``codes`` holds.
"""

from __future__ import annotations

import math

import torch

from .minifloat import E2M1, round_magnitude_to_index
from .operand import QuantizedBlocks
from .scaling import FLT_MAX, FP4_MAX, global_scales, mx_floor_exponent, scaled_target
from .spec import DEFAULT_SCALE_TARGET, SCALE_FORMATS, STAT_NAMES, BlockSpec

__all__ = ["SCALE_FORMATS", "QuantizedBlocks", "amax", "quantize_blocks", "quantize_with_spec"]


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor (exact: the max is taken in the input dtype).

    Always +0 for an all-zero tensor: ``max(hi, -lo)`` of ``-0`` is ``-0``, and TE's ``G = 2688 / g``
    would then be -inf (a NaN operand); ``abs`` makes it ``max |x|`` as TE computes it."""
    if x.numel() == 0:
        raise ValueError("amax of an empty tensor is undefined")
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(hi, -lo).abs().float()


def quantize_blocks(
    x: torch.Tensor,
    scale_format: str = "ue5m3",
    block_size: int | None = None,
    two_d: bool = False,
    scale_target: float = DEFAULT_SCALE_TARGET,
    tensor_amax: torch.Tensor | float | None = None,
    rounding: str = "rne",
    generator: torch.Generator | None = None,
    *,
    mx_scale_mode: str = "floor",
    name: str = "x",
) -> QuantizedBlocks:
    """Quantize ``x`` (float32/bfloat16/float16, any leading dims) to FP4 with block scales.

    Args:
        scale_format: "e4m3" (NVFP4), "ue5m3" (paper), "ue5m3_cuda", or "ue8m0" (OCP MX).
        block_size: elements per block along the last dim (tile side in 2-D mode);
            None -> 16, or 32 for ue8m0.
        two_d: square ``block_size`` tiles over a 2-D ``x`` (weights).
        scale_target: T, the scale code the tensor reference g maps to (e4m3/ue5m3).
        tensor_amax: the held reference g; None measures the current amax of ``x``.
        rounding: payload rounding, "rne", "sr" (TE's cvt.rs), "sr8" (the paper's) or "sr_exact";
            scale codes always use RNE.
        generator: the only source of random bits for the stochastic roundings (the padded
            tensor's elements in memory order; see :mod:`nemofp4.formats.minifloat`).
        mx_scale_mode: ue8m0 only: "floor" (OCP reference) or "ceil" (never saturates).
        name: how error messages refer to ``x``.
    """
    spec = BlockSpec(
        scale_format=scale_format,
        block_size=block_size,
        two_d=two_d,
        rounding=rounding,
        scale_target=scale_target,
        mx_scale_mode=mx_scale_mode,
    )
    return quantize_with_spec(x, spec, tensor_amax=tensor_amax, generator=generator, name=name, stacklevel=4)


def quantize_with_spec(
    x: torch.Tensor,
    spec: BlockSpec,
    *,
    tensor_amax: torch.Tensor | float | None = None,
    generator: torch.Generator | None = None,
    name: str = "x",
    stacklevel: int = 3,
) -> QuantizedBlocks:
    """:func:`quantize_blocks` of ``x`` as ``spec`` says (its ``hadamard`` is the caller's: the
    reference quantizes the tensor it is given)."""
    if spec.is_fp8:
        raise ValueError(
            f"quantize_blocks is the FP4 reference; FP8 ({spec.element_format!r} payloads) is quantized "
            "by nemofp4.kernels.quantize_operand"
        )
    spec.check_input(x, tensor_amax, name=name, stacklevel=stacklevel)
    row = spec.format
    fmt = row.codes
    block_size, two_d, rounding = spec.block_size, spec.two_d, spec.rounding
    device = x.device
    shape = x.shape

    # ---- pad and view as blocks: [..., n_blocks, block] or [row_tiles, b, col_tiles, b]
    x32 = x.detach().float().contiguous()  # no copy for a contiguous float32 input
    b = block_size
    if two_d:
        rows, cols = shape
        pad_r, pad_c = -rows % b, -cols % b
        if pad_r or pad_c:
            x32 = torch.nn.functional.pad(x32, (0, pad_c, 0, pad_r))
        padded_shape = x32.shape
        x_blocks = x32.view(padded_shape[0] // b, b, padded_shape[1] // b, b)
        block_min, block_max = x_blocks.amin(dim=(1, 3)), x_blocks.amax(dim=(1, 3))
    else:
        pad = -shape[-1] % b
        if pad:
            x32 = torch.nn.functional.pad(x32, (0, pad))
        padded_shape = x32.shape
        x_blocks = x32.view(*padded_shape[:-1], padded_shape[-1] // b, b)
        block_min, block_max = torch.aminmax(x_blocks, dim=-1)
    # [..., n_blocks] / [row_tiles, col_tiles]; abs: an all -0 block has amax +0, not -0
    block_amax = torch.maximum(block_max, -block_min).abs()
    if not torch.isfinite(block_amax).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"quantize_blocks: tensor {name!r} has {bad} non-finite (NaN/Inf) values")

    if tensor_amax is None:
        g = block_amax.amax()
    else:
        g = torch.as_tensor(tensor_amax, dtype=torch.float32, device=device).reshape(())
        if not (torch.isfinite(g) and g >= 0):
            raise ValueError(f"tensor_amax must be finite and >= 0, got {float(g)}")

    # ---- block scale codes and the per-block payload multiplier
    if row.power_of_two:
        tensor_scale = torch.ones((), dtype=torch.float32, device=device)
        exponent, unclamped = _mx_exponent(block_amax, spec.mx_scale_mode)
        scale_codes = (exponent + 127).to(torch.uint8)
        encode = _ue8m0_reciprocal_table(device)[scale_codes.long()]
        saturated = unclamped > 127
        underflow = (unclamped < -127) & (block_amax > 0)
    else:
        target = scaled_target(spec.scale_target, device)
        tensor_scale, code_multiplier = global_scales(row.zero_code_to_one, g, target)
        ideal = (block_amax * code_multiplier).clamp_(max=FLT_MAX)
        saturated = ideal > fmt.max_finite
        index = round_magnitude_to_index(fmt, ideal.clamp(max=fmt.max_finite), "rne", None)
        underflow = (index == 0) & (block_amax > 0)
        if row.zero_code_to_one:  # UE5M3: a zero code becomes 1.0 before the reciprocal
            one = fmt._magnitude_values_f64.index(1.0)
            index = torch.where(index == 0, one, index)
        scale_codes = index.to(torch.uint8)
        block_scale = fmt.decode(scale_codes)
        encode = torch.reciprocal(block_scale * tensor_scale).clamp_(max=FLT_MAX)

    # ---- payload: x * enc_b, clamp to +-6, round to E2M1
    if two_d:
        y = x_blocks * encode[:, None, :, None]
    else:
        y = x_blocks * encode[..., None]
    block_peak = block_amax * encode  # == max |y| of the block (rounding is monotonic)
    clipped_blocks = block_peak > FP4_MAX
    y = y.view(padded_shape)
    negative = torch.signbit(y)
    # |y| > 6 saturates inside the rounding (RNE counts midpoints below |y|; SR clamps first),
    # which is the payload clamp to +-6 without a separate pass.
    e2m1_codes = round_magnitude_to_index(E2M1, y.abs_(), rounding, generator)
    e2m1_codes |= negative.view(torch.uint8) << 3
    packed = e2m1_codes[..., 0::2] | (e2m1_codes[..., 1::2] << 4)

    clipped = _count_clipped(x_blocks, encode, clipped_blocks, two_d)
    counts = dict(zip(STAT_NAMES, (saturated.sum(), underflow.sum(), (block_amax == 0).sum(), clipped)))
    return QuantizedBlocks(
        codes=packed,
        scale_codes=scale_codes,
        tensor_scale=tensor_scale,
        tensor_amax=g.float(),
        scale_target=float(spec.scale_target),
        shape=shape,
        padded_shape=padded_shape,
        block_size=b,
        two_d=two_d,
        scale_format=spec.scale_format,
        counts=counts,
        num_blocks=block_amax.numel(),
        num_elements=x.numel(),
    )


def _mx_exponent(block_amax: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact power-of-two block exponent (clamped to [-127, 127]) and the unclamped one."""
    if mode == "floor":
        unclamped = mx_floor_exponent(block_amax)
    else:
        decode = block_amax / FP4_MAX
        mantissa, exp = torch.frexp(decode)
        unclamped = torch.where(mantissa == 0.5, exp - 1, exp)
        # amax / 6 can underflow to 0 for a non-zero block: TE's log2(0) = -inf clamps to -127
        unclamped = torch.where(decode > 0, unclamped, torch.where(block_amax > 0, -128, -127))
    return unclamped.clamp(-127, 127), unclamped


def _count_clipped(x_blocks: torch.Tensor, encode: torch.Tensor, clipped_blocks: torch.Tensor, two_d: bool):
    """Elements with |x * enc_b| > 6, looking only inside blocks whose peak exceeds 6."""
    if two_d:
        x_blocks = x_blocks.transpose(1, 2)  # [row_tiles, col_tiles, b, b]
        selected = x_blocks[clipped_blocks].flatten(1)
    else:
        selected = x_blocks[clipped_blocks]
    return ((selected * encode[clipped_blocks][:, None]).abs() > FP4_MAX).sum()


_UE8M0_RECIPROCALS: dict[torch.device, torch.Tensor] = {}


def _ue8m0_reciprocal_table(device: torch.device) -> torch.Tensor:
    """[256] float32: 1 / 2^(code - 127), exact (2^-127 is a float32 subnormal)."""
    if device not in _UE8M0_RECIPROCALS:
        table = torch.tensor([math.ldexp(1.0, 127 - c) for c in range(255)] + [math.nan], dtype=torch.float64)
        _UE8M0_RECIPROCALS[device] = table.float().to(device)
    return _UE8M0_RECIPROCALS[device]
