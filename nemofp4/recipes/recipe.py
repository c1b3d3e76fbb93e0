"""A precision recipe: named per-linear settings ("parts") and the ordered rules that assign them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from nemofp4.quant import LinearQuantConfig

from .rules import Rule

__all__ = [
    "TE_FP8_FORMATS",
    "TE_FP8_SCALINGS",
    "TE_KINDS",
    "HighPrecision",
    "Part",
    "Recipe",
    "TransformerEngineFP8",
    "TransformerEngineNVFP4",
    "is_quantized",
    "part_kind",
    "runs_in_transformer_engine",
]


@dataclass(frozen=True, kw_only=True)
class HighPrecision:
    """A linear that is not quantized.

    ``compute="model"`` leaves the ``nn.Linear`` untouched: it runs in the model/autocast dtype
    (BF16 on GPU). ``compute="fp32"`` makes it compute in float32 even under autocast, as the
    LM head does in every FP4 recipe.
    """

    compute: str = "model"

    def __post_init__(self) -> None:
        if self.compute not in ("model", "fp32"):
            raise ValueError(f"HighPrecision.compute={self.compute!r}; valid values are 'model' and 'fp32'")

    @property
    def kind(self) -> str:
        """'fp32' (float32 compute) or 'bf16' (the model dtype)."""
        return "fp32" if self.compute == "fp32" else "bf16"

    def summary(self) -> str:
        return "fp32 compute" if self.compute == "fp32" else "model dtype (bf16 on GPU)"


@dataclass(frozen=True, kw_only=True)
class TransformerEngineNVFP4:
    """A native ``te.Linear`` run under TE's ``NVFP4BlockScaling`` (needs TE and an FP4 GPU).

    The flags map one-to-one to the recipe dataclass fields (never to environment variables).
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    kind: ClassVar[str] = "te_nvfp4"
    te_recipe: ClassVar[str] = "NVFP4BlockScaling"
    """TE's recipe class (:data:`nemofp4.quant.TE_RECIPES`)."""

    def summary(self) -> str:
        flags = [
            "rht" if not self.disable_rht else "no-rht",
            "sr" if not self.disable_stochastic_rounding else "no-sr",
            "2d-w" if not self.disable_2d_quantization else "1d-w",
        ]
        return "te.Linear NVFP4BlockScaling (" + ", ".join(flags) + ")"


TE_FP8_SCALINGS = {"current": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling"}
"""``TransformerEngineFP8.scaling`` -> TE's recipe class."""
TE_FP8_FORMATS = ("hybrid", "e4m3")
"""TE's ``Format`` members for FP8 training (HYBRID: E4M3 forward, E5M2 gradients; TE refuses E5M2 alone)."""


@dataclass(frozen=True, kw_only=True)
class TransformerEngineFP8:
    """A native ``te.Linear`` run under TE's ``Float8CurrentScaling`` (``scaling='current'``: one FP32
    scale per tensor from its current amax; needs TE and an SM 8.9+ GPU) or ``MXFP8BlockScaling``
    (``'mxfp8'``: E4M3 in 32-element blocks with E8M0 scales; needs an SM 10.x GPU).

    The fields map one-to-one to the recipe dataclass fields (never to environment variables).
    """

    scaling: str = "current"
    """'current' (Float8CurrentScaling) or 'mxfp8' (MXFP8BlockScaling)."""
    fp8_format: str = "hybrid"
    """TE's Format: 'hybrid' (E4M3 forward, E5M2 gradients) or 'e4m3' (E4M3 everywhere)."""
    power_of_two_scales: bool = False
    """'current' only: per-tensor scales rounded down to a power of two (TE's ``power_2_scale``)."""
    kind: ClassVar[str] = "te_fp8"

    def __post_init__(self) -> None:
        if self.scaling not in TE_FP8_SCALINGS:
            raise ValueError(f"TransformerEngineFP8.scaling={self.scaling!r}; valid: {', '.join(TE_FP8_SCALINGS)}")
        if self.fp8_format not in TE_FP8_FORMATS:
            raise ValueError(f"fp8_format={self.fp8_format!r}; valid: {', '.join(TE_FP8_FORMATS)}")
        if self.power_of_two_scales and self.scaling != "current":
            raise ValueError(
                "power_of_two_scales=True is for per-tensor current scaling (scaling='current'); "
                "MXFP8's E8M0 block scales are powers of two already"
            )

    @property
    def te_recipe(self) -> str:
        """TE's recipe class (:data:`nemofp4.quant.TE_RECIPES`)."""
        return TE_FP8_SCALINGS[self.scaling]

    def summary(self) -> str:
        flags = [self.fp8_format] + (["pow2 scales"] if self.power_of_two_scales else [])
        return f"te.Linear {self.te_recipe} ({', '.join(flags)})"


Part = LinearQuantConfig | HighPrecision | TransformerEngineNVFP4 | TransformerEngineFP8
"""Every part has a ``kind``: 'fp4' (emulated FP4 or FP8), 'te_nvfp4' or 'te_fp8' (native TE), 'fp32' or
'bf16' (model dtype)."""
TE_KINDS = (TransformerEngineNVFP4.kind, TransformerEngineFP8.kind)
"""The kinds of the parts that run in Transformer Engine."""


def part_kind(part: Part) -> str:
    """'fp4' (emulated), 'te_nvfp4' or 'te_fp8' (native TE), 'fp32' or 'bf16' (model dtype): ``part.kind``."""
    return part.kind


def runs_in_transformer_engine(part: Part) -> bool:
    """The part is a native ``te.Linear`` (it has a ``te_recipe``), not an emulation or high precision."""
    return part.kind in TE_KINDS


def is_quantized(part: Part) -> bool:
    """The part's GEMMs take quantized operands (emulated, or natively in Transformer Engine)."""
    return part.kind == "fp4" or runs_in_transformer_engine(part)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Named parts and ordered rules; linears that no rule claims are left unchanged."""

    name: str
    description: str
    parts: dict[str, Part]
    rules: tuple[Rule, ...]
    knobs: dict[str, object] = field(default_factory=dict)
    """The builder arguments this recipe was made with (for logs and configs)."""

    def __post_init__(self) -> None:
        unknown = sorted({r.part for r in self.rules} - set(self.parts))
        if unknown:
            raise ValueError(
                f"recipe {self.name!r}: rules name unknown parts {unknown}; parts are {sorted(self.parts)}"
            )

    @property
    def needs_transformer_engine(self) -> bool:
        return any(runs_in_transformer_engine(p) for p in self.parts.values())

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={v}" for k, v in self.knobs.items())
        lines = [f"recipe {self.name}" + (f" ({knobs})" if knobs else "") + f": {self.description}"]
        lines += [f"  rule {i}: {rule.describe()}" for i, rule in enumerate(self.rules)]
        return "\n".join(lines)
