"""The FP32-head rule is decided once (``models.loss.head_keeps_fp32_parameters``) and its three
users agree on it for every head precision and recipe: the trainer's FSDP2 policy for the head
(``training.parallel.apply_fsdp``), the memory plan's gathered head (``planning.memory.measure``) and
the step-cost model's head all-gather (``planning.cost``)."""

from __future__ import annotations

import pytest
import torch

import nemofp4.training.parallel as parallel
from nemofp4.models import build_model, get_model_config
from nemofp4.models.loss import HEAD_PRECISIONS, head_keeps_fp32_parameters, head_parameter_dtype
from nemofp4.planning.cost import _fsdp_groups
from nemofp4.planning.layers import head_is_fp32_part
from nemofp4.planning.memory import measure
from nemofp4.quant import FP32Linear
from nemofp4.recipes import apply_recipe, get_recipe
from nemofp4.training.parallel import DistributedConfig, apply_fsdp

RECIPES = ("bf16", "ue5m3", "fp8")
# the recipes' heads: bf16 leaves it to the body, the FP4 and FP8 recipes keep it an FP32 part
FP32_PART = {"bf16": False, "ue5m3": True, "fp8": True}


def _model_config(head_precision: str):
    return get_model_config("tiny", vocab_size=512, head_precision=head_precision)


def _trainer_head_param_dtype(head_precision: str, recipe_name: str, monkeypatch) -> torch.dtype:
    """The param_dtype of the FSDP2 policy apply_fsdp gives the head of a GPU-style BF16 run."""
    import torch.distributed.fsdp as fsdp

    model = build_model(_model_config(head_precision), device="meta")
    apply_recipe(model, get_recipe(recipe_name), log=False)
    policies = {}
    monkeypatch.setattr(parallel, "data_parallel_mesh", lambda cfg, *, device_type: None)
    monkeypatch.setattr(
        fsdp,
        "fully_shard",
        lambda module, *, mesh, mp_policy, **_: policies.setdefault(id(module), mp_policy),
    )
    monkeypatch.setattr(parallel, "sum_gradients", lambda model: None)
    apply_fsdp(
        model,
        DistributedConfig(backend="fsdp", param_dtype="bfloat16"),
        device_type="cpu",
        mixed_precision=True,
    )
    assert isinstance(model.lm_head, FP32Linear) == FP32_PART[recipe_name]
    return policies[id(model.lm_head)].param_dtype


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("head_precision", HEAD_PRECISIONS)
def test_trainer_memory_plan_and_cost_model_agree_on_the_heads_parameter_dtype(
    head_precision, recipe_name, monkeypatch
):
    model_cfg, recipe = _model_config(head_precision), get_recipe(recipe_name)
    expected = torch.float32 if FP32_PART[recipe_name] and head_precision in ("fp32", "tf32") else torch.bfloat16
    assert head_is_fp32_part(model_cfg, recipe) == FP32_PART[recipe_name]
    assert (
        head_parameter_dtype(head_precision, fp32_part=FP32_PART[recipe_name], compute_dtype=torch.bfloat16) == expected
    )

    assert _trainer_head_param_dtype(head_precision, recipe_name, monkeypatch) == expected

    head_numel = model_cfg.vocab_size * model_cfg.hidden_size
    measured = measure(
        model_cfg,
        recipe,
        seq_len=16,
        micro_batch=1,
        compute_dtype="bfloat16",
        head_precision=head_precision,
        quantizer="triton",
    )
    plan_head = next(g for g in measured.groups if g.name == "lm_head")
    assert plan_head.gathered_bytes == head_numel * expected.itemsize

    cost_head = next(
        g for g in _fsdp_groups(model_cfg, recipe, head_precision=head_precision, param_bytes=2) if g[0] == "lm_head"
    )
    assert cost_head[1:] == (head_numel, expected.itemsize)


def test_a_bf16_body_in_fp32_keeps_every_head_fp32():
    """Where the body itself computes in FP32 (CPU runs), no head is narrower than it."""
    for precision in HEAD_PRECISIONS:
        for fp32_part in (False, True):
            assert head_parameter_dtype(precision, fp32_part=fp32_part, compute_dtype=torch.float32) == torch.float32


def test_the_rule_refuses_an_unknown_head_precision():
    with pytest.raises(ValueError, match="head_precision='fp16'; valid: fp32, tf32, bf16"):
        head_keeps_fp32_parameters("fp16", fp32_part=True)
