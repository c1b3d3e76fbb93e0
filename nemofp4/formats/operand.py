"""The one block-quantized tensor type: what the reference, the torch program (eager or
compiled) and the Triton kernels return, what backward saves and what every GEMM consumes.

A :class:`QuantizedBlocks` carries the layout (shape, padding, block size, 1-D blocks or 2-D
tiles, element and scale formats), the FP32 tensor scale and amax, and one or both forms of the data:

* packed: E2M1 codes two per byte (even element in the low nibble), or FP8 codes one per byte, and
  uint8 block-scale codes (none for per-tensor scaling): 4.5 bits per element for NVFP4, 8.25 for
  MXFP8, 8 for per-tensor FP8; the form saved for backward and read by the hardware GEMM model;
* scaled: ``value x block scale`` as float32 (exact, and exact in BF16 too), the form a
  scaled GEMM multiplies directly.

``scaled_values()`` decodes the packed form when the scaled one is absent, exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from .minifloat import E2M1
from .scaling import gemm_alpha, nvfp4_dequantize_scale
from .spec import DEFAULT_SCALE_TARGET, ELEMENT_FORMATS, SCALE_FORMAT_TABLE, SCALE_FORMATS

__all__ = ["QuantizedBlocks", "e2m1_pair_table", "scale_code_table", "tensor_scale_product"]

_META_FIELDS = ("scale_format", "element_format", "shape", "padded_shape", "block_size", "two_d", "scale_target")


@functools.lru_cache(maxsize=32)
def e2m1_pair_table(device: torch.device) -> torch.Tensor:
    """[256] int64: the two float32 E2M1 values packed in each byte (low nibble first), as one 8-byte
    word per byte, so decoding packed codes is a 1-D gather of one word per byte rather than an
    ``index_select`` of [256, 2] float32 rows (the same bytes; ``.view(torch.float32)`` reads the
    pairs)."""
    values = E2M1.code_values()
    byte = torch.arange(256)
    return torch.stack((values[byte & 15], values[byte >> 4]), dim=-1).view(torch.int64).view(-1).to(device)


@functools.lru_cache(maxsize=32)
def element_code_table(element_format: str, device: torch.device) -> torch.Tensor:
    """[256] float32: the value of every code of an FP8 payload format (NaN/Inf where it has them)."""
    return ELEMENT_FORMATS[element_format].code_values(device)


@functools.lru_cache(maxsize=32)
def scale_code_table(scale_format: str, device: torch.device) -> torch.Tensor:
    """float32 value of every scale code (NaN/Inf where the format has them)."""
    return SCALE_FORMATS[scale_format].code_values(device)


@dataclass(kw_only=True)
class QuantizedBlocks:
    """An FP4 block-quantized tensor (see the module docstring).

    dequantize() follows each format's source: NVFP4 (e4m3) as TE's dequantize kernel, the others
    as ``scaled_values()[unpad] * tensor_scale`` (the UE5M3 paper's decoded output; exact first
    product, one rounding).
    """

    shape: tuple[int, ...]
    padded_shape: tuple[int, ...]
    """``shape`` with the last dim (and the rows, for 2-D tiles) zero-padded to the block."""
    block_size: int
    two_d: bool
    """``block_size`` x ``block_size`` tiles over a 2-D tensor instead of blocks along the last dim."""
    scale_format: str
    tensor_scale: torch.Tensor
    """float32 0-d decode multiplier applied after the block scales (1/G; 1.0 for ue8m0; FP8
    per-tensor scaling: TE's ``scale_inv``)."""
    tensor_amax: torch.Tensor
    """float32 0-d reference g that was used (given or measured)."""
    scale_target: float = DEFAULT_SCALE_TARGET
    """T, the block-scale code the reference g maps to (the GEMM's tensor-scale product needs it)."""
    element_format: str = "e2m1"
    """The payload format: 'e2m1' (FP4) or 'e4m3' / 'e5m2' (FP8)."""
    codes: torch.Tensor | None = None
    """uint8 [*padded_shape[:-1], padded_shape[-1] // 2], two E2M1 codes per byte, even element low;
    FP8: uint8 ``padded_shape``, one code per element."""
    scale_codes: torch.Tensor | None = None
    """uint8 [*shape[:-1], n_blocks] (1-D blocks) or [row_tiles, col_tiles] (2-D tiles); empty for
    per-tensor scaling."""
    scaled: torch.Tensor | None = None
    """float32 payload value x block scale, ``padded_shape``."""
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    """Device counts: saturated / underflowed (non-zero) / all-zero blocks, and, from the
    reference and the Triton kernels, clipped elements."""
    num_blocks: int = 0
    num_elements: int = 0

    # ----------------------------------------------------------------- the two forms
    @property
    def packed(self) -> QuantizedBlocks | None:
        """The packed form alone (what backward saves), or None when there are no codes."""
        if self.codes is None:
            return None
        return dataclasses.replace(self, scaled=None) if self.scaled is not None else self

    def unpack(self) -> QuantizedBlocks:
        """This tensor with the scaled form decoded (exact)."""
        return self if self.scaled is not None else dataclasses.replace(self, scaled=self.scaled_values())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The packed form's tensors, for ``ctx.save_for_backward``."""
        return (self.codes, self.scale_codes, self.tensor_scale, self.tensor_amax)

    def meta(self) -> dict:
        return {k: getattr(self, k) for k in _META_FIELDS}

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...], meta: dict) -> QuantizedBlocks:
        codes, scale_codes, tensor_scale, tensor_amax = tensors
        return cls(codes=codes, scale_codes=scale_codes, tensor_scale=tensor_scale, tensor_amax=tensor_amax, **meta)

    # ----------------------------------------------------------------- values
    @property
    def per_tensor(self) -> bool:
        """One scale for the tensor, no block scales (FP8 current scaling)."""
        return SCALE_FORMAT_TABLE[self.scale_format].per_tensor

    def values(self) -> torch.Tensor:
        """Decoded payloads, float32, padded shape (needs the packed form)."""
        if self.element_format != "e2m1":
            table = element_code_table(self.element_format, self.codes.device)
            return torch.index_select(table, 0, self.codes.reshape(-1).int()).view(self.padded_shape)
        # One gather of both nibbles per byte, with int32 indices (cheaper than int64 on CPU).
        pairs = torch.index_select(e2m1_pair_table(self.codes.device), 0, self.codes.reshape(-1).int())
        return pairs.view(torch.float32).view(self.padded_shape)

    def block_scales(self) -> torch.Tensor:
        """Decoded block-scale codes, float32, same shape as ``scale_codes``."""
        return self._per_scale_code(scale_code_table(self.scale_format, self.scale_codes.device))

    def _per_scale_code(self, table: torch.Tensor) -> torch.Tensor:
        """``table[scale_codes]``: a per-block value that depends on the block's scale code only,
        computed once per code (256 entries) instead of once per block."""
        return torch.index_select(table, 0, self.scale_codes.reshape(-1).int()).view(self.scale_codes.shape)

    def scaled_values(self) -> torch.Tensor:
        """values * broadcast block scale, padded shape, without the tensor scale (exact)."""
        if self.scaled is not None:
            return self.scaled
        values = self.values()
        if self.per_tensor:
            return values
        scales = self.block_scales()
        b = self.block_size
        if self.two_d:
            rows, cols = self.padded_shape
            values.view(rows // b, b, cols // b, b).mul_(scales[:, None, :, None])
        else:
            values.view(*self.padded_shape[:-1], -1, b).mul_(scales[..., None])
        return values

    def dequantize(self) -> torch.Tensor:
        """float32 tensor of the original shape. NVFP4 (e4m3): TE's ``dequantize_fp4_kernel``,
        ``fl(value * fl(fl(block_scale * amax) * fl(1 / (6 T))))`` per element; other formats:
        ``scaled_values()[unpad] * tensor_scale``."""
        if SCALE_FORMAT_TABLE[self.scale_format].dequantize == "te":
            full = self._nvfp4_dequantize()
        else:
            full = self.scaled_values() * self.tensor_scale
        if self.two_d:
            return full[: self.shape[0], : self.shape[1]]
        return full[..., : self.shape[-1]]

    def _nvfp4_dequantize(self) -> torch.Tensor:
        if self.scale_codes is None:
            raise ValueError("dequantizing an NVFP4 tensor needs its block-scale codes")
        scales = scale_code_table(self.scale_format, self.scale_codes.device)  # per code
        factor = self._per_scale_code(nvfp4_dequantize_scale(scales, self.tensor_amax, self.scale_target))
        down_columns = False
        if self.codes is not None:
            values = self.values()
        else:  # E2M1 value = (value x scale) / scale, exact; a zero scale only scales zeros
            values = self.scaled_values()
            # the wgrad operands' scaled form is a transposed view: divide in its memory order (a
            # reshape of the view would copy it first)
            down_columns = not self.two_d and _column_major(values)
            values = values.t() if down_columns else values
        blocks = self._blocks_down_columns if down_columns else self._blocks
        values = blocks(values)
        if self.codes is None:
            values = values / blocks(self._per_scale_code(torch.where(scales > 0, scales, 1.0)), per_block=True)
        # in place: ``values`` is a fresh tensor either way (one allocation fewer; on CPU a fresh
        # tensor's first touch of its pages costs as much as the arithmetic)
        values = values.mul_(blocks(factor, per_block=True))
        return values.view(self.padded_shape[::-1]).t() if down_columns else values.view(self.padded_shape)

    def _blocks(self, t: torch.Tensor, *, per_block: bool = False) -> torch.Tensor:
        """The padded elements (``per_block=False``) shaped so that a per-block tensor
        (``per_block=True``) broadcasts against them."""
        b = self.block_size
        if per_block:
            return t[:, None, :, None] if self.two_d else t[..., None]
        if self.two_d:
            rows, cols = self.padded_shape
            return t.reshape(rows // b, b, cols // b, b)
        return t.reshape(*self.padded_shape[:-1], -1, b)

    def _blocks_down_columns(self, t: torch.Tensor, *, per_block: bool = False) -> torch.Tensor:
        """:meth:`_blocks` for the transpose ``t`` [cols, rows] of a 1-D-blocked 2-D operand,
        a block being ``block_size`` consecutive rows of one column (no copy of ``t``; a per-block
        tensor is transposed into a copy, a sixteenth of the size: a strided one would make the
        elementwise loop run across ``t``'s rows)."""
        if per_block:
            return t.t().contiguous()[:, None, :]
        return t.view(-1, self.block_size, t.shape[1])

    def stats(self) -> dict[str, float]:
        """Fractions: saturated / underflowed (non-zero) / all-zero blocks, clipped elements (where
        counted). Reading them synchronizes with the device."""
        return {
            name: int(count) / (self.num_elements if name == "clipped_elements" else self.num_blocks)
            for name, count in self.counts.items()
        }

    def without_data(self) -> QuantizedBlocks:
        """Layout, scales and counts only (what statistics keep after the data is gone)."""
        return dataclasses.replace(self, codes=None, scale_codes=None, scaled=None)


def _column_major(t: torch.Tensor) -> bool:
    """A 2-D transposed view of a contiguous tensor (not itself contiguous)."""
    return t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()


def tensor_scale_product(a: QuantizedBlocks, b: QuantizedBlocks) -> torch.Tensor:
    """The factor the product of two block-scaled operands is multiplied by (see
    :func:`nemofp4.formats.scaling.gemm_alpha`): TE's for NVFP4, the paper's for UE5M3."""
    return gemm_alpha(
        a.scale_format,
        a.tensor_amax,
        a.scale_target,
        a.tensor_scale,
        b.scale_format,
        b.tensor_amax,
        b.scale_target,
        b.tensor_scale,
    )
