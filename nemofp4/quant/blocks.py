"""Fast block quantization of GEMM operands, bit-identical to :func:`nemofp4.formats.quantize_blocks`.

``quantize_blocks`` is the numerics reference: it returns packed FP4 codes, scale codes and
statistics. A training GEMM needs something else, ``E2M1 value x block scale`` as a float
tensor, for every operand, five times per linear per step. This module computes that
directly, with the reference's formulas in the same FP32 order, in about a third of the
passes over memory: no packing/unpacking for operands consumed at once, the E2M1 rounding
as arithmetic on the spacing of each binade instead of comparisons against every boundary,
and the block-scale rounding as an integer rounding of the float32 bits. Operands saved for
backward are packed (:class:`PackedOperand`). Tests hold every output (scaled values, tensor
scale, FP4 codes, scale codes, statistics, and stochastic rounding given the same generator)
bitwise equal to the reference.

E2M1 rounding here: |y| in [0, 2), [2, 4), [4, 6] has grid spacing 1/2, 1, 2, so with
``inv = 1/spacing`` the rounded magnitude is ``round(|y| * inv) / inv`` (RNE: ``torch.round``
is half-to-even, and the products and quotients are exact powers-of-two rescalings); the
binade of ``|y|`` is ``int(|y|)`` looked up in a 7-entry table. Stochastic rounding uses the
exact fraction ``|y| * inv - floor(|y| * inv)`` and draws its random numbers exactly as the
reference does (same call, shape and order), so both consume a generator identically.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from nemofp4.formats import get_format, sr8_bytes, sr8_words

from .config import OperandQuant

__all__ = ["BlockOperand", "PackedOperand", "quantize_operand"]

_FP4_MAX = 6.0
_FLT_MAX = torch.finfo(torch.float32).max
_E2M1_EMAX = 2  # floor(log2(6)): OCP MX's shared-exponent offset for FP4 payloads
_TREE_MIN_ELEMENTS = 1 << 17


def _global_scales(scale_format: str, g: torch.Tensor, scale_target: float):
    """(tensor_scale = 1/G as a float32 0-d tensor, G * fp32(1/6)) in the reference's FP32 order.

    On CPU the few scalar operations run on numpy float32 scalars (IEEE single precision, the
    same results as float32 tensor ops) instead of a dozen 0-d tensor ops; elsewhere they stay on
    the device so nothing synchronizes.
    """
    if g.device.type == "cpu":
        g32 = np.float32(g.item())
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            multiplier = np.minimum(np.float32(scale_target * _FP4_MAX) / g32, np.float32(_FLT_MAX))
        if (multiplier == 0) if scale_format == "e4m3" else (g32 == 0):
            multiplier = np.float32(1.0)
        tensor_scale = np.float32(1.0) / multiplier
        return torch.tensor(tensor_scale, dtype=torch.float32), float(multiplier * np.float32(1.0 / _FP4_MAX))
    device = g.device
    multiplier = torch.minimum(_constant(scale_target * _FP4_MAX, device) / g, _constant(_FLT_MAX, device))
    if scale_format == "e4m3":  # TE: g = 0 gives FLT_MAX; only g = inf (multiplier 0) -> 1
        multiplier = torch.where(multiplier == 0, 1.0, multiplier)
    else:  # the UE5M3 emulator: g = 0 -> G = 1
        multiplier = torch.where(g == 0, 1.0, multiplier)
    return torch.reciprocal(multiplier), multiplier * _constant(1.0 / _FP4_MAX, device)


@dataclass
class BlockOperand:
    """A block-quantized 2-D operand as the GEMM consumes it.

    ``scaled`` holds E2M1 value x block scale (float32, padded: last dim to the block, and
    rows too for 2-D tiles); every element is exact in float32 and in BF16. The operand's
    value is ``scaled[:rows, :cols] * tensor_scale``.
    """

    scaled: torch.Tensor
    tensor_scale: torch.Tensor
    tensor_amax: torch.Tensor
    shape: tuple[int, int]
    block_size: int
    two_d: bool
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    num_blocks: int = 0
    packed: PackedOperand | None = None
    """Set when the operand was quantized with ``pack=True`` (it is saved for backward)."""

    # The QuantizedBlocks-like surface the GEMMs use.
    def scaled_values(self) -> torch.Tensor:
        return self.scaled

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.shape
        return self.scaled[:rows, :cols] * self.tensor_scale

    def stats(self) -> dict[str, float]:
        """Fractions of blocks whose scale saturated, underflowed (to zero, non-zero block) and
        that are all zero. (Reading them synchronizes with the device.)"""
        return {name: int(count) / self.num_blocks for name, count in self.counts.items()}


@dataclass
class PackedOperand:
    """What backward keeps of an operand: packed FP4 codes (two per byte, even element in the
    low nibble, as the reference packs them), uint8 scale codes and the tensor scale."""

    codes: torch.Tensor
    scale_codes: torch.Tensor
    tensor_scale: torch.Tensor
    tensor_amax: torch.Tensor
    scale_format: str
    shape: tuple[int, int]
    padded_shape: tuple[int, int]
    block_size: int
    two_d: bool

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scale_codes, self.tensor_scale, self.tensor_amax)

    def meta(self) -> dict:
        return {k: getattr(self, k) for k in ("scale_format", "shape", "padded_shape", "block_size", "two_d")}

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...], meta: dict) -> PackedOperand:
        codes, scale_codes, tensor_scale, tensor_amax = tensors
        return cls(codes=codes, scale_codes=scale_codes, tensor_scale=tensor_scale, tensor_amax=tensor_amax, **meta)

    def scaled_values(self) -> torch.Tensor:
        return self.unpack().scaled

    def dequantize(self) -> torch.Tensor:
        return self.unpack().dequantize()

    def unpack(self) -> BlockOperand:
        """Decode to the scaled float32 form (exact)."""
        pairs = torch.index_select(_e2m1_pair_table(self.codes.device), 0, self.codes.reshape(-1).int())
        values = pairs.view(self.padded_shape)
        scales = torch.index_select(_scale_table(self.scale_format, self.codes.device), 0, self.scale_codes.reshape(-1).int())
        b = self.block_size
        rows, cols = self.padded_shape
        if self.two_d:
            values.view(rows // b, b, cols // b, b).mul_(scales.view(rows // b, 1, cols // b, 1))
        else:
            values.view(rows, cols // b, b).mul_(scales.view(rows, cols // b, 1))
        return BlockOperand(
            scaled=values,
            tensor_scale=self.tensor_scale,
            tensor_amax=self.tensor_amax,
            shape=self.shape,
            block_size=b,
            two_d=self.two_d,
        )


# ------------------------------------------------------------------------------------ tables
@functools.lru_cache(maxsize=32)
def _e2m1_pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two E2M1 values packed in each byte (low nibble first)."""
    values = get_format("e2m1").decode(torch.arange(16, dtype=torch.uint8))
    byte = torch.arange(256)
    return torch.stack((values[byte & 15], values[byte >> 4]), dim=-1).to(device)


