"""DeepSpeed ZeRO (stages 1-3) as an alternative to FSDP2.

DeepSpeed owns gradient accumulation, clipping, the optimizer step and its own checkpoint
format; the trainer keeps everything else (data, schedule, quantizer references, RNG, metrics) and
nests DeepSpeed's checkpoint inside its own atomic step folder (`step-<N>/deepspeed/`), so the
marker, `latest` pointer and `resume=auto` behave exactly as with FSDP2. DeepSpeed checkpoints
resume on the same number of ranks (DeepSpeed's universal-checkpoint conversion is needed to
change it); FSDP2 checkpoints reshard freely.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nemofp4.quant import without_quant_state

DS_SUBDIR = "deepspeed"
DS_TAG = "state"


def zero_stage(backend: str) -> int:
    return int(backend.removeprefix("deepspeed_zero"))


def deepspeed_config(*, stage: int, micro_batch: int, grad_accum: int, world_size: int, grad_clip: float,
                     bf16: bool) -> dict[str, Any]:
    return {
        "train_batch_size": micro_batch * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        # FP32 gradient reduction, as with FSDP2
        "communication_data_type": "fp32",
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]):
    """Wrap model and optimizer in a DeepSpeed engine (CPU runs use DeepSpeed's CPU accelerator)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as err:
        raise ValueError(
            "distributed.backend=deepspeed_zero* needs DeepSpeed: pip install -e '.[deepspeed]'"
        ) from err
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def save(engine, folder: Path) -> None:
    engine.save_checkpoint(str(folder / DS_SUBDIR), tag=DS_TAG, save_latest=False)


def load(engine, folder: Path) -> None:
    path, _ = engine.load_checkpoint(str(folder / DS_SUBDIR), tag=DS_TAG, load_optimizer_states=True,
                                     load_lr_scheduler_states=False)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed state under {folder / DS_SUBDIR}")


def full_model_state_dict(engine) -> dict[str, torch.Tensor]:
    """The unpartitioned FP32 model weights (gathered on every rank for ZeRO-3), without held references."""
    gathered = contextlib.nullcontext()
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    with gathered:
        return {k: v.detach().clone() for k, v in without_quant_state(engine.module.state_dict()).items()}
