"""The memory plan's figures are measured saves plus FSDP2's arithmetic: on CPU its activations for
small configs match the bytes a real forward keeps alive for backward (with and without activation
checkpointing, BF16 and FP4 recipes); sharding, accumulators and policies move the items they must."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F

from nemofp4.models import build_model, get_model_config
from nemofp4.planning import candidate_policies, plan_memory
from nemofp4.planning.measure import LiveTensorBytes
from nemofp4.planning.memory import GIB, measure
from nemofp4.quant import set_quant_backend, set_step
from nemofp4.recipes import apply_recipe, get_recipe
from nemofp4.training.parallel import DistributedConfig, apply_activation_checkpointing

MODELS = {
    "tiny-v512": dict(vocab_size=512),
    "mamba-heavy": dict(vocab_size=256, hybrid_layer_pattern="MM*M-"),
}


def _real_saved_bytes(model_cfg, recipe, *, ac: bool, seq_len: int, micro_batch: int) -> int:
    """Bytes allocated by one forward + loss (FP32 on CPU) that are still alive when it returns."""
    torch.manual_seed(0)
    model = build_model(model_cfg, device="meta")
    apply_recipe(model, recipe, log=False)
    set_quant_backend(model, "eager")
    if ac:
        apply_activation_checkpointing(model)
    model.to_empty(device="cpu")
    model.init_weights()
    set_step(model, 1, seed=0, rank=0)
    ids = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len))
    labels = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len))
    tracker = LiveTensorBytes(ids, labels, *model.parameters(), *model.buffers())
    with tracker:
        logits = model(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    del logits  # the plain loss keeps its own FP32 log-softmax; the logits are not needed for backward
    live = tracker.live
    assert loss.requires_grad
    return live


@functools.cache
def _measured(model_name: str, recipe_name: str):
    """One measurement per model and recipe: every policy and world size of a test reuses it. On the
    Triton glue (fast under fake tensors): an FP4 linear saves the same packed operands on every path."""
    return measure(
        get_model_config("tiny", **MODELS[model_name]),
        get_recipe(recipe_name),
        seq_len=128,
        micro_batch=2,
        compute_dtype="float32",
        quantizer="triton",
    )


def _plan(model_name, recipe_name, dist_cfg, *, world_size=1, grad_accum=1, device_memory_gib=1.0, **kwargs):
    return plan_memory(
        get_model_config("tiny", **MODELS[model_name]),
        get_recipe(recipe_name),
        dist_cfg,
        world_size=world_size,
        seq_len=128,
        micro_batch=2,
        grad_accum=grad_accum,
        device_memory_gib=device_memory_gib,
        compute_dtype="float32",
        quantizer="triton",
        measured=_measured(model_name, recipe_name),
        **kwargs,
    )


@pytest.mark.parametrize("ac", [False, True], ids=["no-ac", "ac"])
@pytest.mark.parametrize("recipe_name", ["bf16", "ue5m3"])
@pytest.mark.parametrize("model_name", ["tiny-v512", pytest.param("mamba-heavy", marks=pytest.mark.slow)])
def test_planned_activations_match_real_saves_within_10_percent(model_name, recipe_name, ac):
    plan = _plan(model_name, recipe_name, DistributedConfig(activation_checkpointing=ac))
    real = _real_saved_bytes(
        get_model_config("tiny", **MODELS[model_name]), get_recipe(recipe_name), ac=ac, seq_len=128, micro_batch=2
    )
    assert plan.activations_after_forward == pytest.approx(real, rel=0.10), (plan.activations_after_forward, real)


def test_fp4_saves_less_than_bf16_and_checkpointing_keeps_only_block_inputs():
    model_cfg = get_model_config("tiny", **MODELS["tiny-v512"])
    plans = {
        (name, ac): _plan("tiny-v512", name, DistributedConfig(activation_checkpointing=ac))
        for name in ("bf16", "ue5m3")
        for ac in (False, True)
    }
    bf16, fp4 = plans["bf16", False].layers, plans["ue5m3", False].layers
    assert sum(c.saved_bytes for c in fp4) < sum(c.saved_bytes for c in bf16)
    for cost in plans["bf16", True].layers:
        assert cost.input_bytes == 2 * 128 * model_cfg.hidden_size * 4
    assert plans["bf16", True].activations_after_forward < plans["bf16", False].activations_after_forward


def _items(plan, phase="optimizer step"):
    return next(m for m in plan.moments if m.phase == phase).items


def test_state_is_sharded_by_fsdp_and_gradient_accumulators_appear_with_per_step_sync():
    model_cfg = get_model_config("tiny", **MODELS["tiny-v512"])
    n = model_cfg.num_parameters()
    one = _plan("tiny-v512", "bf16", DistributedConfig())
    assert _items(one)["parameters"] == 4 * n and _items(one)["optimizer state"] >= 8 * n
    fsdp = _plan("tiny-v512", "bf16", DistributedConfig(backend="fsdp"), world_size=4, grad_accum=3)
    # every dim 0 of the tiny model divides by 4: the shards are exactly a quarter
    assert _items(fsdp)["parameters"] == 4 * n // 4
    middle = fsdp.moment("backward", "layers.5", "middle")
    assert middle.items["gradients"] == 4 * n  # every FP32 accumulator, unsharded, between micro-batches
    assert fsdp.moment("backward", "layers.5", "last").items["communication buffers"] > 0  # the head's reduce-scatter
    per_micro = _plan(
        "tiny-v512",
        "bf16",
        DistributedConfig(backend="fsdp", gradient_sync="per_micro_batch"),
        world_size=4,
        grad_accum=3,
    )
    assert per_micro.moment("backward", "layers.5", "middle").items["gradients"] == 4 * n // 4
    assert per_micro.peak.total < fsdp.peak.total
    assert fsdp.format().splitlines()[-1].endswith(("fits", "does not fit"))


def test_groups_kept_gathered_since_forward_are_counted_until_their_backward():
    """reshard_after_forward=false keeps every group gathered from its forward to its backward;
    keep_head_gathered keeps the head, which matters where the full logits' loss runs between them."""
    model_cfg = get_model_config("tiny", **MODELS["tiny-v512"])
    fsdp = dict(world_size=4, grad_accum=1)
    resharded = _plan("tiny-v512", "bf16", DistributedConfig(backend="fsdp"), **fsdp)
    kept = _plan("tiny-v512", "bf16", DistributedConfig(backend="fsdp", reshard_after_forward=False), **fsdp)
    head = _plan("tiny-v512", "bf16", DistributedConfig(backend="fsdp"), keep_head_gathered=True, **fsdp)
    blocks = [4 * sum(p.numel() for p in b.parameters()) for b in build_model(model_cfg, device="meta").layers]  # FP32
    head_bytes = 4 * model_cfg.vocab_size * model_cfg.hidden_size

    def gathered(plan, phase, group):
        return plan.moment(phase, group, "only").items["gathered parameters"]

    # in the forward of block 3, blocks 0-2 are still gathered
    assert gathered(kept, "forward", "layers.3") - gathered(resharded, "forward", "layers.3") == sum(blocks[:3])
    assert gathered(resharded, "forward", "loss") == 0 and gathered(resharded, "backward", "loss") == 0
    assert gathered(head, "forward", "loss") == head_bytes and gathered(head, "backward", "loss") == head_bytes
    assert gathered(head, "backward", "layers.3") == gathered(
        resharded, "backward", "layers.3"
    )  # resharded after its backward
    # backward gathers nothing again: no prefetch buffer for the next block
    assert gathered(kept, "backward", "layers.0") == gathered(resharded, "backward", "layers.0")
    assert (
        gathered(kept, "backward", "layers.3") - gathered(resharded, "backward", "layers.3")
        == sum(blocks[:3]) - blocks[2]
    )


