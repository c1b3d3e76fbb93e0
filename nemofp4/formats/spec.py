"""What a block quantization is, as data: the scale-format table and the frozen :class:`BlockSpec`.

Every quantizer (the float64-checked reference :func:`nemofp4.formats.quantize_blocks`, the torch
program of :mod:`nemofp4.kernels.program`, eager or compiled, and the Triton kernels) reads the
differences between scale formats from :data:`SCALE_FORMAT_TABLE` instead of branching on their
names, and checks its arguments with the one checker here (:meth:`BlockSpec.check_input` and the
spec's own validation), so a new scale format is one row of the table.

=============  =======  =============  ==================  ==============  ===========
scale format   block    power of two   zero code -> 1.0     dequantize      GEMM alpha
=============  =======  =============  ==================  ==============  ===========
``e4m3``       16       no             no (TE: code 0)     TE's order      TE's
``ue5m3``      16       no             yes (the paper)     the paper's     the paper's
``ue5m3_cuda`` 16       no             yes                 the paper's     the paper's
``ue8m0``      32       yes (OCP MX)   n/a                 the paper's     ts_a * ts_b
``fp32``       none     no             n/a                 the paper's     ts_a * ts_b
=============  =======  =============  ==================  ==============  ===========

``fp32`` is per-tensor scaling (Transformer Engine's ``Float8CurrentScaling``): one float32 scale
for the whole tensor and no block scales; its ``block_size`` is only the granule the operand is
padded to (16, the alignment cuBLAS's FP8 GEMMs need). The element (payload) format is the
spec's ``element_format``: ``e2m1`` (FP4, with block-scale formats) or ``e4m3`` / ``e5m2`` (FP8, with
``fp32`` or ``ue8m0`` scales: the table's ``elements`` column).

The columns, as :class:`ScaleFormat` fields: ``per_tensor`` (no block scales: the ``fp32`` row),
``power_of_two`` (OCP MX: block scales 2^e, no tensor
scale, so no tensor reference), ``zero_code_to_one`` (the UE5M3 emulator replaces a zero block-scale
code by 1.0 before the reciprocal, and maps a zero tensor reference to G = 1; TE keeps code 0 and
only replaces G = 0 by 1: :func:`nemofp4.formats.scaling.global_scales`), ``dequantize`` and
``alpha`` (the source whose order of FP32 operations the decoded tensor and the GEMM's
tensor-scale product follow: :meth:`nemofp4.formats.QuantizedBlocks.dequantize`,
:func:`nemofp4.formats.scaling.gemm_alpha`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .minifloat import E2M1, E4M3, E5M2, ROUNDING_MODES, UE5M3, UE5M3_CUDA, UE8M0, FloatFormat

__all__ = [
    "BLOCK_STATS",
    "DEFAULT_SCALE_TARGET",
    "ELEMENT_FORMATS",
    "INPUT_DTYPES",
    "MX_SCALE_MODES",
    "ROUNDING_MODES",
    "SCALE_FORMATS",
    "SCALE_FORMAT_TABLE",
    "STAT_NAMES",
    "BlockSpec",
    "ScaleFormat",
]

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes a quantizer takes (they upcast to float32 exactly)."""
MX_SCALE_MODES = ("floor", "ceil")
"""UE8M0 block exponents: OCP's reference (floor) or TE's pow-2 mode (ceil, never saturates)."""
DEFAULT_SCALE_TARGET = 448.0
"""T, the block code a block whose amax equals the tensor reference maps to (TE's fixed 448)."""
BLOCK_STATS = ("saturated_blocks", "underflow_blocks", "zero_blocks")
"""The block counts every quantizer keeps (on the device)."""
STAT_NAMES = (*BLOCK_STATS, "clipped_elements")
"""The counts the reference and the Triton kernels keep (the torch program keeps the block counts)."""
ELEMENT_FORMATS: dict[str, FloatFormat] = {fmt.name: fmt for fmt in (E2M1, E4M3, E5M2)}
"""The payload formats: FP4 E2M1 (two codes a byte) and FP8 E4M3 / E5M2 (one code a byte)."""


@dataclass(frozen=True)
class ScaleFormat:
    """One row of the scale-format table: how a block-scale format differs from the others."""

    name: str
    codes: FloatFormat | None
    """The block-scale code format (E4M3, UE5M3, UE8M0); None for per-tensor scaling (no block scales)."""
    default_block_size: int
    power_of_two: bool
    """OCP MX: power-of-two block scales and no tensor scale (no tensor reference)."""
    zero_code_to_one: bool
    """UE5M3 (the paper's emulator): a zero block-scale code becomes 1.0 before the reciprocal, and a
    zero tensor reference gives G = 1. TE (E4M3): code 0 stays, and only G = 0 becomes 1."""
    dequantize: str
    """'te': TE's ``dequantize_fp4_kernel`` order, ``payload * ((scale * amax) * fl(1 / (6 T)))``;
    'paper': ``(payload * scale) * tensor_scale`` (the UE5M3 paper's decoded output)."""
    alpha: str | None
    """The GEMM's tensor-scale product between two operands of the same family: 'te' or 'paper'
    (from the two amaxes, in that source's order); None: ``tensor_scale_a * tensor_scale_b``."""
    per_tensor: bool = False
    """One float32 scale for the tensor and no block scales (``block_size`` is the padding granule)."""
    elements: tuple[str, ...] = ("e2m1",)
    """The element (payload) formats it scales: E2M1 for the FP4 block scales; FP8 for UE8M0 and fp32."""

    @property
    def has_tensor_scale(self) -> bool:
        return not self.power_of_two


