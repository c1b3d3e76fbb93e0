"""A precision recipe: named per-linear settings ("parts") and the ordered rules that assign them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from nemofp4.quant import LinearQuantConfig

from .rules import Rule

__all__ = ["HighPrecision", "Part", "Recipe", "TransformerEngineNVFP4", "emulated_config", "part_kind"]


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

    def summary(self) -> str:
        flags = [
            "rht" if not self.disable_rht else "no-rht",
            "sr" if not self.disable_stochastic_rounding else "no-sr",
            "2d-w" if not self.disable_2d_quantization else "1d-w",
        ]
        return "te.Linear NVFP4BlockScaling (" + ", ".join(flags) + ")"


Part = LinearQuantConfig | HighPrecision | TransformerEngineNVFP4
"""Every part has a ``kind``: 'fp4' (emulated), 'te_nvfp4' (native TE), 'fp32' or 'bf16' (model dtype)."""


def part_kind(part: Part) -> str:
    """'fp4' (emulated), 'te_nvfp4' (native TE), 'fp32' or 'bf16' (model dtype): ``part.kind``."""
    return part.kind


def emulated_config(part: Part) -> LinearQuantConfig | None:
    """The emulated FP4 config whose numerics and saves stand for ``part``: itself for an FP4 part,
    the nvfp4 recipe's for Transformer Engine's NVFP4 (what it runs natively), None for BF16/FP32."""
    if part.kind == "fp4":
        return part
    if part.kind == "te_nvfp4":
        from .registry import NVFP4

        return NVFP4(disable_rht=part.disable_rht).build().parts["fp4"]
    return None


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
            raise ValueError(f"recipe {self.name!r}: rules name unknown parts {unknown}; parts are {sorted(self.parts)}")

    @property
    def needs_transformer_engine(self) -> bool:
        return any(p.kind == "te_nvfp4" for p in self.parts.values())

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={v}" for k, v in self.knobs.items())
        lines = [f"recipe {self.name}" + (f" ({knobs})" if knobs else "") + f": {self.description}"]
        lines += [f"  rule {i}: {rule.describe()}" for i, rule in enumerate(self.rules)]
        return "\n".join(lines)