def test_checkpointing_policies_order_their_activations():
    plans = {
        p: _plan("mamba-heavy", "ue5m3", DistributedConfig(), activation_checkpointing=p)
        for p in ("none", "mamba", "mlp", "full")
    }
    after = {p: plan.activations_after_forward for p, plan in plans.items()}
    assert after["full"] < after["mamba"] < after["none"] and after["full"] < after["mlp"] < after["none"]
    # the Mamba blocks save most: checkpointing them alone keeps less than checkpointing the MLP alone
    assert after["mamba"] < after["mlp"]
    assert candidate_policies(get_model_config("tiny"))[0] == "none"
    assert candidate_policies(get_model_config("tiny"))[-1] == "full"


def test_the_plan_names_the_mamba_scan_it_counts():
    plan = _plan("tiny-v512", "bf16", DistributedConfig())
    assert "Mamba scan: torch (the pure-PyTorch SSD scan" in plan.format()


def test_plan_cli_prints_the_table_a_recommendation_and_the_step_cost(capsys, monkeypatch):
    """`nemofp4-plan` over the training tree: overrides compose as for nemofp4-train."""
    from nemofp4.cli import plan as plan_cli

    monkeypatch.setattr(
        "sys.argv",
        [
            "nemofp4-plan",
            "model=tiny",
            "precision=ue5m3",
            "train.seq_len=64",
            "train.micro_batch=2",
            "train.global_batch=4",
            "world_size=2",
            "device_memory_gib=0.01",
            "distributed=fsdp",
            "device=h100",
        ],
    )
    plan_cli.main()
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].startswith("| layer kind |") and any(line.startswith("| mamba | 2 (fp4)") for line in lines)
    assert "(activation checkpointing none): does not fit" in out
    assert "Recommendation: does not fit at 0 GiB under any checkpointing policy" in out
    assert "| linear GEMMs |" in out and "| reduce-scatter |" in out and "Projected on H100" in out


