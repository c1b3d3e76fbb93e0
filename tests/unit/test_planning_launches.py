"""Kernels and elementwise bytes counted from our code path (nemofp4.planning.launches), and how the step cost
uses them: eager runs pay the counted bytes and launches, compiled runs the fused ones."""

from __future__ import annotations

import pytest

from nemofp4.models import get_model_config
from nemofp4.planning import step_cost
from nemofp4.planning.launches import count_block_launches
from nemofp4.planning.published import llama3_8b
from nemofp4.recipes import get_recipe
from nemofp4.training.parallel import DistributedConfig


@pytest.mark.parametrize("block_type, linears", [("attention", 4), ("mlp", 2), ("mamba", 2)])
def test_a_block_launches_three_gemms_per_linear_and_fuses_its_elementwise_runs(block_type, linears):
    model = get_model_config("nemotron_h_8b_paper") if block_type == "mamba" else llama3_8b()
    counted = count_block_launches(model, block_type, micro_batch=1, seq_len=512)
    assert counted.gemm_kernels == 3 * linears  # forward, dgrad, wgrad
    assert counted.attention_kernels == (2 if block_type == "attention" else 0)  # one forward, one backward
    # fused, a run of elementwise ops is one kernel: between the GEMM and attention kernels and at most one more each
    fixed = counted.gemm_kernels + counted.attention_kernels
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
