"""What a quantizer call is asked for, and the facts every implementation of it shares.

An :class:`OperandRequest` names one operand a GEMM needs: the tensor, its
:class:`~nemofp4.formats.BlockSpec`, its layout (``rows``: blocks along the last dim, or tiles;
``tokens``: the wgrad operand X^T or dY^T of a token-major tensor, its padded transpose quantized
along the tokens), and which forms come back (the scaled values, the packed codes). Every backend
has one method for them, ``Backend.quantize(*requests, generator=None, stats=True)``, which
quantizes the requests as one call (one compiled graph, or one fused launch for an X / X^T pair),
drawing the random bits of stochastic rounding request after request.

A request becomes a :class:`CoreOperand` (its padded input viewed as blocks, and the
:class:`CoreSpec` of the core that quantizes it) in :mod:`nemofp4.kernels.program`; a
:class:`CoreRunner` runs the cores of a call: the program eagerly, the program compiled, or the
native kernel for the operands it covers and another runner for the rest
(:class:`nemofp4.kernels.native.NativeCores`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from nemofp4.formats.spec import SCALE_FORMAT_TABLE, BlockSpec

__all__ = [
    "LAYOUTS",
    "TOKEN_MULTIPLE",
    "CoreOperand",
    "CoreRunner",
    "CoreSpec",
    "OperandRequest",
    "check_values",
    "tokens_transposed",
]

TOKEN_MULTIPLE = 16
"""The tokens of a wgrad operand are zero-padded to this multiple (one Hadamard group)."""
LAYOUTS = ("rows", "tokens")


def check_values(pack: bool, values: bool) -> bool:
    """``values``, refused without ``pack`` (every backend's check): the result would hold neither form."""
    if not (values or pack):
        raise ValueError("values=False keeps only the packed form: it needs pack=True")
    return values


def tokens_transposed(x_TD: torch.Tensor) -> torch.Tensor:
    """[D, Tp]: the wgrad operand's layout, ``x_TD`` transposed with its tokens zero-padded to 16 (a
    view when no padding is needed): what a ``tokens`` request quantizes without building it."""
    pad = -x_TD.shape[0] % TOKEN_MULTIPLE
    return (F.pad(x_TD, (0, 0, 0, pad)) if pad else x_TD).t()


@dataclass(frozen=True, eq=False)
class OperandRequest:
    """One operand to quantize. ``layout='rows'``: ``tensor`` [rows, cols] in blocks along its last dim
    (or in 2-D tiles: ``two_d``, None taking the spec's); ``layout='tokens'``: the wgrad operand of a
    token-major ``tensor`` [T, D], its transpose [D, Tp] (tokens zero-padded to 16) quantized along the
    tokens after ``spec.hadamard``'s transform, read in the tensor's own layout (the transpose and the
    transform are never materialized). ``pack`` adds the packed codes; ``values=False`` keeps them
    alone (for an operand only saved for backward). ``tensor_amax``: the tensor reference, None
    measures it (for ``tokens`` with a Hadamard transform: the transformed tensor's)."""

    tensor: torch.Tensor
    spec: BlockSpec
    layout: str = "rows"
    pack: bool = False
    values: bool = True
    two_d: bool | None = None
    tensor_amax: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; valid: {', '.join(LAYOUTS)}")
        check_values(self.pack, self.values)

    @property
    def tiles(self) -> bool:
        """Quantized in 2-D tiles (never for ``tokens``)."""
        return self.layout == "rows" and (self.spec.two_d if self.two_d is None else self.two_d)


@dataclass(frozen=True)
class CoreSpec:
    """The static part of one quantization: one compiled graph per distinct tuple of them.

    The statistics counts are always computed (three block-level reductions, cheap): a run that
    collects them only on logging steps then never compiles a second graph variant for them."""

    scale_format: str
    block_size: int
    two_d: bool
    rounding: str
    pack: bool
    measure: bool
    """Current scaling: the tensor reference is max |x|, reduced from the block amaxes inside
    the program (one pass over ``x`` fewer than a separate amax)."""
    columns: bool = False
    """Blocks run down the columns (dim 0) of the input: the wgrad operand X^T or dY^T read from
    the token-major X or dY, so the transpose is never materialized."""
    hadamard: bool = False
    """The wgrad Hadamard transform along the blocks' dim first (with ``columns``), in the same loop."""
    values: bool = True
    """The scaled values are an output. An operand only saved for backward (X^T) needs its packed
    form alone: its values would be a float32 buffer written, faulted in and thrown away."""
    element: str = "e2m1"
    """The payload format: 'e2m1' (the FP4 core) or an FP8 format (the FP8 core)."""
    mx_scale_mode: str = "floor"
    power_of_two_scale: bool = False
    power_of_two: bool = field(init=False)
    """The scale format's columns of the table (plain bools: the compiled core reads constants)."""
    zero_code_to_one: bool = field(init=False)
    per_tensor: bool = field(init=False)

    def __post_init__(self) -> None:
        row = SCALE_FORMAT_TABLE[self.scale_format]
        object.__setattr__(self, "power_of_two", row.power_of_two)
        object.__setattr__(self, "zero_code_to_one", row.zero_code_to_one)
        object.__setattr__(self, "per_tensor", row.per_tensor)

    @property
    def is_fp8(self) -> bool:
        return self.element != "e2m1"

    def describe(self) -> str:
        blocks = f"{self.block_size}x{self.block_size} tiles" if self.two_d else f"blocks of {self.block_size}"
        if self.per_tensor:
            blocks = "per tensor"
        layout = (
            ", down the columns" + (" after the Hadamard transform" if self.hadamard else "") if self.columns else ""
        )
        formats = f"{self.element}/{self.scale_format}" if self.is_fp8 else self.scale_format
        return f"{formats} {blocks}, {self.rounding}{layout}"

    @classmethod
    def of(
        cls, op: BlockSpec, pack: bool, measure: bool, values: bool, *, two_d: bool = False, columns: bool = False
    ) -> CoreSpec:
        """The spec of quantizing with ``op`` in the given layout. The FP4 core has OCP's floor exponent
        only: an E2M1 UE8M0 spec in 'ceil' mode is the reference's and the Triton kernels', refused here
        rather than floored."""
        if not op.is_fp8 and op.format.power_of_two and op.mx_scale_mode != "floor":
            raise ValueError(
                f"mx_scale_mode={op.mx_scale_mode!r} with E2M1 payloads: the torch program quantizes "
                "FP4 MX blocks with OCP's floor rule only (nemofp4.formats.quantize_blocks and the "
                "Triton kernels have 'ceil')"
            )
        return cls(
            op.scale_format,
            op.block_size,
            two_d,
            op.rounding,
            pack,
            measure=measure,
            columns=columns,
            hadamard=op.hadamard and columns,
            values=check_values(pack, values),
            element=op.element_format,
            mx_scale_mode=op.mx_scale_mode,
            power_of_two_scale=op.power_of_two_scale,
        )


@dataclass(frozen=True)
class CoreOperand:
    """One operand ready for the core: its padded input viewed as blocks, and its result's shapes."""

    op: BlockSpec
    spec: CoreSpec
    blocks: torch.Tensor
    """[R, 1, C/b, b] (1-D blocks), [R/b, b, C/b, b] (2-D tiles) or [Tp/b, b, D, 1] (``spec.columns``)."""
    shape: tuple[int, int]
    """The result's shape (for a wgrad operand: [D, tokens padded to 16])."""
    padded_shape: tuple[int, int]
    """The operand padded to whole blocks ([D, Tp] for a wgrad operand): the element order of its draws."""
    tensor_amax: torch.Tensor | None
    """Its tensor reference (None: measured in the core)."""


class CoreRunner(Protocol):
    """Runs the cores of one call: ``args[i]`` is operand ``i``'s (blocks, g, target, draws), its random
    bits already drawn; returns each operand's core outputs (values, tensor_scale, g, packed codes,
    scale codes, counts), in order."""

    def run(self, operands: tuple[CoreOperand, ...], args: list[tuple]) -> list[tuple]: ...
