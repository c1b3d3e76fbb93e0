"""No host sync in a training step: a complete step of every recipe runs under FakeTensorMode, which
raises on any data-dependent host read (``.item()``, ``bool(t)``, ``int(t.max())``, ``.tolist()``),
so a new read in the quantization path fails here. On a GPU the same check is
``torch.cuda.set_sync_debug_mode("error")`` (docs/gpu.md).

The step is the trainer's: the reference schedule set for the step, statistics collected (a logging
step), forward and backward of two micro-batches (the first samples the held references, the second
holds them; one micro-batch for current scaling), gradient clipping and the AdamW step: the whole
model once; each recipe's quantization (on two MLP blocks: the last is the BF16 tail of the recipes
that keep one) on the Triton kernels' glue, what CUDA runs take, the kernels by their fake
implementations; two recipes on the eager torch program. The
formats' lookup tables are built once per device from host data before the first step (they are
cached), so they are warmed on real tensors first.
"""

from __future__ import annotations

import pytest
import torch

from nemofp4.models import build_model, get_model_config, lm_loss, param_groups
from nemofp4.planning.measure import fake_run, warm_format_tables
from nemofp4.quant import LinearQuantConfig, set_quant_backend, set_quant_stats, set_step
from nemofp4.recipes import apply_recipe, get_recipe, list_recipes
from nemofp4.training.optim import OptimConfig, build_optimizer
from nemofp4.training.parallel import DistributedConfig, parallelize

NATIVE = {name for name in list_recipes() if get_recipe(name).needs_transformer_engine}
"""Transformer Engine's own kernels: not our quantization path, and no TE on CPU."""


def _holds_references(recipe) -> bool:
    return any(
        isinstance(p, LinearQuantConfig) and any(p.reference_interval(r) for r in p.reference_roles())
        for p in recipe.parts.values()
    )


def _step(
    recipe_name: str, quantizer: str, head_chunk_tokens: int, checkpointing: str = "none", pattern: str = "--"
) -> None:
    recipe = get_recipe(recipe_name)
    warm_format_tables(recipe)
    model = build_model(get_model_config("tiny", vocab_size=512, hybrid_layer_pattern=pattern), device="meta")
    apply_recipe(model, recipe, log=False)
    set_quant_backend(model, quantizer)
    parallelize(model, DistributedConfig(activation_checkpointing=checkpointing), device_type="cpu")
    with fake_run(quantizer=quantizer, mamba_ssm=False):
        model.to_empty(device="cpu")
        optimizer = build_optimizer(OptimConfig(), param_groups(model, 0.1))
        set_step(model, 1, seed=0, rank=0)
        set_quant_stats(model, True)
        optimizer.zero_grad(set_to_none=True)
        for _ in range(
            2 if _holds_references(recipe) else 1
        ):  # the first samples held references, the second holds them
            ids = torch.zeros(2, 64, dtype=torch.long)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(model, ids, ids, head_chunk_tokens=head_chunk_tokens)
            (loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def test_the_model_and_the_step_read_nothing_from_the_device():
    """Every block type, a checkpointed block's recompute, the chunked head loss, clipping, AdamW."""
    _step("ue5m3", "triton", head_chunk_tokens=32, checkpointing="mlp", pattern="M*-")


@pytest.mark.parametrize("recipe_name", sorted(set(list_recipes()) - NATIVE))
def test_a_training_step_of_every_recipe_reads_nothing_from_the_device(recipe_name):
    """Each recipe's quantization on the CUDA path (the Triton kernels' glue), the head's full logits."""
    _step(recipe_name, "triton", head_chunk_tokens=0)


@pytest.mark.parametrize("recipe_name", ["nvfp4", "ue5m3"])
def test_the_torch_quantization_program_reads_nothing_from_the_device(recipe_name):
    """The eager program (CPU runs; CUDA's ``kernels=compiled`` is the same program fused): the
    Hadamard transform, stochastic rounding and 2-D tiles (nvfp4), held references (ue5m3)."""
    _step(recipe_name, "eager", head_chunk_tokens=0)


def test_a_host_read_in_the_step_would_fail_here():
    """The check can fail: a ``bool(tensor)`` in the step raises under FakeTensorMode."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with fake_run(quantizer="eager", mamba_ssm=False), pytest.raises(DataDependentOutputException):
        bool(torch.isfinite(torch.zeros(())))
