"""Kernels and elementwise bytes counted from our code path (nemofp4.planning.launches), and how the step cost
uses them: eager runs pay the counted bytes and launches, compiled runs the fused ones."""

from __future__ import annotations

import pytest

from nemofp4.models import get_model_config
from nemofp4.planning import step_cost
from nemofp4.planning.launches import count_block_launches
from nemofp4.planning.layers import linear_specs
from nemofp4.planning.published import llama3_8b
from nemofp4.planning.standins import CONV_KERNELS, SCAN_KERNELS
from nemofp4.recipes import get_recipe
from nemofp4.training.parallel import DistributedConfig


@pytest.mark.parametrize("block_type, linears", [("attention", 4), ("mlp", 2), ("mamba", 2)])
def test_a_block_launches_three_gemms_per_linear_and_fuses_its_elementwise_runs(block_type, linears):
    model = get_model_config("nemotron_h_8b_paper") if block_type == "mamba" else llama3_8b()
    counted = count_block_launches(model, block_type, micro_batch=1, seq_len=512)
    assert counted.gemm_kernels == 3 * linears  # forward, dgrad, wgrad
    assert counted.attention_kernels == (2 if block_type == "attention" else 0)  # one forward, one backward
    # mamba-ssm's scan and causal-conv1d's conv: the kernels the real ops launch
    assert counted.scan_kernels == (sum(SCAN_KERNELS) + sum(CONV_KERNELS) if block_type == "mamba" else 0)
    # fused, a run of elementwise ops is one kernel: between the other kernels and at most one more each
    fixed = counted.gemm_kernels + counted.attention_kernels + counted.scan_kernels
    assert fixed < counted.compiled_kernels <= 2 * fixed + 1 < counted.eager_kernels
    assert 0 < counted.forward_eager_elementwise_bytes < counted.eager_elementwise_bytes


def test_the_elementwise_bytes_grow_with_the_tokens_and_the_kernels_do_not():
    one = count_block_launches(llama3_8b(), "mlp", micro_batch=1, seq_len=1024)
    two = count_block_launches(llama3_8b(), "mlp", micro_batch=2, seq_len=1024)
    assert two.eager_kernels == one.eager_kernels and two.compiled_kernels == one.compiled_kernels
    # per-token tensors double; the weight-sized ones (the norm's weight cast) stay: a little under double
    assert 1.99 * one.eager_elementwise_bytes < two.eager_elementwise_bytes <= 2 * one.eager_elementwise_bytes


def test_an_eager_step_pays_more_elementwise_bytes_and_launches_than_a_compiled_one():
    step = dict(world_size=8, seq_len=1024, micro_batch=1, grad_accum=2)
    eager = step_cost(llama3_8b(), get_recipe("bf16"), DistributedConfig(backend="fsdp"), **step)
    compiled = step_cost(llama3_8b(), get_recipe("bf16"), DistributedConfig(backend="fsdp", compile=True), **step)
    assert eager.elementwise_bytes > 2 * compiled.elementwise_bytes and eager.kernels > compiled.kernels
    blocks = {t: sum(x.block_type == t for x in llama3_8b().layer_types) for t in ("attention", "mlp")}
    per_micro_batch = sum(
        n * count_block_launches(llama3_8b(), t, micro_batch=1, seq_len=1024).eager_kernels for t, n in blocks.items()
    )
    assert eager.kernels == 2 * per_micro_batch
    assert eager.flops == compiled.flops  # fusing moves bytes, not FLOPs


def _run_counted(fn):
    from nemofp4.planning.launches import _Counter

    counter = _Counter()
    with counter:
        fn()
    return [nbytes for *_, nbytes in counter.ops]


def test_an_op_reads_its_inputs_and_writes_its_outputs_as_its_schema_says():
    import torch

    a, b = (torch.empty(1000, device="meta") for _ in range(2))
    out = torch.empty(2000, device="meta")
    assert _run_counted(lambda: torch.cat([a, b])) == [16000]  # a list's tensors read, the result written
    assert _run_counted(lambda: torch.cat([a, b], out=out)) == [16000]  # out= written, not read
    assert _run_counted(lambda: a.mul_(2)) == [8000]  # in place: read and written once
    assert _run_counted(lambda: torch._foreach_mul_([a, b], 2.0)) == [16000]  # a mutated list, returning nothing
    assert _run_counted(lambda: torch._foreach_sqrt([a, b])) == [16000]
    assert _run_counted(lambda: a.view(10, 100) + 1) == [8000]  # a view launches nothing
    assert _run_counted(lambda: torch.ones(3).add_(1)) == []  # host work is no kernel


def test_the_optimizer_step_bytes_are_torchs_ops_counted():
    from nemofp4.planning.launches import ADAMW_IMPLEMENTATIONS, optimizer_step_bytes

    # per FP32 element, op by op: clip_grad_norm_'s norm (read g: 4) and scaling (g read and written: 8); AdamW's
    # decay (p: 8), lerp of m toward g (m, g read, m written: 12), v scaled (8) and addcmul'd (v, g, g read,
    # v written: 16), sqrt(v) (8), divided (8) and eps added (8) in place, addcdiv into p (p, m, denom read,
    # p written: 16)
    assert optimizer_step_bytes("foreach") == pytest.approx(12 + 8 + 12 + 8 + 16 + 8 + 8 + 8 + 16, rel=1e-5)
    assert optimizer_step_bytes("for_loop") == pytest.approx(optimizer_step_bytes("foreach"), rel=1e-5)
    # fused: one kernel reading p, g, m, v and writing the four its schema marks mutated
    assert optimizer_step_bytes("fused") == pytest.approx(12 + 16 + 16, rel=1e-5)
    with pytest.raises(ValueError, match="'adam'.*valid: foreach, for_loop, fused"):
        optimizer_step_bytes("adam")
    step = dict(world_size=8, seq_len=1024, micro_batch=1, grad_accum=1)
    costs = {
        impl: step_cost(llama3_8b(), get_recipe("bf16"), DistributedConfig(backend="fsdp"), optimizer=impl, **step)
        for impl in ADAMW_IMPLEMENTATIONS
    }
    for impl, cost in costs.items():
        assert cost.optimizer_bytes == pytest.approx(optimizer_step_bytes(impl) * llama3_8b().num_parameters() / 8)


def test_a_recomputed_block_launches_its_forward_again_and_each_quantizer_its_kernels():
    step = dict(world_size=8, seq_len=1024, micro_batch=1, grad_accum=2)
    model = llama3_8b()
    none, full = (
        step_cost(model, get_recipe("bf16"), DistributedConfig(backend="fsdp", activation_checkpointing=p), **step)
        for p in ("none", "full")
    )
    forward = sum(
        count_block_launches(model, t.block_type, micro_batch=1, seq_len=1024).forward_eager_kernels
        for t in model.layer_types
    )
    assert full.kernels - none.kernels == 2 * forward
    # Transformer Engine's current-scaling FP8: an amax kernel and a cast per quantization, four quantizations per
    # linear and micro-batch (X and W forward, W and dY backward), every linear but the head's
    fp8 = step_cost(model, get_recipe("fp8_te"), DistributedConfig(backend="fsdp"), **step)
    linears = sum(s.layer is not None for s in linear_specs(model, get_recipe("fp8_te")))
    assert fp8.kernels - none.kernels == 2 * 4 * linears * 2
