"""The achieved-efficiency model of the step cost: the GEMM curve between its measured points, the roofline
as the lower bound it is, the terms only achieved efficiency adds, and the DDP layout."""

from __future__ import annotations

import pytest

from nemofp4.models import get_model_config
from nemofp4.planning import get_device, step_cost
from nemofp4.planning.devices import DEVICES
from nemofp4.planning.efficiency import ACHIEVED, PEAK, SOURCES, get_efficiency
from nemofp4.planning.published import llama3_8b
from nemofp4.recipes import get_recipe
from nemofp4.training.parallel import DistributedConfig

H100 = ACHIEVED["h100"]


def test_the_gemm_curve_passes_through_its_measured_points_and_rises_with_size():
    for side, fraction in H100.gemm:
        assert H100.gemm_fraction(side, side, side) == pytest.approx(fraction)
    sizes = [256, 512, 1024, 1500, 2048, 3000, 4096, 6000, 8192, 16384, 65536]
    fractions = [H100.gemm_fraction(s, s, s) for s in sizes]
    assert fractions == sorted(fractions) and fractions[-1] == H100.gemm[-1][1]  # flat beyond the last point
    assert H100.gemm_fraction(512, 512, 512) == pytest.approx(H100.gemm[0][1] / 2)  # fixed cost below the first
    # a GEMM is placed by its FLOPs' cube root: a long thin one sits with the square one of the same FLOPs
    assert H100.gemm_fraction(8192, 1024, 4096) == pytest.approx(H100.gemm_fraction(4096, 4096, 2048))
    assert get_efficiency("peak", "h100") is PEAK
    with pytest.raises(ValueError):
        get_efficiency("optimistic", "h100")


@pytest.fixture(scope="module")
def cost_8b():
    model = get_model_config("nemotron_h_8b_paper")
    dist_cfg = DistributedConfig(backend="fsdp", activation_checkpointing="full")
    return step_cost(
        model,
        get_recipe("ue5m3"),
        dist_cfg,
        world_size=64,
        seq_len=8192,
        micro_batch=1,
        grad_accum=12,
        head_chunk_tokens=1024,
    )


@pytest.mark.parametrize("device", ["h100", "h200", "h100_hbm2e_500w", "b200", "gb200"])
def test_the_roofline_is_a_lower_bound_and_only_achieved_efficiency_adds_its_terms(cost_8b, device):
    dev = get_device(device)
    peak = cost_8b.project(dev, "FSDP", PEAK)
    achieved = cost_8b.project(dev, "FSDP", get_efficiency("achieved", device))
    assert achieved.step_s > peak.step_s and achieved.mfu < peak.mfu <= 1
    extra = {"elementwise", "optimizer", "kernel launches"}
    assert not extra & set(peak.compute_s) and extra <= set(achieved.compute_s)
    for name, seconds in peak.compute_s.items():  # every kernel class slower than at its peak, none faster
        assert achieved.compute_s[name] >= seconds, name
    assert achieved.comm_s > peak.comm_s  # links at their measured fraction


def test_ddp_replicates_without_sharding(cost_8b):
    model = get_model_config("nemotron_h_8b_paper")
    step = dict(world_size=8, seq_len=4096, micro_batch=1, grad_accum=4, head_chunk_tokens=1024)
    ddp = step_cost(model, get_recipe("bf16"), DistributedConfig(backend="fsdp", replicate_degree=8), **step)
    fsdp = step_cost(model, get_recipe("bf16"), DistributedConfig(backend="fsdp"), **step)
    assert ddp.configured == "DDP" and "DDP" in ddp.layouts and "DDP" not in fsdp.layouts
    wire = ddp.collectives["DDP"]
    assert wire["all-gather"] == 0 and wire["reduce-scatter"] == 0 and wire["all-reduce"] > 0
    # each rank keeps the whole optimizer state: eight times the sharded one's traffic
    assert ddp.optimizer_bytes == pytest.approx(8 * fsdp.optimizer_bytes)


