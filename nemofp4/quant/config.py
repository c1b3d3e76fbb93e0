"""How one FP4 linear quantizes each operand of its three GEMMs.

A linear layer runs three GEMMs, and each has two operands that are quantized along that
GEMM's reduction dimension:

=========  ===================  =====================================  ==================
GEMM       product              operand (role)                          blocks run along
=========  ===================  =====================================  ==================
fprop      Y  = X  . W^T        X (``x``), W (``w``)                   in-features
dgrad      dX = dY . W          dY (``dy_dgrad``), W^T (``w``)         out-features
wgrad      dW = dY^T . X        dY^T (``dy_wgrad``), X^T (``x_wgrad``)  tokens
=========  ===================  =====================================  ==================

W appears in fprop and dgrad with one :class:`OperandQuant` (``w``): with 16x16 tiles
(``two_d=True``) the dgrad operand is the fprop one transposed, which is exactly the 2-D
quantization of W^T; with 1-D blocks W^T is quantized afresh from the high-precision weight.

Each quantization divides by a tensor reference (an amax). References belong to *tensors*,
not to roles: X, W and dY each have one, and a Hadamard-transformed wgrad operand (whose amax
differs) has its own (``x_rht``, ``dy_rht``). So the two dY quantizations of the UE5M3 recipe
share one held reference, as in the paper. Roles that share a reference must agree on its
refresh interval.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from nemofp4.formats import ROUNDING_MODES, SCALE_FORMAT_TABLE, BlockSpec
from nemofp4.formats.spec import ELEMENT_FORMATS as _ELEMENT_FORMATS

__all__ = [
    "ELEMENT_FORMATS",
    "GEMM_MODES",
    "ROUNDING_MODES",
    "SCALE_FORMATS",
    "LinearQuantConfig",
    "OperandQuant",
    "Role",
]

ELEMENT_FORMATS = tuple(_ELEMENT_FORMATS)
SCALE_FORMATS = tuple(SCALE_FORMAT_TABLE)
GEMM_MODES = ("scaled", "decoded", "hardware")


class Role(str, enum.Enum):
    """The five quantized operands of a linear layer (W serves fprop and dgrad)."""

    X = "x"
    W = "w"
    DY_DGRAD = "dy_dgrad"
    DY_WGRAD = "dy_wgrad"
    X_WGRAD = "x_wgrad"


@dataclass(frozen=True, kw_only=True)
class OperandQuant(BlockSpec):
    """Quantization of one GEMM operand: a :class:`~nemofp4.formats.BlockSpec` (scale format, blocks,
    rounding, scale target, Hadamard transform: what the kernels read) plus what training adds, the
    element format and the tensor reference's refresh interval."""

    block_size: int = 16
    """Elements per block along the reduction dimension (16 NVFP4/UE5M3, 32 MXFP4)."""
    hadamard: bool = False
    """16x16 random Hadamard transform along the reduction dimension before quantizing.
    Only meaningful for wgrad operands, where it cancels in the product (H H^T = I)."""
    reference_interval: int = 0
    """0: current scaling, the reference is the amax of the tensor being quantized, at every
    quantization (Transformer Engine's NVFP4 semantics). D >= 1: sample-and-hold, the amax is
    sampled at the first use of a step and held until D steps have passed (refreshes at
    steps 1, D+1, 2D+1, ...); with gradient accumulation the first micro-batch samples it."""

    def _errors(self) -> list[str]:
        errors = super()._errors()
        interval = self.reference_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            errors.append(f"reference_interval={interval!r} (0 = current scaling, or D >= 1)")
        return errors

    def summary(self) -> str:
        """Short human-readable form for the per-layer table."""
        parts = [f"{self.element_format}/{self.scale_format}", f"b{self.block_size}"]
        if self.two_d:
            parts[-1] = f"{self.block_size}x{self.block_size}"
        if self.format.per_tensor:
            parts[-1] = "per-tensor" + (" pow2" if self.power_of_two_scale else "")
        elif self.format.power_of_two and self.is_fp8:
            parts[-1] += f" {self.mx_scale_mode}"
        parts.append(self.rounding)
        if self.hadamard:
            parts.append("rht")
        if self.uses_tensor_reference:
            if not self.format.per_tensor:
                parts.append(f"T={self.scale_target:g}")
            parts.append("cur" if self.reference_interval == 0 else f"D={self.reference_interval}")
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class LinearQuantConfig:
    """Everything one FP4 linear needs: the five operand quantizations and the GEMM mode."""

    x: OperandQuant
    w: OperandQuant
    dy_dgrad: OperandQuant
    dy_wgrad: OperandQuant
    x_wgrad: OperandQuant
    kind: ClassVar[str] = "fp4"
    """What a precision recipe calls a linear of this config: an emulated low-precision linear (FP4, or
    FP8 when its operands' ``element_format`` says so: :attr:`precision`)."""
    gemm: str = "scaled"
    """'scaled': block-scaled operands (FP4 value x block scale, exact in BF16) multiplied
    with FP32 accumulation, tensor scales applied after the product (fast). 'decoded': fully
    dequantized FP32 operands multiplied in FP32 (the paper's decoded-Torch control).
    'hardware': the paper's probe-matched model of a native FP4 GEMM (64-product groups,
    round-toward-zero accumulation; nemofp4.kernels), slower on CPU."""

    def __post_init__(self) -> None:
        if self.gemm not in GEMM_MODES:
            raise ValueError(f"gemm={self.gemm!r} is not a GEMM mode; valid modes are {GEMM_MODES}")
        fp8 = {self.operand(role).is_fp8 for role in Role}
        if len(fp8) > 1:
            raise ValueError(
                "a linear's operands are all FP8 or all FP4 (E2M1): element formats "
                f"{ {role.value: self.operand(role).element_format for role in Role} }"
            )
        if fp8 == {True} and self.gemm == "hardware":
            raise ValueError("gemm='hardware' models an FP4 tensor core; FP8 linears take 'scaled' or 'decoded'")
        for role in (Role.X, Role.DY_DGRAD, Role.DY_WGRAD, Role.X_WGRAD):
            if self.operand(role).two_d:
                raise ValueError(f"{role.value}: two_d tiles are for weights only (activations use 1-D blocks)")
        for role in (Role.X, Role.W, Role.DY_DGRAD):
            if self.operand(role).hadamard:
                raise ValueError(
                    f"{role.value}: hadamard=True is only supported on the wgrad operands (dy_wgrad, x_wgrad), "
                    "where the transform cancels in the product; on fprop/dgrad it would change the result"
                )
        if self.dy_wgrad.hadamard != self.x_wgrad.hadamard:
            raise ValueError(
                "dy_wgrad.hadamard and x_wgrad.hadamard must agree: the transform only cancels "
                "(H H^T = I) when both wgrad operands carry it"
            )
        if self.dy_wgrad.hadamard and self.dy_wgrad.block_size != self.x_wgrad.block_size:
            raise ValueError("with hadamard=True the wgrad operands must use the same block_size")
        for ref, roles in self.reference_roles().items():
            intervals = {self.operand(r).reference_interval for r in roles}
            if len(intervals) > 1:
                names = ", ".join(r.value for r in roles)
                raise ValueError(
                    f"roles {names} share the {ref!r} tensor reference but ask for different "
                    f"reference_interval values {sorted(intervals)}"
                )

    @property
    def precision(self) -> str:
        """'fp8' or 'fp4': the payload width of its operands."""
        return "fp8" if self.x.is_fp8 else "fp4"

    def operand(self, role: Role) -> OperandQuant:
        return getattr(self, Role(role).value)

    @staticmethod
    def reference_of(role: Role, operand: OperandQuant) -> str:
        """Name of the tensor reference a role reads: 'x', 'w', 'dy', 'x_rht' or 'dy_rht'."""
        base = {Role.X: "x", Role.X_WGRAD: "x", Role.W: "w", Role.DY_DGRAD: "dy", Role.DY_WGRAD: "dy"}[Role(role)]
        return f"{base}_rht" if operand.hadamard else base

    def reference_roles(self) -> dict[str, list[Role]]:
        """Tensor reference name -> roles that read it (only roles that use a tensor reference)."""
        refs: dict[str, list[Role]] = {}
        for role in Role:
            op = self.operand(role)
            if op.uses_tensor_reference:
                refs.setdefault(self.reference_of(role, op), []).append(role)
        return refs

    def reference_interval(self, reference: str) -> int:
        roles = self.reference_roles()[reference]
        return self.operand(roles[0]).reference_interval

    def replace_operands(self, **changes) -> LinearQuantConfig:
        """A copy with the same field changes applied to all five operands (e.g. reference_interval)."""
        from dataclasses import replace

        return replace(self, **{role.value: replace(self.operand(role), **changes) for role in Role})

    def summary(self) -> str:
        """One line per distinct operand setting, for the per-layer table."""
        groups: dict[str, list[str]] = {}
        for role in Role:
            groups.setdefault(self.operand(role).summary(), []).append(role.value)
        body = "; ".join(f"{','.join(roles)}: {desc}" for desc, roles in groups.items())
        return f"{body}; gemm={self.gemm}"