@functools.lru_cache(maxsize=32)
def _scale_table(scale_format: str, device: torch.device) -> torch.Tensor:
    """float32 value of every scale code (NaN/Inf where the format has them)."""
    fmt = get_format(scale_format)
    return fmt.decode(torch.arange(fmt.num_codes, dtype=torch.uint8)).to(device)


@functools.lru_cache(maxsize=32)
def _binade_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indexed by int(|y|) for |y| in [0, 6], one entry per E2M1 binade [0,2), [2,4), [4,6]:

    * 1/spacing of the grid (2, 1, 1/2);
    * a magic number 1.5 * 2^k whose float32 ulp is the spacing: ``(|y| + M) - M`` is one
      IEEE addition that rounds |y| to the grid, ties to even (|y| <= 6 keeps the sum in M's
      binade);
    * the magnitude code of the binade's grid point 0 in units of the spacing (code = steps + it).
    """
    binade = [0, 0, 1, 1, 2, 2, 2]
    inv = torch.tensor([(2.0, 1.0, 0.5)[i] for i in binade], device=device)
    magic = torch.tensor([(1.5 * 2.0**22, 1.5 * 2.0**23, 1.5 * 2.0**24)[i] for i in binade], device=device)
    offset = torch.tensor([(0.0, 2.0, 4.0)[i] for i in binade], device=device)
    return inv, magic, offset


@functools.lru_cache(maxsize=256)
def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A cached float32 0-d tensor (no host-to-device copy per call)."""
    return torch.tensor(value, dtype=torch.float32, device=device)



@functools.lru_cache(maxsize=32)
def _pow2_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """UE8M0 code c -> 2^(c-127) and its exact reciprocal 2^(127-c), float32 (c = 255 -> NaN)."""
    scale = [math.ldexp(1.0, c - 127) for c in range(255)] + [math.nan]
    recip = [math.ldexp(1.0, 127 - c) for c in range(255)] + [math.nan]
    as32 = lambda v: torch.tensor(v, dtype=torch.float64).float().to(device)  # exact: all in float32 range
    return as32(scale), as32(recip)