def test_trainer_start_hook_warns_when_the_plan_exceeds_the_device(monkeypatch, caplog):
    import logging

    from nemofp4 import planning
    from nemofp4.cli.train import compose_job_config

    class _Props:
        total_memory = 2**20  # 1 MiB: nothing fits

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Props())
    # seq 512: activations, which checkpointing saves, weigh against the tiny model's state
    cfg = compose_job_config(["model=tiny", "train.seq_len=512", "train.micro_batch=2", "train.global_batch=2"])
    logger = logging.getLogger("nemofp4.test_plan")
    assert planning.log_plan(cfg, world_size=1, device=torch.device("cpu"), log=logger) is None
    with caplog.at_level(logging.INFO, logger="nemofp4.test_plan"):
        plan = planning.log_plan(cfg, world_size=1, device=torch.device("cuda", 0), log=logger)
    assert plan is not None and not plan.fits
    assert "memory plan (nemofp4-plan)" in caplog.text and "more than this device's 0.0 GiB" in caplog.text
    assert "no checkpointing policy fits" in caplog.text
    assert plan.total_bytes > 4 * GIB  # the reserve alone

    # a device between the plans with and without checkpointing: the warning names the cheapest policy that fits
    full = planning.plan_for_job(
        cfg, world_size=1, device_memory_gib=1.0, activation_checkpointing="full", measured=plan.measured
    )
    _Props.total_memory = (plan.total_bytes + full.total_bytes) // 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nemofp4.test_plan"):
        planning.log_plan(cfg, world_size=1, device=torch.device("cuda", 0), log=logger)
    assert re.search(
        r"; fits at 4 GiB with checkpointing on .+ \(distributed\.activation_checkpointing=[a-z_+0-9]+\), "
        r"\+\d+% FLOPs",
        caplog.text,
    ), caplog.text
