"""What a plan needs to know of a model under a recipe: every linear's shape, block and precision."""

from __future__ import annotations

from dataclasses import dataclass

from nemofp4.models import NemotronHConfig
from nemofp4.quant import OperandQuant
from nemofp4.recipes import Recipe
from nemofp4.recipes.recipe import HighPrecision, Part, part_kind

__all__ = ["LinearSpec", "head_is_fp32_part", "linear_specs"]


@dataclass(frozen=True, kw_only=True)
class LinearSpec:
    """One linear of the model as the recipe leaves it."""

    fqn: str
    layer: int | None
    """Block index, or None for the LM head."""
    block_type: str
    """'mamba', 'attention', 'mlp' or 'head'."""
    in_features: int
    out_features: int
    part_name: str
    part: Part
    kind: str
    """:func:`nemofp4.recipes.recipe.part_kind`: 'fp4', 'te_nvfp4', 'te_fp8', 'fp32' or 'bf16'."""


def linear_specs(model: NemotronHConfig, recipe: Recipe) -> tuple[LinearSpec, ...]:
    """Every linear of ``model`` (blocks in order, then the LM head) with the part ``recipe`` gives it."""
    from nemofp4.models import build_model
    from nemofp4.recipes.apply import resolve_recipe

    meta = build_model(model, device="meta")
    specs = []
    for fqn, linear, rule in resolve_recipe(meta, recipe):
        if rule is None:
            part_name, part = "(no rule)", HighPrecision(compute="model")
        else:
            part_name = recipe.rules[rule].part
            part = recipe.parts[part_name]
        parts = fqn.split(".")
        layer = int(parts[1]) if parts[0] == "layers" else None
        block_type = model.layer_types[layer].block_type if layer is not None else "head"
        specs.append(
            LinearSpec(
                fqn=fqn,
                layer=layer,
                block_type=block_type,
                in_features=linear.in_features,
                out_features=linear.out_features,
                part_name=part_name,
                part=part,
                kind=part_kind(part),
            )
        )
    return tuple(specs)


def head_is_fp32_part(model: NemotronHConfig, recipe: Recipe) -> bool:
    """Whether ``recipe`` makes ``model``'s LM head an FP32 part (an ``FP32Linear`` in training): the
    ``fp32_part`` of :func:`nemofp4.models.loss.head_keeps_fp32_parameters`."""
    return any(s.block_type == "head" and s.kind == "fp32" for s in linear_specs(model, recipe))


def _packed_bytes(op: OperandQuant, rows: int, cols: int) -> int:
    """A packed operand [rows, cols] in blocks along cols (tiles when ``op.two_d``): the codes (two E2M1
    or one FP8 a byte, dims padded to whole blocks), one scale code per block (none for per-tensor
    scaling), and two FP32 scalars."""
    block = op.block_size
    cols_padded = -(-cols // block) * block
    rows_padded = -(-rows // block) * block if op.two_d else rows
    scales = 0 if op.format.per_tensor else (rows_padded // block if op.two_d else rows_padded) * (cols_padded // block)
    return rows_padded * cols_padded // (1 if op.is_fp8 else 2) + scales + 8


def cached_weight_bytes(spec: LinearSpec) -> tuple[int, int]:
    """Bytes an emulated linear keeps in the weight cache of a step (``train.weight_cache``): W packed
    (made in forward) and a 1-D weight's W^T for dgrad (made in backward; a 2-D weight's W^T is W's
    tiles transposed); (0, 0) for a linear that caches nothing (not emulated, or a stochastically
    rounded weight)."""
    if spec.kind != "fp4" or spec.part.w.rounding != "rne":
        return 0, 0
    w, n, k = spec.part.w, spec.out_features, spec.in_features
    return _packed_bytes(w, n, k), 0 if w.two_d else _packed_bytes(w, k, n)
