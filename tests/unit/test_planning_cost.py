"""The step-cost model counts what runs: its FLOPs by component match ``torch.utils.flop_counter``'s
count of a real forward and backward (the tiny model on CPU, an 8B-width slice on fake tensors)
within 5%, its collective bytes match what FSDP2 issues over a fake process group within 1%, and
its projection moves the way the hardware says."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from nemofp4.models import build_model, get_model_config, lm_loss
from nemofp4.planning import get_device, simulate_memory, step_cost
from nemofp4.planning.measure import fake_run, warm_format_tables
from nemofp4.quant import set_quant_backend, set_step
from nemofp4.recipes import apply_recipe, get_recipe
from nemofp4.training.parallel import DistributedConfig, parallelize

aten = torch.ops.aten


def _raw(formula):
    def counted(*args, **kwargs):
        return formula(*args, **kwargs)

    counted._get_raw = True  # FlopCounterMode calls it with the op's arguments, as its own registry
    return counted


def _grouped_conv_backward(grad_out, x, weight, *args, out_val=None, **kwargs):
    """Each gradient a convolution's backward computes costs its forward: torch's formula for the
    weight gradient ignores ``groups`` (it counts a depthwise conv as a dense one)."""
    from torch.utils.flop_counter import conv_flop_count

    output_mask = args[-1] if args else kwargs["output_mask"]
    forward = conv_flop_count(tuple(x.shape), tuple(weight.shape), tuple(grad_out.shape))
    return forward * (int(output_mask[0]) + int(output_mask[1]))


_grouped_conv_backward._get_raw = True

# FlopCounterMode's registry misses ops the model runs: CPU's own flash SDPA (torch's SDPA formulas count
# it: forward two matmuls, backward the score recompute and four matmuls), the in-place addmm_, and the
# weight gradient of a grouped convolution
CPU_SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu: _raw(flop_registry[aten._scaled_dot_product_flash_attention]),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _raw(
        flop_registry[aten._scaled_dot_product_flash_attention_backward]
    ),
    aten.convolution_backward: _grouped_conv_backward,
    aten.addmm_: _raw(flop_registry[aten.addmm]),  # the chunked loss accumulates the head's gradient in place
}


def _counted(model_cfg, recipe_name, *, seq_len, micro_batch, checkpointing, head_chunk_tokens, fake):
    """FlopCounterMode's FLOPs of one micro-batch's forward and backward, by component."""
    recipe = get_recipe(recipe_name)
    warm_format_tables(recipe)
    model = build_model(model_cfg, device="meta")
    apply_recipe(model, recipe, log=False)
    set_quant_backend(model, "triton" if fake else "eager")
    parallelize(model, DistributedConfig(activation_checkpointing=checkpointing), device_type="cpu")
    counter = FlopCounterMode(display=False, custom_mapping=CPU_SDPA)
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    with fake_run(quantizer="triton", mamba_ssm=False) if fake else contextlib.nullcontext():
        model.to_empty(device="cpu")
        if not fake:
            model.init_weights()
        set_step(model, 1)
        with counter:
            lm_loss(model, ids, ids, head_chunk_tokens=head_chunk_tokens).backward()
    counts = counter.get_flop_counts()

    root = type(model).__name__
    blocks = [counts.get(f"{root}.layers.{i}", {}) for i in range(model_cfg.num_layers)]

    def of(ops):  # FLOPs of these ops inside the blocks (attributed to the block running them)
        return sum(v for block in blocks for op, v in block.items() if str(op).split(".")[-1] in ops)

    attention = of(
        {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
    )
    return {
        "linear GEMMs": of({"mm", "addmm", "fp4_linear", "fp4_linear_backward"}),
        "attention": attention,
        "SSD scan": of({"bmm", "baddbmm", "convolution", "convolution_backward"}),
        "head and loss": counter.get_total_flops() - sum(sum(b.values()) for b in blocks),
        "total": counter.get_total_flops(),
    }


CASES = {
    "tiny": (get_model_config("tiny", vocab_size=2048), dict(seq_len=128, micro_batch=2, fake=False)),
    "8b-slice": (
        get_model_config("nemotron_h_8b_paper", hybrid_layer_pattern="M*-"),
        dict(seq_len=2048, micro_batch=1, fake=True),
    ),
}


@pytest.mark.parametrize(
    "case, recipe_name, head_chunk_tokens",
    [
        ("tiny", "bf16", 0),
        ("tiny", "ue5m3", 256),
        ("8b-slice", "ue5m3", 256),
        pytest.param("8b-slice", "bf16", 0, marks=pytest.mark.slow),
    ],
)
def test_flops_by_component_match_the_flop_counter(case, recipe_name, head_chunk_tokens):
    model_cfg, run = CASES[case]
    counted = _counted(model_cfg, recipe_name, checkpointing="none", head_chunk_tokens=head_chunk_tokens, **run)
    cost = step_cost(
        model_cfg,
        get_recipe(recipe_name),
        DistributedConfig(),
        world_size=1,
        seq_len=run["seq_len"],
        micro_batch=run["micro_batch"],
        grad_accum=1,
        head_chunk_tokens=head_chunk_tokens,
    )
    for name in ("linear GEMMs", "attention", "SSD scan", "head and loss"):
        assert cost.flops[name] == pytest.approx(counted[name], rel=0.05), (name, cost.flops[name], counted[name])
    assert cost.flops["recompute"] == 0
    assert cost.total_flops == pytest.approx(counted["total"], rel=0.05)


@pytest.mark.parametrize("policy", ["mlp", pytest.param("full", marks=pytest.mark.slow)])
def test_recompute_flops_are_the_checkpointed_blocks_forward(policy):
    model_cfg, run = CASES["8b-slice"]
    plain = _counted(model_cfg, "ue5m3", checkpointing="none", head_chunk_tokens=256, **run)["total"]
    checkpointed = _counted(model_cfg, "ue5m3", checkpointing=policy, head_chunk_tokens=256, **run)["total"]
    cost = step_cost(
        model_cfg,
        get_recipe("ue5m3"),
        DistributedConfig(activation_checkpointing=policy),
        world_size=1,
        seq_len=run["seq_len"],
        micro_batch=1,
        grad_accum=1,
        head_chunk_tokens=256,
    )
    assert cost.flops["recompute"] == pytest.approx(checkpointed - plain, rel=0.05)


@pytest.mark.parametrize(
    "dist_kwargs, layout",
    [
        ({}, "FSDP"),
        ({"replicate_degree": 8}, "HSDP 8x8"),
        pytest.param({"gradient_sync": "per_micro_batch"}, "FSDP", marks=pytest.mark.slow),
        pytest.param({"reshard_after_forward": False}, "FSDP", marks=pytest.mark.slow),
    ],
)
def test_collective_and_copy_bytes_match_what_fsdp2_issues(dist_kwargs, layout):
    model_cfg = get_model_config(
        "nemotron_h_8b_paper",
        hybrid_layer_pattern="M*-",
        hidden_size=512,
        vocab_size=4096,
        ffn_hidden_size=1024,
        num_attention_heads=4,
        num_key_value_heads=1,
        mamba_num_heads=16,
        mamba_head_dim=64,
        mamba_num_groups=8,
    )
    dist_cfg = DistributedConfig(backend="fsdp", activation_checkpointing="mlp", **dist_kwargs)
    step = dict(seq_len=256, micro_batch=1, grad_accum=3, head_chunk_tokens=128)
    sim = simulate_memory(model_cfg, get_recipe("bf16"), dist_cfg, world_size=64, **step)
    cost = step_cost(model_cfg, get_recipe("bf16"), dist_cfg, world_size=64, **step)
    assert set(cost.collectives[layout]) == {k for k, v in sim.collectives.items() if v > 1e3}
    for collective, nbytes in cost.collectives[layout].items():
        assert nbytes == pytest.approx(sim.collectives[collective], rel=0.01), collective
    # FSDP2's copies around them: the gathered buffers copied out, the gradients copied (cast) in, and with
    # gradient_sync=per_step the kept gradients upcast and accumulated
    accumulates = dist_cfg.gradient_sync == "per_step"
    assert set(sim.fsdp_copies) == {"all-gather copy-out", "reduce-scatter copy-in"} | (
        {"gradient accumulation"} if accumulates else set()
    )
    for copy, nbytes in sim.fsdp_copies.items():
        assert cost.fsdp_copy_bytes[layout][copy] == pytest.approx(nbytes, rel=0.01), copy
    assert (cost.fsdp_copy_bytes[layout]["gradient accumulation"] > 0) == accumulates


def test_the_projection_follows_the_hardware():
    model = get_model_config("nemotron_h_8b_paper")
    step = dict(world_size=64, seq_len=8192, micro_batch=1, grad_accum=12, head_chunk_tokens=1024)
    dist_cfg = DistributedConfig(backend="fsdp", activation_checkpointing="full")
    ue5m3 = step_cost(model, get_recipe("ue5m3"), dist_cfg, **step)
    h100, h200, gb200 = (ue5m3.project(get_device(d), "FSDP") for d in ("h100", "h200", "gb200"))
    assert h100.step_s == pytest.approx(h200.step_s, rel=0.02) or h100.step_s > h200.step_s  # same compute, HBM
    assert gb200.step_s < h200.step_s
    # the FP32 head computes at the FP32 peak: a BF16 head is faster, on every device
    bf16_head = step_cost(model, get_recipe("ue5m3"), dist_cfg, head_precision="bf16", **step)
    assert bf16_head.project(get_device("h200"), "FSDP").step_s < h200.step_s
    # HSDP keeps the all-gathers inside the node: less time on the wire than FSDP across 8 nodes
    hsdp = ue5m3.project(get_device("h200"), "HSDP 8x8")
    assert hsdp.comm_s < h200.comm_s
    # native FP4 GEMMs (TE's NVFP4) run at the FP4 peak where there is one
    te = step_cost(model, get_recipe("nvfp4_te"), dist_cfg, **step)
    assert te.fp4_native_flops > 0
    assert (
        te.project(get_device("gb200"), "FSDP").step_s
        < step_cost(model, get_recipe("nvfp4"), dist_cfg, **step).project(get_device("gb200"), "FSDP").step_s
    )
    assert 0 < h200.mfu < 1 and 0 < gb200.mfu < 1


def test_both_layouts_are_costed_and_the_head_settings_move_their_items():
    from nemofp4.planning.report import cost_table

    model = get_model_config("nemotron_h_8b_paper")
    ue5m3 = get_recipe("ue5m3")
    step = dict(world_size=64, seq_len=8192, micro_batch=1, grad_accum=12, head_chunk_tokens=1024)
    fsdp = step_cost(model, ue5m3, DistributedConfig(backend="fsdp"), **step)
    assert fsdp.configured == "FSDP" and fsdp.layouts == {"FSDP": (1, 64), "HSDP 8x8": (8, 8)}
    assert "| collective | FSDP GB (configured) | HSDP 8x8 GB |" in cost_table(fsdp, None)
    hsdp = step_cost(model, ue5m3, DistributedConfig(backend="fsdp", replicate_degree=4), **step)
    assert hsdp.configured == "HSDP 4x16" and set(hsdp.layouts) == {"FSDP", "HSDP 8x8", "HSDP 4x16"}
    assert set(step_cost(model, ue5m3, DistributedConfig(backend="fsdp"), gpus_per_node=4, **step).layouts) == {
        "FSDP",
        "HSDP 16x4",
    }  # a GB200 host has 4 GPUs
    # the FP4 recipes' head is FP32: gathered in FP32 twice per micro-batch; kept gathered, once
    head = model.vocab_size * model.hidden_size
    kept = step_cost(model, ue5m3, DistributedConfig(backend="fsdp"), keep_head_gathered=True, **step)
    saved = fsdp.collectives["FSDP"]["all-gather"] - kept.collectives["FSDP"]["all-gather"]
    assert saved == pytest.approx(63 / 64 * 4 * head * 12)
    # a BF16 head gathers half the bytes and computes at the BF16 peak
    bf16 = step_cost(model, ue5m3, DistributedConfig(backend="fsdp"), head_precision="bf16", **step)
    assert fsdp.collectives["FSDP"]["all-gather"] - bf16.collectives["FSDP"]["all-gather"] == pytest.approx(
        63 / 64 * 2 * head * 2 * 12
    )
    assert (fsdp.precision["head and loss"], bf16.precision["head and loss"]) == ("fp32", "bf16")
    with pytest.raises(ValueError, match="head_precision='fp16'; valid: fp32, tf32, bf16"):
        step_cost(model, ue5m3, DistributedConfig(), head_precision="fp16", **step)


@pytest.mark.parametrize("model_name", ["llama3_8b", "nemotron_h_8b"])
def test_mfu_counts_attention_as_the_projection_runs_it_and_stays_under_one(model_name):
    # one FLOP convention: the trainer's numerator (flops_per_token) counts the causal half of attention,
    # as the projection times it, so a step at every peak reads at most 100% MFU
    from nemofp4.planning.published import llama3_8b

    model = llama3_8b() if model_name == "llama3_8b" else get_model_config(model_name)
    dist_cfg = DistributedConfig(backend="fsdp", activation_checkpointing="none")
    cost = step_cost(
        model,
        get_recipe("bf16"),
        dist_cfg,
        world_size=8,
        seq_len=8192,
        micro_batch=2,
        grad_accum=1,
        head_precision="bf16",
    )
    attention_layers = model.hybrid_layer_pattern.count("*")
    causal_half = 6 * model.num_attention_heads * model.attention_head_dim * 8192 * attention_layers * cost.tokens
    assert causal_half == pytest.approx(
        cost.flops["attention"] / 3.5 * 3 / 2
    )  # 3x the causal forward, of 3.5x the full
    for device in ("h100", "gb200"):
        assert 0 < cost.project(get_device(device), "FSDP").mfu <= 1.0


def test_the_root_groups_gathers_and_last_reduction_are_exposed():
    from nemofp4.planning.efficiency import PEAK, get_efficiency
    from nemofp4.planning.published import llama3_8b

    model = llama3_8b()
    grad_accum, ranks = 2, 8
    cost = step_cost(
        model,
        get_recipe("bf16"),
        DistributedConfig(backend="fsdp"),
        world_size=ranks,
        seq_len=1024,
        micro_batch=1,
        grad_accum=grad_accum,
        head_precision="bf16",
    )
    device = get_device("h100")
    p = cost.project(device, "FSDP", get_efficiency("achieved", "h100"))
    # the embedding and final norm, BF16 gathered before each micro-batch's first op, FP32 reduced after the last
    root = model.vocab_size * model.hidden_size + model.hidden_size
    link = device.nvlink_gb_s * 1e9 * get_efficiency("achieved", "h100").link
    ring = (ranks - 1) / ranks
    assert p.exposed_comm_s == pytest.approx(ring * root * (2 * grad_accum + 4) / link)
    assert p.step_s == pytest.approx(
        max(sum(p.compute_s.values()) + p.quant_s, p.comm_s - p.exposed_comm_s) + p.exposed_comm_s
    )
    assert cost.project(device, "FSDP", PEAK).exposed_comm_s == 0.0  # the roofline overlaps everything
