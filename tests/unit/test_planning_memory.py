"""The memory plan's activation figures are measured saves: on CPU its prediction for small configs
matches the bytes a real forward pass keeps alive for backward, with and without activation
checkpointing, for a BF16-recipe and an FP4 (ue5m3) model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nemofp4.models import build_model, get_model_config
from nemofp4.quant import set_quant_backend, set_step
from nemofp4.recipes import apply_recipe, get_recipe
from nemofp4.training.memory_plan import LiveTensorBytes, plan_memory
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


@pytest.mark.parametrize("ac", [False, True], ids=["no-ac", "ac"])
@pytest.mark.parametrize("recipe_name", ["bf16", "ue5m3"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_planned_activations_match_real_saves_within_10_percent(model_name, recipe_name, ac):
    model_cfg = get_model_config("tiny", **MODELS[model_name])
    recipe = get_recipe(recipe_name)
    seq_len, micro_batch = 128, 2
    plan = plan_memory(model_cfg, recipe, DistributedConfig(activation_checkpointing=ac), world_size=1,
                       seq_len=seq_len, micro_batch=micro_batch, grad_accum=1, device_memory_gib=1,
                       compute_dtype="float32")  # fmt: skip
    real = _real_saved_bytes(model_cfg, recipe, ac=ac, seq_len=seq_len, micro_batch=micro_batch)
    assert plan.activations_after_forward == pytest.approx(real, rel=0.10), (plan.activations_after_forward, real)


def test_fp4_saves_less_than_bf16_and_checkpointing_keeps_only_block_inputs():
    model_cfg = get_model_config("tiny", vocab_size=512)
    plans = {(name, ac): plan_memory(model_cfg, get_recipe(name), DistributedConfig(activation_checkpointing=ac),
                                     world_size=1, seq_len=128, micro_batch=2, grad_accum=1, device_memory_gib=1,
                                     compute_dtype="float32")
             for name in ("bf16", "ue5m3") for ac in (False, True)}  # fmt: skip
    bf16, fp4 = plans["bf16", False].layers, plans["ue5m3", False].layers
    assert sum(c.saved_bytes for c in fp4) < sum(c.saved_bytes for c in bf16)
    for cost in plans["bf16", True].layers:
        assert cost.input_bytes == 2 * 128 * model_cfg.hidden_size * 4
    assert plans["bf16", True].activations_after_forward < plans["bf16", False].activations_after_forward


def test_state_is_sharded_by_fsdp_and_gradient_accumulators_appear_with_per_step_sync():
    model_cfg = get_model_config("tiny", vocab_size=512)
    kwargs = dict(seq_len=64, micro_batch=1, device_memory_gib=1, compute_dtype="float32")
    recipe = get_recipe("bf16")
    one = dict((name, b) for name, b, _ in plan_memory(model_cfg, recipe, DistributedConfig(), world_size=1,
                                                       grad_accum=1, **kwargs).rows)  # fmt: skip
    fsdp = plan_memory(model_cfg, recipe, DistributedConfig(backend="fsdp"), world_size=4, grad_accum=2, **kwargs)
    rows = dict((name, b) for name, b, _ in fsdp.rows)
    n = model_cfg.num_parameters()
    assert one["parameters (FP32 master)"] == 4 * n and rows["parameters (FP32 master)"] == 4 * n // 4
    assert rows["optimizer state (AdamW, 2 x FP32)"] == 8 * n // 4
    assert rows["unsharded gradient accumulators"] == 4 * n
    per_micro = plan_memory(model_cfg, recipe, DistributedConfig(backend="fsdp", gradient_sync="per_micro_batch"),
                            world_size=4, grad_accum=2, **kwargs)  # fmt: skip
    assert "unsharded gradient accumulators" not in dict((name, b) for name, b, _ in per_micro.rows)
    assert fsdp.format().splitlines()[-1].endswith(("fits", "does not fit"))


def test_plan_cli_prints_the_table_and_a_verdict(capsys, monkeypatch):
    """`nemofp4-plan` over the training tree: overrides compose as for nemofp4-train."""
    from nemofp4.cli import plan as plan_cli

    monkeypatch.setattr("sys.argv", ["nemofp4-plan", "model=tiny", "precision=ue5m3", "train.seq_len=64",
                                     "train.micro_batch=2", "train.global_batch=4", "world_size=2",
                                     "device_memory_gib=0.01", "distributed=fsdp"])  # fmt: skip
    plan_cli.main()
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| layer kind |") and any(line.startswith("| mamba | 2 (fp4)") for line in out)
    assert out[-1].endswith("(activation checkpointing off): does not fit")


def test_trainer_start_hook_warns_when_the_plan_exceeds_the_device(monkeypatch, caplog):
    import logging

    from nemofp4.cli.train import compose_job_config
    from nemofp4.training import memory_plan

    class _Props:
        total_memory = 2**20  # 1 MiB: nothing fits

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Props())
    cfg = compose_job_config(["model=tiny", "train.seq_len=64", "train.micro_batch=2", "train.global_batch=2"])
    logger = logging.getLogger("nemofp4.test_plan")
    assert memory_plan.log_plan(cfg, world_size=1, device=torch.device("cpu"), log=logger) is None
    with caplog.at_level(logging.INFO, logger="nemofp4.test_plan"):
        plan = memory_plan.log_plan(cfg, world_size=1, device=torch.device("cuda", 0), log=logger)
    assert plan is not None and not plan.fits
    assert "memory plan (nemofp4-plan)" in caplog.text and "more than this device's 0.0 GiB" in caplog.text
