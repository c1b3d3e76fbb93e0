"""The planner's view of the weight cache (train.weight_cache): the bytes it holds, as a real step's
cache holds them, and the quantization passes it removes from the step-cost model."""

from __future__ import annotations

import pytest
import torch

from nemofp4.models import build_model, get_model_config, lm_loss
from nemofp4.planning import step_cost
from nemofp4.planning.layers import cached_weight_bytes, linear_specs
from nemofp4.quant import QuantLinear, cached_weights, set_quant_backend, set_step
from nemofp4.recipes import apply_recipe, get_recipe
from nemofp4.training.parallel import DistributedConfig


@pytest.mark.parametrize("recipe", ["ue5m3", "mxfp4"])  # 16x16 tiles (W only); 1-D blocks of 32 (W and W^T)
def test_the_planned_cache_bytes_are_what_a_step_caches(recipe):
    model_cfg = get_model_config("tiny")
    model = build_model(model_cfg)
    apply_recipe(model, get_recipe(recipe), log=False)
    set_quant_backend(model, "eager")
    set_step(model, 1)
    ids = torch.randint(0, model_cfg.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    with cached_weights(model):
        lm_loss(model, ids[:, :-1], ids[:, 1:]).backward()
        cached = {
            name: {key: sum(t.nbytes for t in q.tensors()) for key, q in m.quant_state.weight_cache.items()}
            for name, m in model.named_modules()
            if isinstance(m, QuantLinear)
        }
    planned = {s.fqn: cached_weight_bytes(s) for s in linear_specs(model_cfg, get_recipe(recipe)) if s.kind == "fp4"}
    assert planned.keys() == cached.keys()
    for fqn, (fprop, dgrad) in planned.items():
        assert cached[fqn] == ({"w": fprop, "wt": dgrad} if dgrad else {"w": fprop}), fqn


@pytest.mark.parametrize("policy", ["none", "full"])
def test_the_cost_model_counts_each_weight_once_per_step(policy):
    model_cfg = get_model_config("tiny")
    recipe = get_recipe("mxfp4")  # 1-D weights: W in forward (again in recompute), W^T in backward
    dist_cfg = DistributedConfig(activation_checkpointing=policy)
    kwargs = dict(world_size=1, seq_len=64, micro_batch=2, grad_accum=4)
    per_micro_batch = step_cost(model_cfg, recipe, dist_cfg, weight_cache=False, **kwargs).quantized_elements
    once = step_cost(model_cfg, recipe, dist_cfg, weight_cache=True, **kwargs).quantized_elements
    weight_elements = sum(
        s.in_features * s.out_features
        for s in linear_specs(model_cfg, recipe)
        if s.kind == "fp4" and s.layer is not None
    )
    passes = 3 if policy == "full" else 2  # per micro-batch: W (and its recompute), W^T; once per step: W, W^T
    assert per_micro_batch - once == weight_elements * (4 * passes - 2)
    # one micro-batch per step: nothing to reuse
    single = dict(kwargs, grad_accum=1)
    assert (
        step_cost(model_cfg, recipe, dist_cfg, weight_cache=True, **single).quantized_elements
        == step_cost(model_cfg, recipe, dist_cfg, weight_cache=False, **single).quantized_elements
    )
