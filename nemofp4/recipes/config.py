"""The typed ``precision`` config group (configs/precision/<name>.yaml) and its recipe factory."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

from .recipe import Recipe
from .registry import get_recipe, recipe_knobs

__all__ = ["PrecisionConfig", "recipe_from_config"]


@dataclass(kw_only=True)
class PrecisionConfig:
    """Which recipe the linears train in, plus optional knob overrides.

    A knob left at None keeps the recipe's default. A knob the chosen recipe does not have
    is ignored with a warning (it has no effect), so one override line can serve a sweep.
    """

    name: str
    """Registered recipe: bf16, nvfp4, nvfp4_te, nvfp4_delayed, ue5m3, ue5m3_te_settings, nvfp4_all_fp4_no_rht, mxfp4."""
    reference_interval: int | None = None
    """D: steps a tensor reference (amax) is held; 0 = current scaling at every quantization."""
    scale_target: float | None = None
    """T: block code of a block whose amax equals the tensor reference (448 by default)."""
    targeted_scale_target: float | None = None
    """ue5m3 only: T of the wgrad dY of down_proj in layers 45, 47, 49, 51 (2048)."""
    block_size: int | None = None
    """Elements per block along the reduction dimension."""
    num_bf16_last_layers: int | None = None
    """Pattern layers at the end of the stack kept in BF16 (8 in the NVFP4 recipe)."""
    gemm: str | None = None
    """'scaled' (block-scaled operands, BF16-speed, default) or 'decoded' (FP32 dequantized operands)."""
    restore_references: bool = True
    """On resume, restore the checkpointed tensor references (exact continuation). False starts
    them empty, as the UE5M3 paper's runs did after a restart. Read by the trainer."""


def recipe_from_config(cfg: PrecisionConfig) -> Recipe:
    """Build the recipe a :class:`PrecisionConfig` (or an OmegaConf node of one) names."""
    name = cfg.name
    knobs = recipe_knobs(name)  # raises for an unknown recipe name
    overrides = {}
    for f in fields(PrecisionConfig):
        if f.name in ("name", "restore_references"):
            continue
        value = getattr(cfg, f.name, None)
        if value is None:
            continue
        if f.name not in knobs:
            warnings.warn(f"precision.{f.name}={value!r} has no effect on recipe {name!r} (its knobs: {sorted(knobs)})",
                          stacklevel=2)
            continue
        overrides[f.name] = value
    return get_recipe(name, **overrides)
