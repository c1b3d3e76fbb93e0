"""Apply a recipe to a model: resolve the rules, swap the linears, return the per-layer table.

Runs on the meta device before parallelization: an emulated FP4 linear is a class swap of
the ``nn.Linear`` (``module.__class__ = QuantLinear``), so no tensor is allocated and the
parameter objects stay the same for FSDP2 to shard afterwards. Only ``nn.Linear`` modules are
considered; embeddings, convolutions, the scan and norms are never touched.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass

from torch import nn

from nemofp4.quant import FP32Linear, QuantLinear, TELinear, transformer_engine_status

from .recipe import HighPrecision, Recipe, runs_in_transformer_engine
from .registry import emulated_recipe

__all__ = ["LayerRow", "LayerTable", "RecipeUnavailableError", "apply_recipe", "resolve_recipe"]

logger = logging.getLogger("nemofp4.recipes")

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


class RecipeUnavailableError(RuntimeError):
    """The recipe needs software or hardware this machine does not have."""


@dataclass(frozen=True, kw_only=True)
class LayerRow:
    """One linear of the model and what the recipe made of it."""

    fqn: str
    layer: int | None
    """Pattern-layer index (``layers.{i}``), None outside the stack (lm_head)."""
    block_type: str
    """'mamba' | 'attention' | 'mlp' for stack layers, '' elsewhere."""
    part: str
    """Recipe part name, or '(no rule)' for a linear no rule claimed (left unchanged)."""
    kind: str
    """'fp4' | 'te_nvfp4' | 'te_fp8' | 'fp32' | 'bf16' (model dtype)."""
    rule: int | None
    """Index of the rule that claimed it."""
    detail: str


@dataclass(frozen=True, kw_only=True)
class LayerTable:
    """The resolved per-layer precision table that :func:`apply_recipe` returns and logs."""

    recipe: str
    rows: tuple[LayerRow, ...]
    parts: dict[str, str]
    """Part name -> its settings, for the legend under the table."""

    def counts(self) -> dict[str, int]:
        """Linears per kind ('fp4', 'bf16', 'fp32', 'te_nvfp4', 'te_fp8')."""
        return dict(Counter(row.kind for row in self.rows))

    def count(self, kind: str) -> int:
        return sum(row.kind == kind for row in self.rows)

    def by_fqn(self) -> dict[str, LayerRow]:
        return {row.fqn: row for row in self.rows}

    def format(self) -> str:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(self.counts().items()))
        header = ("layer", "type", "module", "kind", "part")
        body = [("" if r.layer is None else str(r.layer), r.block_type, r.fqn, r.kind, r.part) for r in self.rows]
        widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]

        def line(cols) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()

        lines = [f"precision recipe {self.recipe}: {len(self.rows)} linears ({counts})", line(header)]
        lines += [line(row) for row in body]
        lines += [f"part {name}: {detail}" for name, detail in self.parts.items()]
        return "\n".join(lines)


def resolve_recipe(model: nn.Module, recipe: Recipe) -> list[tuple[str, nn.Linear, int | None]]:
    """(fqn, linear, rule index or None) for every ``nn.Linear`` of ``model``, first match wins.

    Raises ValueError when a rule claims no linear (unless it allows that).
    """
    num_layers = len(model.layers) if isinstance(getattr(model, "layers", None), nn.ModuleList) else 0
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    already = [name for name, m in linears if isinstance(m, (QuantLinear, FP32Linear, TELinear))]
    if already:
        raise ValueError(f"a precision recipe was already applied to this model (e.g. {already[0]!r} is converted)")
    claimed: dict[str, int] = {}
    for index, rule in enumerate(recipe.rules):
        matches = rule.matcher(num_layers)
        hits = [name for name, _ in linears if name not in claimed and matches(name)]
        if not hits and not rule.allow_empty:
            sample = ", ".join(name for name, _ in linears[:6])
            raise ValueError(
                f"recipe {recipe.name!r}: rule {index} ({rule.describe()}) matches no linear of this "
                f"{num_layers}-layer model; linears are named like {sample}. An empty selection is an "
                "error rather than a silent no-op; fix the rule or the recipe knobs (e.g. "
                "num_bf16_last_layers smaller than the layer count)"
            )
        for name in hits:
            claimed[name] = index
    return [(name, m, claimed.get(name)) for name, m in linears]


def apply_recipe(model: nn.Module, recipe: Recipe, *, log: bool = True) -> LayerTable:
    """Swap the model's linears as ``recipe`` says and return (and log) the per-layer table.

    Works on a meta-device model (call it before parallelization and materialization).
    Raises :class:`RecipeUnavailableError` for a Transformer Engine recipe on a machine that
    lacks TE or a GPU that runs it, and ValueError for a rule that selects nothing.
    """
    for part in dict.fromkeys(p for p in recipe.parts.values() if runs_in_transformer_engine(p)):
        ok, reason = transformer_engine_status(part)
        if not ok:
            raise RecipeUnavailableError(
                f"recipe {recipe.name!r} runs te.Linear under Transformer Engine's {part.te_recipe}, but {reason}. "
                f"Use precision={emulated_recipe(part).name} instead: the same recipe emulated bit-faithfully in PyTorch."
            )
    resolved = resolve_recipe(model, recipe)
    modules = dict(model.named_modules())
    rows = []
    fp4_index = 0
    for fqn, linear, rule_index in resolved:
        match = _LAYER_RE.match(fqn)
        layer = int(match.group(1)) if match else None
        block_type = ""
        if layer is not None and isinstance(getattr(model, "layers", None), nn.ModuleList):
            block_type = str(getattr(model.layers[layer], "block_type", ""))
        if rule_index is None:
            part_name, part = "(no rule)", HighPrecision(compute="model")
        else:
            part_name = recipe.rules[rule_index].part
            part = recipe.parts[part_name]
        if part.kind == "fp4":
            QuantLinear.from_linear(linear, part, index=fp4_index)
            fp4_index += 1
        elif runs_in_transformer_engine(part):
            _replace_child(modules, fqn, TELinear.from_linear(linear, part))
        elif part.kind == "fp32":
            FP32Linear.from_linear(linear)
        rows.append(
            LayerRow(
                fqn=fqn,
                layer=layer,
                block_type=block_type,
                part=part_name,
                kind=part.kind,
                rule=rule_index,
                detail=part.summary(),
            )
        )
    used = dict.fromkeys(row.part for row in rows)
    details = {row.part: row.detail for row in rows}
    table = LayerTable(recipe=recipe.name, rows=tuple(rows), parts={name: details[name] for name in used})
    if log:
        logger.info("%s\n%s", recipe.describe(), table.format())
    return table


def _replace_child(modules: dict[str, nn.Module], fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    setattr(modules[parent_name] if parent_name else modules[""], child, new)
