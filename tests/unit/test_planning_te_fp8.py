"""Transformer Engine's FP8 linears as the planner models them without TE (Float8CurrentScaling for
fp8_te, MXFP8BlockScaling for mxfp8_te): the copies are the emulated fp8 and mxfp8 recipes' operands
in TE's storage, the stand-in keeps what ``te.Linear`` keeps, plans run where TE is not installed, the
GEMMs are costed at the FP8 peak where the device runs the recipe and the quantizer passes as TE makes
them; and the emulated FP8 recipes' plans count one byte an element."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nemofp4.models import get_model_config
from nemofp4.planning import get_device, step_cost
from nemofp4.planning.layers import cached_weight_bytes, linear_specs
from nemofp4.planning.measure import LiveTensorBytes, measure_blocks
from nemofp4.planning.report import cost_table
from nemofp4.planning.te_linear import TELinearStandIn, te_linear_operands, te_quantizations
from nemofp4.quant import QuantLinear, set_step
from nemofp4.recipes import get_recipe, runs_in_transformer_engine
from nemofp4.training.parallel import DistributedConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS, K, N = 128, 256, 192
TE_FP8 = {"fp8_te": "fp8", "mxfp8_te": "mxfp8"}
"""TE recipe -> the emulated recipe that computes what it runs."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _emulated_operands(recipe: str):
    """(GEMM, operand position) -> (QuantizedBlocks, read transposed) of the emulated linear's GEMMs."""
    layer = QuantLinear.from_linear(nn.Linear(K, N, bias=False), get_recipe(recipe).parts["fp8"])
    layer.quant_backend = "eager"
    set_step(layer, 1)
    layer._capture = []
    layer(torch.randn(TOKENS, K, requires_grad=True)).backward(torch.randn(TOKENS, N))
    out = {}
    for name, qa, qb, b_transposed, _ in layer._capture:
        out[(name, 0)], out[(name, 1)] = (qa, False), (qb, b_transposed)
    return out


@pytest.mark.parametrize("name", list(TE_FP8))
def test_te_copies_are_the_emulated_recipes_operands_in_tes_storage(name):
    emulated = _emulated_operands(TE_FP8[name])
    te = te_linear_operands(TOKENS, K, N, get_recipe(name).parts["fp8"])
    position = {"x": 0, "w": 1, "dy_dgrad": 0, "dy_wgrad": 0, "x_wgrad": 1}
    assert sorted((op.gemm, position[op.role]) for op in te) == sorted(emulated)
    for op in te:
        q, transposed = emulated[(op.gemm, position[op.role])]
        assert (tuple(reversed(q.shape)) if transposed else tuple(q.shape)) == op.shape, op
        assert q.element_format in ("e4m3", "e5m2") and op.storage.codes_per_byte == 1, op  # a code a byte
        assert math.prod(q.padded_shape) == op.code_bytes == op.numel, op  # (the shapes divide the blocks)
        blocks = 0 if q.per_tensor else math.prod(q.padded_shape) // q.block_size
        assert blocks == op.blocks and q.block_size == (op.storage.block or q.block_size), op
        assert not (op.hadamard or op.stochastic or op.two_d), op
    assert [op.role for op in te] == ["x", "w", "dy_dgrad", "w", "dy_wgrad", "x_wgrad"]
    assert [op.role for op in te if op.saved] == ["x_wgrad"]
    assert [op.columnwise for op in te] == [False, False, False, True, True, True]


def test_per_tensor_fp8_storage_one_byte_an_element_a_scale_per_tensor_and_hoppers_transpose():
    x, w, dy, wt, dyt, xt = te_linear_operands(TOKENS, K, N, get_recipe("fp8_te").parts["fp8"])
    assert (xt.stored_shape, xt.scale_shape, xt.nbytes) == ((K, TOKENS), None, K * TOKENS + 4)  # transposed, scale_inv
    assert x.nbytes == TOKENS * K + 4 and not x.tn_only
    assert [op.tn_only for op in (x, w, dy, wt, dyt, xt)] == [False, False, False, True, True, True]