# ------------------------------------------------------------------------------------ scales
def _select(mask: torch.Tensor, if_true: torch.Tensor, if_false: torch.Tensor) -> torch.Tensor:
    """``torch.where`` for finite operands as exact arithmetic (a 0/1 mask times each side):
    on CPU, where/masked_fill run an order of magnitude slower than this."""
    m = mask.to(if_true.dtype)
    return if_true * m + if_false * (1 - m)


class ScaleGrid(NamedTuple):
    """What rounding onto a block-scale format and encoding it need, as Python numbers (so a
    compiled caller sees constants)."""

    mantissa_bits: int
    bias: int
    min_normal: float
    min_subnormal: float
    max_finite: float


@functools.lru_cache(maxsize=16)
def scale_grid(scale_format: str) -> ScaleGrid:
    fmt = get_format(scale_format)
    return ScaleGrid(fmt.mantissa_bits, fmt.bias, fmt.min_normal, fmt.min_subnormal, fmt.max_finite)


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
    return _select(v < grid.min_normal, subnormal, normal)


def encode_scales(scale: torch.Tensor, grid: ScaleGrid) -> torch.Tensor:
    """uint8 codes of non-negative float32 values that lie on the scale format's grid."""
    bits = scale.view(torch.int32)
    m = grid.mantissa_bits
    exponent = ((bits >> 23) & 0xFF) - 127 + grid.bias
    normal = (exponent << m) | ((bits >> (23 - m)) & ((1 << m) - 1))
    subnormal = (scale * (1.0 / grid.min_subnormal)).int()
    return _select(scale < grid.min_normal, subnormal, normal).to(torch.uint8)


def _block_amax(magnitude_blocks: torch.Tensor) -> torch.Tensor:
    """max over the last dim (a block): for large tensors a halving tree of maximums, ~2x faster
    on CPU than ``amax(-1)`` over a short last dim (small ones: one op); exact either way."""
    m = magnitude_blocks
    if m.numel() < _TREE_MIN_ELEMENTS:
        return m.amax(-1)
    while m.shape[-1] > 1 and m.shape[-1] % 2 == 0:
        half = m.shape[-1] // 2
        m = torch.maximum(m[..., :half], m[..., half:])
    return m.amax(-1)