SCALE_FORMAT_TABLE: dict[str, ScaleFormat] = {
    row.name: row
    for row in (
        ScaleFormat(
            name="e4m3",
            codes=E4M3,
            default_block_size=16,
            power_of_two=False,
            zero_code_to_one=False,
            dequantize="te",
            alpha="te",
        ),
        ScaleFormat(
            name="ue5m3",
            codes=UE5M3,
            default_block_size=16,
            power_of_two=False,
            zero_code_to_one=True,
            dequantize="paper",
            alpha="paper",
        ),
        ScaleFormat(
            name="ue5m3_cuda",
            codes=UE5M3_CUDA,
            default_block_size=16,
            power_of_two=False,
            zero_code_to_one=True,
            dequantize="paper",
            alpha="paper",
        ),
        ScaleFormat(
            name="ue8m0",
            codes=UE8M0,
            default_block_size=32,
            power_of_two=True,
            zero_code_to_one=False,
            dequantize="paper",
            alpha=None,
            elements=("e2m1", "e4m3", "e5m2"),
        ),
        ScaleFormat(
            name="fp32",
            codes=None,
            default_block_size=16,
            power_of_two=False,
            zero_code_to_one=False,
            dequantize="paper",
            alpha=None,
            per_tensor=True,
            elements=("e4m3", "e5m2"),
        ),
    )
}
SCALE_FORMATS: dict[str, FloatFormat] = {
    name: row.codes for name, row in SCALE_FORMAT_TABLE.items() if row.codes is not None
}
"""Block-scale format name -> its block-scale code format (``nemofp4.formats.SCALE_FORMATS``)."""


