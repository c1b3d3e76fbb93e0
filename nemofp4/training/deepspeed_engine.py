"""DeepSpeed ZeRO (stages 1-3) as an alternative to FSDP2: :class:`DeepSpeedEngine`, the
:class:`~nemofp4.training.engine.TrainEngine` that wraps DeepSpeed's engine, its configuration and its
checkpoint files.

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
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nemofp4.quant import without_quant_state
from nemofp4.training.nonfinite import finite_loss_and_norm
from nemofp4.training.optim import set_lr

__all__ = ["DeepSpeedEngine", "deepspeed_config", "zero_stage"]

DS_SUBDIR = "deepspeed"
DS_TAG = "state"


class DeepSpeedEngine:
    """DeepSpeed ZeRO behind the trainer's engine protocol. DeepSpeed scales each micro-batch's loss by
    1/grad_accum, accumulates, reduces at its accumulation boundary, and its ``step()`` there is fused:
    it measures the gradient norm, clips, updates and zeroes the gradients in one call, so the norm the
    trainer reads is the one DeepSpeed measured before its update, and a non-finite step has already
    been applied when it is read (``train.nonfinite=skip`` is refused; ``stop`` stops after it)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any], *, grad_accum: int):
        self.model = model
        self.forward = self._engine = initialize(model, optimizer, config)
        self._grad_accum = grad_accum

    def begin_step(self, lr: float) -> None:
        """The learning rate only: DeepSpeed's boundary step zeroed the gradients."""
        set_lr(self._engine.optimizer, lr)

    def forward_backward(
        self, loss_of: Callable[[Callable[..., Any]], torch.Tensor], *, micro_batch: int
    ) -> torch.Tensor:
        """DeepSpeed's backward (it scales by 1/grad_accum itself); before the last micro-batch, its
        ``step()`` too, which there only counts the micro-batch (DeepSpeed finds its accumulation boundary
        by that count), so the last micro-batch's backward is the boundary's, which reduces."""
        loss = loss_of(self.forward)
        self._engine.backward(loss)
        if micro_batch < self._grad_accum - 1:
            self._engine.step()
        return loss

    def finish_step(
        self, loss: torch.Tensor, *, sync_free: Callable[[], AbstractContextManager]
    ) -> tuple[torch.Tensor, bool]:
        """DeepSpeed's fused boundary step (norm, clipping, update, zeroing), then the norm it measured
        before its update, and whether it and ``loss`` are finite."""
        assert self._engine.is_gradient_accumulation_boundary(), "DeepSpeed's micro-batch count left the step's"
        with sync_free():
            self._engine.step()
        grad_norm = torch.as_tensor(float(self._engine.get_global_grad_norm()))
        return grad_norm, finite_loss_and_norm(loss, grad_norm)

    def write_collective(self, folder: Path) -> None:
        save(self._engine, folder)

    def read_collective(self, folder: Path) -> None:
        load(self._engine, folder)

    def dcp_state(self) -> dict[str, Any]:
        return {}  # DeepSpeed writes model and optimizer in its own format

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        pass

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in full_model_state_dict(self._engine).items()}


def zero_stage(backend: str) -> int:
    return int(backend.removeprefix("deepspeed_zero"))


def deepspeed_config(
    *, stage: int, micro_batch: int, grad_accum: int, world_size: int, grad_clip: float, bf16: bool
) -> dict[str, Any]:
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
        raise ValueError("distributed.backend=deepspeed_zero* needs DeepSpeed: pip install -e '.[deepspeed]'") from err
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def save(engine, folder: Path) -> None:
    engine.save_checkpoint(str(folder / DS_SUBDIR), tag=DS_TAG, save_latest=False)


def load(engine, folder: Path) -> None:
    path, _ = engine.load_checkpoint(
        str(folder / DS_SUBDIR), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
    )
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
