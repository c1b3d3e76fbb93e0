"""Precision recipes: registered, data-only descriptions of how every linear trains.

    from nemofp4.recipes import get_recipe, apply_recipe
    recipe = get_recipe("ue5m3")          # or "bf16", "nvfp4", "fp8", "fp8_te", "ue5m3_te_settings", ...
    table = apply_recipe(model, recipe)   # swaps in nemofp4.quant.QuantLinear; returns the table

Each recipe is a typed dataclass whose fields are its knobs (:mod:`.registry`), also the Hydra
``precision`` node. Recipes are data (parts + ordered rules); the numerics live in :mod:`nemofp4.quant`.
"""

from . import registry  # noqa: F401 (registers the recipes)
from .apply import LayerRow, LayerTable, RecipeUnavailableError, apply_recipe, resolve_recipe
from .config import (
    PrecisionConfig,
    get_recipe,
    list_recipes,
    precision_config,
    recipe_from_config,
    recipe_knobs,
    register_recipe,
)
from .recipe import (
    HighPrecision,
    Part,
    Recipe,
    TransformerEngineFP8,
    TransformerEngineNVFP4,
    is_quantized,
    part_kind,
    runs_in_transformer_engine,
)
from .registry import emulated_config, emulated_recipe
from .rules import LayerSpan, Rule, first_layers, last_layers, layer_indices

__all__ = [
    "HighPrecision",
    "LayerRow",
    "LayerSpan",
    "LayerTable",
    "Part",
    "PrecisionConfig",
    "Recipe",
    "RecipeUnavailableError",
    "Rule",
    "TransformerEngineFP8",
    "TransformerEngineNVFP4",
    "apply_recipe",
    "emulated_config",
    "emulated_recipe",
    "first_layers",
    "get_recipe",
    "is_quantized",
    "last_layers",
    "layer_indices",
    "list_recipes",
    "part_kind",
    "precision_config",
    "recipe_from_config",
    "recipe_knobs",
    "register_recipe",
    "resolve_recipe",
    "runs_in_transformer_engine",
]