@dataclass(frozen=True, kw_only=True)
class BlockSpec:
    """The static part of one FP4 block quantization: what every quantizer is typed against.

    Frozen and hashable (kernels key compiled programs on it). ``block_size=None`` means the scale
    format's default (16, or 32 for UE8M0). :class:`nemofp4.quant.OperandQuant` is a BlockSpec with
    the training-side fields (element format, reference interval) added.
    """

    scale_format: str
    """'e4m3' (NVFP4), 'ue5m3' (paper, max 61,440), 'ue5m3_cuda' (CUDA encoding, max 114,688) or
    'ue8m0' (OCP MX power-of-two scales, no tensor scale)."""
    block_size: int | None = None
    """Elements per block along the last dim (tile side in 2-D mode); None: the format's default."""
    two_d: bool = False
    """``block_size`` x ``block_size`` tiles over a 2-D tensor (weights), so W and W^T quantize alike."""
    rounding: str = "rne"
    """Payload rounding: 'rne', 'sr' (TE's cvt.rs), 'sr8' (the paper's) or 'sr_exact'; scale codes
    always use RNE (see :mod:`nemofp4.formats.minifloat`)."""
    scale_target: float = DEFAULT_SCALE_TARGET
    """T: the block code a block whose amax equals the tensor reference is mapped to."""
    hadamard: bool = False
    """The 16x16 wgrad Hadamard transform along the blocks' dim before quantizing (wgrad operands)."""
    mx_scale_mode: str = "floor"
    """UE8M0 only: 'floor' (OCP reference) or 'ceil' (TE's pow-2 mode, never saturates)."""
    element_format: str = "e2m1"
    """The payload format: 'e2m1' (FP4), or 'e4m3' / 'e5m2' (FP8, with 'fp32' or 'ue8m0' scales)."""
    power_of_two_scale: bool = False
    """'fp32' only: the per-tensor scale's mantissa cleared (TE's ``force_pow_2_scales``)."""

    def __post_init__(self) -> None:
        if self.block_size is None and self.scale_format in SCALE_FORMAT_TABLE:
            object.__setattr__(self, "block_size", SCALE_FORMAT_TABLE[self.scale_format].default_block_size)
        errors = self._errors()
        if errors:
            raise ValueError(f"invalid {type(self).__name__}: " + "; ".join(errors))

    def _errors(self) -> list[str]:
        errors = []
        if self.scale_format not in SCALE_FORMAT_TABLE:
            errors.append(f"unknown scale_format {self.scale_format!r}; valid: {', '.join(SCALE_FORMAT_TABLE)}")
        if self.rounding not in ROUNDING_MODES:
            errors.append(f"unknown rounding {self.rounding!r}; valid: {', '.join(ROUNDING_MODES)}")
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 2 or b % 2:
            errors.append(f"block_size must be an even integer >= 2, got {b!r}")
        elif self.hadamard and b % 16:
            errors.append(f"block_size={b} with hadamard=True (must be a multiple of 16)")
        target = self.scale_target
        if (
            isinstance(target, bool)
            or not isinstance(target, (int, float))
            or not (math.isfinite(target) and target > 0)
        ):
            errors.append(f"scale_target must be a finite positive number, got {target!r}")
        if self.mx_scale_mode not in MX_SCALE_MODES:
            errors.append(f"unknown mx_scale_mode {self.mx_scale_mode!r}; valid: {', '.join(MX_SCALE_MODES)}")
        errors += self._element_errors()
        return errors

    def _element_errors(self) -> list[str]:
        element = self.element_format
        if element not in ELEMENT_FORMATS:
            return [f"unknown element_format {element!r}; valid: {', '.join(ELEMENT_FORMATS)}"]
        errors = []
        row = SCALE_FORMAT_TABLE.get(self.scale_format)
        if row is not None and element not in row.elements:
            valid = [name for name, r in SCALE_FORMAT_TABLE.items() if element in r.elements]
            errors.append(
                f"element_format={element!r} takes scale_format {' or '.join(map(repr, valid))}, "
                f"not {self.scale_format!r}"
            )
        if self.power_of_two_scale and self.scale_format != "fp32":
            errors.append("power_of_two_scale=True is for per-tensor scaling (scale_format='fp32')")
        if element != "e2m1":  # FP8 as Transformer Engine runs it: RNE, 1-D blocks, no transform
            for name, value, allowed in (
                ("rounding", self.rounding, "rne"),
                ("two_d", self.two_d, False),
                ("hadamard", self.hadamard, False),
            ):
                if value != allowed:
                    errors.append(f"element_format={element!r} takes {name}={allowed!r}, not {value!r}")
        return errors

    @property
    def format(self) -> ScaleFormat:
        """The scale format's table row."""
        return SCALE_FORMAT_TABLE[self.scale_format]

    @property
    def uses_tensor_reference(self) -> bool:
        """UE8M0 (MX) scales are absolute powers of two: no tensor reference is involved."""
        return self.format.has_tensor_scale

    @property
    def element(self) -> FloatFormat:
        """The payload format (E2M1, E4M3 or E5M2)."""
        return ELEMENT_FORMATS[self.element_format]

    @property
    def is_fp8(self) -> bool:
        return self.element_format != "e2m1"

    def blocks_like(self, other: BlockSpec) -> bool:
        """Same formats, block size and rounding: two quantizations one launch can share."""
        fields = ("scale_format", "element_format", "block_size", "rounding")
        return all(getattr(self, name) == getattr(other, name) for name in fields)

    def check_input(self, x, tensor_amax=None, *, name: str = "x", warn: bool = True, stacklevel: int = 3) -> None:
        """The one argument check of a quantizer: ``x`` a non-empty float32/bfloat16/float16 tensor
        (2-D for tiles), ``tensor_amax`` None, a number or a one-element tensor (a number finite and
        >= 0), and a warning for a setting the scale format ignores. Costs no device synchronization."""
        if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
            got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name!r} must be a float32/bfloat16/float16 tensor, got {got}")
        if x.dim() == 0 or x.numel() == 0:
            raise ValueError(f"{name!r} has shape {tuple(x.shape)}; need >= 1 dim and >= 1 element")
        if self.two_d and x.dim() != 2:
            raise ValueError(f"two_d=True needs a 2-D tensor; {name!r} has shape {tuple(x.shape)}")
        if isinstance(tensor_amax, torch.Tensor):
            if tensor_amax.numel() != 1:
                raise ValueError(f"tensor_amax must have one element, got shape {tuple(tensor_amax.shape)}")
        elif tensor_amax is not None:
            if isinstance(tensor_amax, bool) or not isinstance(tensor_amax, (int, float)):
                raise ValueError(f"tensor_amax must be None, a number or a tensor, got {type(tensor_amax).__name__}")
            if not (math.isfinite(tensor_amax) and tensor_amax >= 0):
                raise ValueError(f"tensor_amax must be finite and >= 0, got {tensor_amax}")
        if not warn:
            return
        if self.format.power_of_two:
            if self.scale_target != DEFAULT_SCALE_TARGET:
                warnings.warn(
                    f"scale_target has no effect with scale_format={self.scale_format!r} (no tensor scale)",
                    stacklevel=stacklevel,
                )
            if tensor_amax is not None:
                warnings.warn(
                    f"tensor_amax has no effect with scale_format={self.scale_format!r} (no tensor scale)",
                    stacklevel=stacklevel,
                )
        else:
            if self.mx_scale_mode != "floor":
                warnings.warn(
                    f"mx_scale_mode has no effect with scale_format={self.scale_format!r}", stacklevel=stacklevel
                )
            if self.format.per_tensor and self.scale_target != DEFAULT_SCALE_TARGET:
                warnings.warn(
                    "scale_target has no effect with scale_format='fp32' (the amax maps to the element "
                    "format's largest value)",
                    stacklevel=stacklevel,
                )