def test_every_preset_has_its_efficiencies_and_the_blackwells_their_own_measurements():
    assert set(ACHIEVED) == set(DEVICES)
    for name in ("b200", "gb200"):
        blackwell = ACHIEVED[name]
        assert blackwell.attention != H100.attention and blackwell.link != H100.link
        assert blackwell.gemm_fp8 is not None and blackwell.gemm_fp4 is not None
    assert ACHIEVED["b200"].gemm != H100.gemm
    # each measured curve passes through its points, in its own precision; without one, BF16's is used
    gb200 = ACHIEVED["gb200"]
    for side, fraction in gb200.gemm_fp8:
        assert gb200.gemm_fraction(side, side, side, "fp8") == pytest.approx(fraction)
    assert H100.gemm_fp8 is None and H100.gemm_fraction(4096, 4096, 4096, "fp8") == H100.gemm_fraction(4096, 4096, 4096)
    assert gb200.gemm_fraction(8192, 8192, 8192, "tf32") == gb200.gemm_fraction(8192, 8192, 8192)
    # the 500 W H100 reaches less of the SXM5's peak than the 700 W one at the sizes it was measured
    assert ACHIEVED["h100_hbm2e_500w"].gemm_fraction(8192, 8192, 8192) < H100.gemm_fraction(8192, 8192, 8192)
    assert all(len(row) == 3 and row[1] for row in SOURCES)


def test_te_gemms_run_at_their_precisions_measured_fraction():
    step = dict(world_size=8, seq_len=8192, micro_batch=2, grad_accum=1, head_precision="bf16")
    fp8 = step_cost(llama3_8b(), get_recipe("fp8_te"), DistributedConfig(backend="fsdp", compile=True), **step)
    gb200, eff = get_device("gb200"), ACHIEVED["gb200"]
    native = fp8.native_flops["linear GEMMs"]["Float8CurrentScaling"]
    expected = native / (gb200.fp8_tflops * 1e12 * fp8.linear_fraction(eff, "fp8"))
    assert fp8.project(gb200, "FSDP", eff).compute_s["linear GEMMs"] == pytest.approx(expected)
    assert fp8.linear_fraction(eff, "fp8") != fp8.linear_fraction(eff, "bf16")


def test_op_level_recompute_adds_its_share_of_each_named_linears_forward():
    model = llama3_8b()
    step = dict(world_size=8, seq_len=1024, micro_batch=1, grad_accum=3)
    plain = step_cost(model, get_recipe("bf16"), DistributedConfig(backend="fsdp"), **step)
    sac = step_cost(
        model,
        get_recipe("bf16"),
        DistributedConfig(backend="fsdp"),
        **step,
        recompute_linears=(("k_proj", 1.0), ("gate_up_proj", 0.5)),
    )
    d, kv, f = model.hidden_size, model.num_key_value_heads * model.attention_head_dim, model.ffn_hidden_size
    per_layer = 2 * 1024 * (d * kv + 0.5 * d * 2 * f)  # forward FLOPs of k_proj and half of gate_up_proj
    assert sac.flops["recompute"] - plain.flops["recompute"] == pytest.approx(3 * 32 * per_layer)
    assert sac.elementwise_bytes > plain.elementwise_bytes  # the forward's elementwise ops run again
    # a block the policy recomputes whole is not counted again by the op-level policy
    full = DistributedConfig(backend="fsdp", activation_checkpointing="full")
    assert step_cost(model, get_recipe("bf16"), full, **step, recompute_linears=(("k_proj", 1.0),)).flops == (
        step_cost(model, get_recipe("bf16"), full, **step).flops
    )
    first = step_cost(model, get_recipe("bf16"), DistributedConfig(backend="fsdp"), **step, recompute_blocks=(0, 1))
    assert 0 < first.flops["recompute"] < sac.flops["recompute"]
