"""The block-quantized GEMM operand: what every fast quantizer (the torch program, eager or
compiled, and the Triton kernels) returns and every GEMM consumes.

:class:`BlockOperand` holds ``E2M1 value x block scale`` as float32 (exact in BF16 too), the
form a scaled GEMM multiplies; :class:`PackedOperand` holds the same operand as packed FP4
codes and uint8 scale codes (4.5 bits per element), the form saved for backward and read by
the hardware GEMM model. ``unpack()`` turns the second into the first, exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .minifloat import E2M1, get_format

__all__ = ["BlockOperand", "PackedOperand", "e2m1_pair_table", "scale_code_table"]


@functools.lru_cache(maxsize=32)
def e2m1_pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two E2M1 values packed in each byte (low nibble first)."""
    values = E2M1.decode(torch.arange(16, dtype=torch.uint8))
    byte = torch.arange(256)
    return torch.stack((values[byte & 15], values[byte >> 4]), dim=-1).to(device)


@functools.lru_cache(maxsize=32)
def scale_code_table(scale_format: str, device: torch.device) -> torch.Tensor:
    """float32 value of every scale code (NaN/Inf where the format has them)."""
    fmt = get_format(scale_format)
    return fmt.decode(torch.arange(fmt.num_codes, dtype=torch.uint8)).to(device)


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
        return cls(
            codes=codes, scale_codes=scale_codes, tensor_scale=tensor_scale, tensor_amax=tensor_amax, **meta
        )

    def scaled_values(self) -> torch.Tensor:
        return self.unpack().scaled

    def dequantize(self) -> torch.Tensor:
        return self.unpack().dequantize()

    def unpack(self) -> BlockOperand:
        """Decode to the scaled float32 form (exact)."""
        pairs = torch.index_select(e2m1_pair_table(self.codes.device), 0, self.codes.reshape(-1).int())
        values = pairs.view(self.padded_shape)
        table = scale_code_table(self.scale_format, self.codes.device)
        scales = torch.index_select(table, 0, self.scale_codes.reshape(-1).int())
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
