"""The simulation and the analytical plan hold each other: the training step run on fake tensors over
a fake process group (FSDP2, FSDPMemTracker) and the plan's measured blocks plus FSDP2 arithmetic
agree item by item at the simulated peak, and the plan finds the same peak, for the bf16, nvfp4 and
ue5m3 recipes at world 8 and 64, with activation checkpointing on and off.

A reduced config keeps the 8B's structure (all three block types, a vocabulary large against the
width, chunked head loss, whole SSD chunks) at an eighth of its widths and seq 1024; three
micro-batches per step exercise the first, a middle and the last one. The full matrix is slow; CI
runs two corners of it.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from nemofp4.models import get_model_config
from nemofp4.planning import CATEGORIES, plan_memory, simulate_memory
from nemofp4.recipes import get_recipe
from nemofp4.training.parallel import DistributedConfig

REDUCED = get_model_config(
    "nemotron_h_8b_paper",
    hybrid_layer_pattern="M*-",
    hidden_size=512,
    vocab_size=16384,
    ffn_hidden_size=2688,
    num_attention_heads=4,
    num_key_value_heads=1,
    mamba_num_heads=16,
    mamba_head_dim=64,
    mamba_num_groups=8,
)
STEP = dict(seq_len=1024, micro_batch=1, grad_accum=3, head_chunk_tokens=256, mamba_scan="mamba_ssm")


def _compare(recipe_name: str, world_size: int, checkpointing: str, **dist_kwargs):
    dist_cfg = DistributedConfig(backend="fsdp", activation_checkpointing=checkpointing, **dist_kwargs)
    recipe = get_recipe(recipe_name)
    sim = simulate_memory(REDUCED, recipe, dist_cfg, world_size=world_size, **STEP)
    plan = plan_memory(REDUCED, recipe, dist_cfg, world_size=world_size, device_memory_gib=141, **STEP)
    same = plan.moment(sim.peak_phase, sim.peak_group, sim.peak_micro_batch)
    assert same is not None, f"the plan has no moment {sim.peak_phase} {sim.peak_group} {sim.peak_micro_batch}"
    for name in CATEGORIES:
        # items above 1% of the peak within 10%; smaller ones within 1% of the peak
        tolerance = max(0.10 * sim.categories[name], 0.01 * sim.peak_bytes)
        assert abs(same.items[name] - sim.categories[name]) <= tolerance, (name, same.items, sim.categories)
    assert plan.peak.total == pytest.approx(sim.peak_bytes, rel=0.05)
    return sim, plan


@pytest.mark.parametrize(
    "recipe_name, world_size, checkpointing",
    [
        ("ue5m3", 8, "full"),
        ("bf16", 64, "none"),
        pytest.param("ue5m3", 64, "full", marks=pytest.mark.slow),
        pytest.param("ue5m3", 8, "none", marks=pytest.mark.slow),
        pytest.param("ue5m3", 64, "none", marks=pytest.mark.slow),
        pytest.param("nvfp4", 8, "full", marks=pytest.mark.slow),
        pytest.param("nvfp4", 64, "full", marks=pytest.mark.slow),
        pytest.param("nvfp4", 8, "none", marks=pytest.mark.slow),
        pytest.param("nvfp4", 64, "none", marks=pytest.mark.slow),
        pytest.param("bf16", 8, "full", marks=pytest.mark.slow),
        pytest.param("bf16", 64, "full", marks=pytest.mark.slow),
        pytest.param("bf16", 8, "none", marks=pytest.mark.slow),
        pytest.param("nvfp4_te", 8, "none", marks=pytest.mark.slow),  # TE's linears by their stand-ins
        pytest.param("nvfp4_te", 64, "full", marks=pytest.mark.slow),
    ],
)
def test_the_plan_matches_the_simulation_item_by_item(recipe_name, world_size, checkpointing):
    sim, _ = _compare(recipe_name, world_size, checkpointing)
    assert sim.micro_batches == 3 and not dist.is_initialized()  # the fake process group is gone


@pytest.mark.slow
@pytest.mark.parametrize(
    "dist_kwargs",
    [dict(replicate_degree=8), dict(gradient_sync="per_micro_batch"), dict(reshard_after_forward=False)],
    ids=["hsdp", "per-micro-batch", "no-reshard-after-forward"],
)
def test_the_plan_matches_the_simulation_for_hsdp_per_micro_batch_reduction_and_no_resharding(dist_kwargs):
    _compare("ue5m3", 64, "mlp", **dist_kwargs)


def test_the_simulation_refuses_a_process_that_has_a_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="creates its own fake process group"):
        simulate_memory(REDUCED, get_recipe("bf16"), DistributedConfig(backend="fsdp"), world_size=8, **STEP)


def test_simulate_refuses_a_backend_it_cannot_measure_before_planning():
    from nemofp4.cli.plan import plan_report
    from nemofp4.cli.train import compose_job_config

    job = compose_job_config(["model=tiny", "distributed.backend=deepspeed_zero2"])
    with pytest.raises(
        ValueError, match=r"simulate=true with distributed.backend='deepspeed_zero2': .*use distributed=fsdp"
    ):
        plan_report(job, world_size=2, simulate=True)
    with pytest.raises(ValueError, match="the simulation measures FSDP2 runs"):
        simulate_memory(REDUCED, get_recipe("bf16"), DistributedConfig(), world_size=1, **STEP)
