"""Parallelization applied to a model from outside: activation checkpointing -> compile -> FSDP2.

The model code is single-device; this module wraps each block, then the root, in that order
(after the precision recipe has swapped its linears, before weights are materialized).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from nemofp4.quant import FP32Linear

log = logging.getLogger("nemofp4")

BACKENDS = ("none", "fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True)
class DistributedConfig:
    """How the model is spread over processes."""

    backend: str = "none"
    """none (one process, or replicated data parallel when launched on several), fsdp (FSDP2
    fully_shard per block, then the root), deepspeed_zero{1,2,3}."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""
    compile: bool = False
    """torch.compile each block."""
    param_dtype: str = "bfloat16"
    """FSDP2 compute dtype of parameters on GPU (CPU runs always compute in float32)."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduce-scatter / all-reduce."""
    reshard_after_forward: bool = True
    init_full_model: bool = True
    """Materialize and initialize the whole model on every rank before sharding, so a run's initial
    weights do not depend on the number of ranks. Turn off for models that do not fit one device
    (they are then initialized shard by shard)."""
    reduce_references: bool = True
    """All-reduce (max) the quantizers' sampled tensor references across data-parallel ranks, so
    every rank holds the same reference."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"distributed.backend={self.backend!r}; valid: {BACKENDS}")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"distributed.{name}={getattr(self, name)!r}; valid: {tuple(_DTYPES)}")


def apply_activation_checkpointing(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=True)
    log.info("activation checkpointing: %d blocks recompute in backward", len(model.layers))


def apply_compile(model: nn.Module) -> None:
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, fullgraph=False)


def apply_fsdp(model: nn.Module, cfg: DistributedConfig, *, device_type: str) -> None:
    """FSDP2 per block, then the root. Mixed precision applies on GPU only: CPU runs keep float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),), mesh_dim_names=("dp",))
    if device_type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=_DTYPES[cfg.param_dtype], reduce_dtype=_DTYPES[cfg.reduce_dtype])
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    if isinstance(getattr(model, "lm_head", None), FP32Linear):
        # the FP4 recipes run the LM head in FP32: its own group keeps FSDP from casting it to BF16
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        fully_shard(model.lm_head, mesh=mesh, mp_policy=fp32, reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)


def parallelize(model: nn.Module, cfg: DistributedConfig, *, device_type: str) -> nn.Module:
    """Apply AC, compile and FSDP2 as configured; returns the model (wrapped in place)."""
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.compile:
        apply_compile(model)
    if cfg.backend == "fsdp":
        apply_fsdp(model, cfg, device_type=device_type)
    return model
