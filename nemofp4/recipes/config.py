"""The typed ``precision`` node: one dataclass per recipe, whose fields are its knobs.

Each registered recipe is a subclass of :class:`PrecisionConfig` (in :mod:`.registry`) with its
knobs as typed fields at their defaults and a ``build()`` that returns the :class:`Recipe`. The
same dataclass is the Hydra node (configs/precision/<name>.yaml lists its fields), the argument
list of :func:`get_recipe` and the source of :func:`recipe_knobs`: a knob is written once. A knob
the chosen recipe does not have is an error naming the knob, the recipe and its valid knobs.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from .recipe import Recipe

__all__ = [
    "PrecisionConfig",
    "get_recipe",
    "list_recipes",
    "precision_config",
    "recipe_from_config",
    "recipe_knobs",
    "register_recipe",
]

_REGISTRY: dict[str, type[PrecisionConfig]] = {}
_NOT_KNOBS = ("name", "restore_references")


@dataclass(kw_only=True)
class PrecisionConfig:
    """Which recipe the linears train in. A registered recipe's subclass adds its knobs.

    ``PrecisionConfig(name=...)`` alone means that recipe at its defaults (:func:`precision_config`
    turns it into the recipe's own dataclass).
    """

    name: str
    """Registered recipe (:func:`list_recipes`), e.g. bf16, nvfp4, nvfp4_delayed, ue5m3."""
    restore_references: bool = True
    """On resume, restore the checkpointed tensor references (exact continuation). False starts
    them empty, as the UE5M3 paper's runs did after a restart. Read by the trainer."""

    def build(self) -> Recipe:
        """The recipe these knobs describe."""
        return precision_config(self).build()

    def knobs(self) -> dict[str, Any]:
        """This recipe's knobs and their values (everything but name and restore_references)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_KNOBS}


def register_recipe(cls: type[PrecisionConfig]) -> type[PrecisionConfig]:
    """Register a recipe dataclass under its ``name`` default (its docstring is the description)."""
    name = next((f.default for f in fields(cls) if f.name == "name"), MISSING)
    if not isinstance(name, str):
        raise ValueError(f"recipe class {cls.__name__} needs a default for its name field")
    if name in _REGISTRY:
        raise ValueError(f"recipe {name!r} is already registered")
    if not (cls.__doc__ or "").strip() or cls.__doc__ == PrecisionConfig.__doc__:
        raise ValueError(f"recipe class {cls.__name__} needs a docstring (it is the recipe's description)")
    if cls.build is PrecisionConfig.build:
        raise ValueError(f"recipe class {cls.__name__} must define build()")
    _REGISTRY[name] = cls
    return cls


def list_recipes() -> list[str]:
    return sorted(_REGISTRY)


def recipe_class(name: str) -> type[PrecisionConfig]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown precision recipe {name!r}; registered recipes are {list_recipes()}")
    return _REGISTRY[name]


def recipe_knobs(name: str) -> dict[str, object]:
    """The knobs of a recipe and their defaults."""
    return recipe_class(name)().knobs()


def description(cls: type[PrecisionConfig]) -> str:
    """First paragraph of the recipe class's docstring, on one line."""
    return inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")


def precision_config(cfg: PrecisionConfig | Mapping | str, /, **knobs) -> PrecisionConfig:
    """The recipe's own typed config from a name, a mapping (a Hydra node) or a PrecisionConfig,
    plus optional knob overrides. An unknown knob is a ValueError naming it, the recipe and its knobs."""
    if isinstance(cfg, str):
        values: dict[str, Any] = {"name": cfg}
    elif isinstance(cfg, PrecisionConfig):
        if type(cfg) is not PrecisionConfig and not knobs:
            return cfg
        values = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    elif isinstance(cfg, Mapping):
        values = dict(_plain(cfg))
    else:
        raise ValueError(f"precision must be a recipe name, a mapping or a PrecisionConfig, got {type(cfg).__name__}")
    values.update(knobs)
    if "name" not in values:
        raise ValueError(f"precision needs a name (one of {list_recipes()}), got keys {sorted(values)}")
    cls = recipe_class(values["name"])
    valid = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - valid)
    if unknown:
        have = sorted(valid - set(_NOT_KNOBS))
        bad = ", ".join(f"{k}={values[k]!r}" for k in unknown)
        nearest = difflib.get_close_matches(unknown[0], have, n=1, cutoff=0.0)
        near = f" (the nearest valid key is precision.{nearest[0]})" if nearest else ""
        raise ValueError(
            f"precision.{bad}: recipe {values['name']!r} has no such knob{near}; its knobs are {have or 'none'} "
            "(set a knob only for a recipe that has it)"
        )
    from omegaconf import OmegaConf  # type checks and conversions (an int for a float knob) as Hydra does

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))


def recipe_from_config(cfg: PrecisionConfig | Mapping | str) -> Recipe:
    """Build the recipe a :class:`PrecisionConfig`, a Hydra node of one, or a name describes."""
    return precision_config(cfg).build()


def get_recipe(name: str, **knobs) -> Recipe:
    """Build the registered recipe ``name`` with optional knob overrides (e.g. reference_interval=50)."""
    return precision_config(name, **knobs).build()


def _plain(node: Mapping) -> dict:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