# ------------------------------------------------------------------------------------ main
def quantize_operand(
    x: torch.Tensor,
    op: OperandQuant,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    two_d: bool | None = None,
    pack: bool = False,
    stats: bool = True,
) -> BlockOperand:
    """Quantize a 2-D ``x`` along its last dim (or in 2-D tiles) as ``op`` says.

    Equals ``quantize_blocks(x, op.scale_format, op.block_size, two_d, op.scale_target,
    tensor_amax, op.rounding, generator)`` bitwise (``scaled`` == its ``scaled_values()``).
    ``pack`` also produces the packed codes (for operands saved for backward); ``stats``
    the saturation/underflow/zero/clipping counts (on the device, no synchronization).
    Unlike the reference it does not check for NaN/Inf (that would synchronize): a
    non-finite input yields non-finite output values, which the trainer's checks catch.
    """
    assert x.dim() == 2, x.shape
    two_d = op.two_d if two_d is None else two_d
    b = op.block_size
    rows, cols = x.shape
    x32 = x.detach().float().contiguous()
    pad_r = -rows % b if two_d else 0
    pad_c = -cols % b
    if pad_r or pad_c:
        x32 = F.pad(x32, (0, pad_c, 0, pad_r))
    rows_p, cols_p = x32.shape
    magnitude = x32.abs()  # |x| serves the block amaxes and, scaled, the payload magnitudes
    if two_d:
        blocks = magnitude.view(rows_p // b, b, cols_p // b, b)
        block_amax = blocks.amax(dim=(1, 3))  # [row_tiles, col_tiles]
        per_element = lambda t: t[:, None, :, None]
    else:
        blocks = magnitude.view(rows_p, cols_p // b, b)
        block_amax = _block_amax(blocks)  # [rows, n_blocks]
        per_element = lambda t: t[..., None]
    device = x.device
    g = block_amax.amax() if tensor_amax is None else tensor_amax.float().reshape(())

    scale_codes = None
    if op.scale_format == "ue8m0":
        tensor_scale = _constant(1.0, device)
        _, exp = torch.frexp(block_amax)  # amax = mantissa * 2^exp, mantissa in [0.5, 1)
        unclamped = (exp - 1 - _E2M1_EMAX) * (block_amax > 0) - 127 * (block_amax == 0)
        scale_codes = (unclamped.clamp(-127, 127) + 127).to(torch.uint8)
        pow2, pow2_recip = _pow2_tables(device)
        block_scale = torch.index_select(pow2, 0, scale_codes.view(-1).int()).view(block_amax.shape)
        encode = torch.index_select(pow2_recip, 0, scale_codes.view(-1).int()).view(block_amax.shape)
        saturated = lambda: unclamped > 127
        underflow = lambda: (unclamped < -127) & (block_amax > 0)
    else:
        fmt = get_format(op.scale_format)
        tensor_scale, code_multiplier = _global_scales(op.scale_format, g, op.scale_target)
        ideal = (block_amax * code_multiplier).clamp_(max=_FLT_MAX)
        block_scale = round_scale_rne(ideal.clamp(max=fmt.max_finite), scale_grid(op.scale_format))
        saturated = lambda: ideal > fmt.max_finite
        underflow = lambda: (block_scale == 0) & (block_amax > 0)
        if op.scale_format != "e4m3":  # UE5M3: a zero code becomes 1.0 before the reciprocal
            rounded_to_zero = block_scale == 0
            underflow = lambda: rounded_to_zero & (block_amax > 0)
            block_scale = block_scale + rounded_to_zero
        encode = torch.reciprocal(block_scale * tensor_scale).clamp_(max=_FLT_MAX)
        if pack:
            scale_codes = encode_scales(block_scale, scale_grid(op.scale_format))

    # ---- payload: |y| = |x| * enc_b (y has the sign of x), rounded to E2M1, saturating at 6
    magnitude = blocks.mul_(per_element(encode)).view(rows_p, cols_p)
    counts = {}
    if stats:  # block-level counts only: cheap, on the device, read lazily
        masks = torch.stack((saturated(), underflow(), block_amax == 0)).view(3, -1)
        counts = dict(zip(("saturated_blocks", "underflow_blocks", "zero_blocks"), masks.count_nonzero(1)))
    magnitude.clamp_(max=_FP4_MAX)
    inv_table, magic_table, offset_table = _binade_tables(device)
    # int(|y|) in 0..6 picks the binade; the clamp keeps a NaN (int -> INT_MIN) a valid index,
    # and the NaN still reaches the output through its NaN block scale.
    binade = magnitude.int().clamp_(0, 6).view(-1)
    if op.rounding == "rne":
        magic = torch.index_select(magic_table, 0, binade).view(rows_p, cols_p)
        rounded = magnitude.add_(magic).sub_(magic)  # RNE onto the E2M1 grid
        if pack:
            steps = rounded * torch.index_select(inv_table, 0, binade).view(rows_p, cols_p)
    else:
        inv = torch.index_select(inv_table, 0, binade).view(rows_p, cols_p)
        scaled_grid = magnitude.mul_(inv)  # |y| / spacing: exact
        lower = scaled_grid.floor()
        frac = scaled_grid.sub_(lower)  # exact fraction of a grid step
        if op.rounding == "sr8":
            words = sr8_words(rows_p * cols_p, generator, device)  # the reference's draws
            r = sr8_bytes(words, rows_p * cols_p).float().view(rows_p, cols_p)
            # threshold 1 - (2r+1)/512 = (511 - 2r)/512, exact in float32 (multiples of 2^-9 in [0, 1))
            threshold = r.mul_(-2.0 / 512).add_(511.0 / 512)
            away = torch.ge(frac, threshold, out=threshold)  # 1.0 where frac >= 1 - (2r+1)/512
        else:
            u = torch.rand((rows_p, cols_p), generator=generator, device=device, dtype=torch.float64)
            away = torch.lt(u, frac.double(), out=torch.empty_like(frac))
        steps = lower.add_(away)
        rounded = steps / inv
    packed = None
    if pack:
        # E2M1 code = magnitude code + 8 for a set sign bit (also -0.0), packed two per byte.
        offset = torch.index_select(offset_table, 0, binade).view(rows_p, cols_p)
        sign_code = torch.signbit(x32).float().mul_(8.0)  # 0 or 8 (8 for -0.0 too)
        codes = sign_code.add_(steps).add_(offset)
        packed = PackedOperand(
            codes=codes[:, 1::2].mul(16.0).add_(codes[:, 0::2]).to(torch.uint8),
            scale_codes=scale_codes,
            tensor_scale=tensor_scale,
            tensor_amax=g,
            scale_format=op.scale_format,
            shape=(rows, cols),
            padded_shape=(rows_p, cols_p),
            block_size=b,
            two_d=two_d,
        )
    values = torch.copysign(rounded, x32)
    values.view(blocks.shape).mul_(per_element(block_scale))
    return BlockOperand(
        scaled=values,
        tensor_scale=tensor_scale,
        tensor_amax=g,
        shape=(rows, cols),
        block_size=b,
        two_d=two_d,
        counts=counts,
        num_blocks=block_amax.numel(),
        packed=packed,
    )