def test_mxfp8_storage_both_copies_in_the_tensors_layout_with_tes_padded_e8m0_scales():
    t, k, n = 96, 160, 192  # padding shows: 96 rows to 128, 160 / 32 = 5 scale columns to 8
    x, w, dy, wt, dyt, xt = te_linear_operands(t, k, n, get_recipe("mxfp8_te").parts["fp8"])
    assert (x.stored_shape, x.stored_scale_shape) == ((t, k), (_round_up(t, 128), _round_up(k // 32, 4)))
    # column-wise: TE's get_scale_shape(columnwise=True), [round_up(M / 32, 4), round_up(K, 128)]
    assert (xt.stored_shape, xt.stored_scale_shape) == ((t, k), (_round_up(t // 32, 4), _round_up(k, 128)))
    assert (wt.stored_shape, wt.stored_scale_shape) == ((n, k), (_round_up(n // 32, 4), _round_up(k, 128)))
    assert xt.nbytes == t * k + _round_up(t // 32, 4) * _round_up(k, 128)  # no amax
    assert not any(op.tn_only for op in (x, w, dy, wt, dyt, xt))


# nvfp4_te at N = 128: eligible for TE's fused RHT cast (rows % 64, cols % 128)
@pytest.mark.parametrize("name, n", [("nvfp4_te", 128), ("fp8_te", N), ("mxfp8_te", N)])
def test_the_standin_saves_and_allocates_what_te_linear_does(name, n):
    """Every TE recipe's stand-in: what it saves (X's column-wise copy alone; no weight copy under FSDP2)
    and its forward and backward peaks, from the copies TE makes."""
    part = next(p for p in get_recipe(name).parts.values() if runs_in_transformer_engine(p))
    x_op, w_fprop, dy_dgrad, w_dgrad, dy_wgrad, xt = te_linear_operands(TOKENS, K, n, part)
    linear = nn.Linear(K, n, bias=False, dtype=torch.bfloat16)
    module = TELinearStandIn(linear, part)
    assert module.weight is linear.weight
    x = torch.empty(TOKENS, K, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.empty(TOKENS, n, dtype=torch.bfloat16)
    tracker = LiveTensorBytes(x, linear.weight, dy)
    with tracker:
        y = module(x.clone())
        forward_peak = tracker.peak
        saved = tracker.live - y.untyped_storage().nbytes()
        tracker.peak = tracker.live
        y.backward(dy)
        backward_peak = tracker.peak - saved - y.untyped_storage().nbytes()
    assert saved == xt.nbytes  # X's column-wise copy alone; no weight copy under FSDP2
    assert forward_peak == TOKENS * K * 2 + x_op.nbytes + xt.nbytes + w_fprop.nbytes + TOKENS * n * 2
    dx, dw = TOKENS * K * 2, n * K * 2
    w_copies, dy_copies = w_fprop.nbytes + w_dgrad.nbytes, dy_dgrad.nbytes + dy_wgrad.nbytes
    assert backward_peak == max(w_copies + dy_copies + dx, dy_copies + dx + dw)


def test_the_quantizer_passes_as_te_makes_them():
    x, w_fwd, w_bwd, dy = te_quantizations(TOKENS, K, N, get_recipe("fp8_te").parts["fp8"])
    assert [c.role for c in x.copies] == ["x", "x_wgrad"] and [c.role for c in w_fwd.copies] == ["w"]
    passes = x.passes()
    # per-tensor: an amax pass and a cast pass over the BF16 tensor, writing the FP8 data and its transpose
    assert sum(p.nbytes for p in passes) == 2 * TOKENS * K * 2 + sum(c.nbytes for c in x.copies)
    assert [(p.role, p.nbytes) for p in passes if p.tn_only] == [("x_wgrad", TOKENS * K + 4)]
    assert not any(p.hadamard_flops for q in (x, w_fwd, w_bwd, dy) for p in q.passes())
    # MXFP8: no amax pass; one cast writes both copies and their scales
    mx = te_quantizations(TOKENS, K, N, get_recipe("mxfp8_te").parts["fp8"])[0]
    assert sum(p.nbytes for p in mx.passes()) == TOKENS * K * 2 + sum(c.nbytes for c in mx.copies)
    assert not any(p.tn_only for p in mx.passes())


@pytest.mark.parametrize("name", list(TE_FP8))
def test_te_fp8_is_measured_without_transformer_engine(name):
    """Each block keeps what the emulated recipe's keeps, X^T in TE's storage (and no weight, which the
    emulated 1-D FP8 weight is not either: its parameter)."""
    model, tokens = get_model_config("tiny"), 128
    te_recipe, emulated_recipe = get_recipe(name), get_recipe(TE_FP8[name])
    te, emulated = (
        measure_blocks(model, r, seq_len=tokens, micro_batch=1, dtype=torch.bfloat16)
        for r in (te_recipe, emulated_recipe)
    )
    part, emulated_xt = te_recipe.parts["fp8"], emulated_recipe.parts["fp8"].x_wgrad
    specs = linear_specs(model, te_recipe)
    assert te and all(block.quantized_linears for block in te)
    for te_block, emu_block in zip(te, emulated, strict=True):
        assert (te_block.kind, te_block.layers, te_block.quantized_linears) == (
            emu_block.kind,
            emu_block.layers,
            emu_block.quantized_linears,
        )
        difference = 0
        for s in (s for s in specs if s.layer == te_block.layers[0]):
            k, n = s.in_features, s.out_features
            scales = 0 if emulated_xt.format.per_tensor else k * tokens // emulated_xt.block_size
            difference += k * tokens + scales + 8 - te_linear_operands(tokens, k, n, part)[-1].nbytes
        # to a few bytes per linear: what the emulated linear's own state creates in forward (its amaxes)
        assert 0 <= emu_block.saved_bytes - te_block.saved_bytes - difference <= 8 * te_block.quantized_linears


@pytest.mark.parametrize("name, device", [("fp8_te", "h100"), ("mxfp8_te", "b200")])
def test_nemofp4_plan_plans_the_te_fp8_recipes_without_te(name, device):
    from nemofp4.cli.plan import plan_report
    from nemofp4.cli.train import compose_job_config

    job = compose_job_config(["experiment=tiny_fp8", f"precision={name}", "train.seq_len=128", "train.micro_batch=4"])
    report = plan_report(job, world_size=2, device=device)
    te_class = get_recipe(name).parts["fp8"].te_recipe
    assert f"| linear GEMMs | 0.0 | FP8 (Transformer Engine's {te_class}, 100%) where the device runs it" in report
    assert "does not run Transformer Engine" not in report and "fits" in report


def test_the_cost_says_where_a_device_does_not_run_the_recipe():
    model = get_model_config("tiny")
    dist_cfg = DistributedConfig(backend="fsdp", activation_checkpointing="none")
    step = dict(world_size=2, seq_len=128, micro_batch=1, grad_accum=2)
    mx, fp8 = (step_cost(model, get_recipe(r), dist_cfg, **step) for r in ("mxfp8_te", "fp8_te"))
    assert "H100 SXM5 80GB does not run Transformer Engine's MXFP8BlockScaling, which needs MXFP8 tensor cores" in (
        cost_table(mx, get_device("h100"))
    )
    assert "does not run" not in cost_table(mx, get_device("b200")) + cost_table(fp8, get_device("h100"))


@pytest.mark.parametrize("device", ["h100", "h200", "b200", "gb200"])
def test_te_fp8_gemms_run_at_the_fp8_peak_where_the_device_runs_the_recipe(device):
    model = get_model_config("nemotron_h_8b_paper")
    dist_cfg = DistributedConfig(backend="fsdp", activation_checkpointing="full")
    step = dict(world_size=64, seq_len=8192, micro_batch=1, grad_accum=2, head_chunk_tokens=1024)
    d = get_device(device)
    bf16 = step_cost(model, get_recipe("bf16"), dist_cfg, **step).project(d, "FSDP").compute_s
    fp8_peak = d.bf16_tflops / d.fp8_tflops
    for name in TE_FP8:
        cost, te_class = step_cost(model, get_recipe(name), dist_cfg, **step), get_recipe(name).parts["fp8"].te_recipe
        linear = cost.flops["linear GEMMs"]
        assert cost.native_flops["linear GEMMs"] == {te_class: linear}  # every linear GEMM of the blocks
        assert cost.native_flops["recompute"][te_class] == pytest.approx(linear / 3)  # and their forward, again
        te = cost.project(d, "FSDP").compute_s
        ratio = fp8_peak if d.runs(te_class) else 1.0  # MXFP8 on Hopper: the BF16 peak
        assert te["linear GEMMs"] == pytest.approx(bf16["linear GEMMs"] * ratio)
        saved = (bf16["recompute"] - te["recompute"]) * d.matmul_tflops("bf16") * 1e12
        assert saved == pytest.approx(linear / 3 * (1 - ratio))
        assert cost.fp4_native_flops == 0 and cost.quantized_elements == 0
    assert d.runs("Float8CurrentScaling") and d.runs("MXFP8BlockScaling") == (device in ("b200", "gb200"))


def test_the_transposes_are_costed_where_fp8_gemms_are_tn_only():
    model = get_model_config("nemotron_h_8b_paper")
    dist_cfg = DistributedConfig(backend="fsdp", activation_checkpointing="none")
    cost = step_cost(model, get_recipe("fp8_te"), dist_cfg, world_size=64, seq_len=8192, micro_batch=1, grad_accum=2)
    transposes = [p for p in cost.quant_passes if p.tn_only]
    assert {p.role for p in transposes} == {"w", "dy_wgrad", "x_wgrad"}
    h100, b200 = get_device("h100"), get_device("b200")
    assert all(p.seconds(h100) > 0 and p.seconds(b200) == 0 for p in transposes)
    assert not h100.fp8_gemm_any_layout and b200.fp8_gemm_any_layout
    written = sum(p.count * p.nbytes for p in transposes) / 1e9
    traffic = {
        d.name: float(cost_table(cost, d).split(" GB of HBM traffic")[0].rsplit("| ", 1)[1].replace(",", ""))
        for d in (h100, b200)
    }
    assert traffic[h100.name] - traffic[b200.name] == pytest.approx(written, abs=0.1)
    assert {p.role for p in cost.quant_passes} == {"x", "w", "dy_dgrad", "dy_wgrad", "x_wgrad"}


# ------------------------------------------------------------------------------------ the emulated FP8 recipes
@pytest.mark.parametrize("recipe", ["fp8", "mxfp8"])
def test_emulated_fp8_plans_count_one_byte_an_element(recipe):
    """The Triton path a CUDA run takes measures what the torch program keeps (the kernels have no FP8;
    the saves themselves are held to TE's above), the weight cache holds a byte a code, and the
    quantizer's traffic counts it."""
    model, tokens = get_model_config("tiny"), 64
    r = get_recipe(recipe)
    triton, eager = (
        measure_blocks(model, r, seq_len=tokens, micro_batch=1, dtype=torch.bfloat16, quantizer=q)
        for q in ("triton", "eager")
    )
    assert [b.saved_bytes for b in triton] == [b.saved_bytes for b in eager]
    op = r.parts["fp8"].w
    for s in linear_specs(model, r):
        if s.kind == "fp4":
            n, k = s.out_features, s.in_features
            scales = 0 if op.format.per_tensor else n * math.ceil(k / op.block_size)
            assert cached_weight_bytes(s)[0] == n * _round_up(k, op.block_size) + scales + 8
    cost = step_cost(
        model,
        r,
        DistributedConfig(activation_checkpointing="none"),
        world_size=1,
        seq_len=tokens,
        micro_batch=1,
        grad_accum=1,
    )
    assert all(p.nbytes == p.elements * 13.0 for p in cost.quant_passes)  # 12.5 for an FP4 operand
