"""The engine of a training step: what runs forward and backward, accumulates, synchronizes, clips and
steps, and owns model and optimizer state.

Two engines stand behind one protocol, :class:`TrainEngine`, so the trainer's step reads the same for
both; what each does in each call is stated here, per method:

- :class:`TorchEngine` (one process, replicated data parallel or FSDP2): plain autograd; gradients
  accumulate in the parameters over the micro-batches, and under FSDP2 with
  ``distributed.gradient_sync=per_step`` only the last micro-batch's backward reduces them (the toggle
  is set inside :meth:`~TrainEngine.forward_backward`); ``clip_grad_norm_`` then the optimizer's
  ``step``, only when loss and gradient norm are finite; model and optimizer state through DCP.
- :class:`~nemofp4.training.deepspeed_engine.DeepSpeedEngine` (ZeRO 1-3,
  ``training/deepspeed_engine.py``): DeepSpeed scales, accumulates and reduces, and its step at the
  accumulation boundary is fused: it measures the gradient norm, clips, updates and zeroes in one call,
  before the trainer can read the norm; model and optimizer state in its own checkpoint format.

:func:`build_engine` picks one from ``distributed.backend`` (:func:`~nemofp4.training.parallel.engine_kind`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from nemofp4.quant import without_quant_state
from nemofp4.training import deepspeed_engine
from nemofp4.training.deepspeed_engine import DeepSpeedEngine
from nemofp4.training.nonfinite import finite_loss_and_norm
from nemofp4.training.optim import set_lr
from nemofp4.training.parallel import DistributedConfig, set_gradient_sync

if TYPE_CHECKING:
    from nemofp4.training.config import JobConfig

__all__ = ["LossOf", "SyncFree", "TorchEngine", "TrainEngine", "build_engine"]

log = logging.getLogger("nemofp4")

LossOf = Callable[[Callable[..., Any]], torch.Tensor]
"""A micro-batch's mean loss, given what to call as the model (:attr:`TrainEngine.forward`)."""
SyncFree = Callable[[], AbstractContextManager]
"""A context around work that must not synchronize with the host (the trainer's ``train.sync_debug``)."""


class TrainEngine(Protocol):
    """One training step, whichever library runs it: :meth:`begin_step`, then :meth:`forward_backward`
    once per micro-batch, then :meth:`finish_step`; and the state a checkpoint keeps."""

    model: nn.Module
    """The model (its parameters, quantizers and evaluation forward)."""
    forward: Callable[..., Any]
    """What a training micro-batch calls: the model, or the engine that wraps it."""
    write_collective: Callable[[Path], None] | None
    """Writes state the engine keeps outside DCP into a checkpoint folder, on every rank (None: none)."""
    read_collective: Callable[[Path], None] | None
    """Reads it back from a checkpoint folder, on every rank (None: none)."""

    def begin_step(self, lr: float) -> None:
        """Before the first micro-batch: the step's learning rate; no gradient left from the last step."""

    def forward_backward(self, loss_of: LossOf, *, micro_batch: int) -> torch.Tensor:
        """Micro-batch ``micro_batch`` (0-based) of the step: its loss (``loss_of(self.forward)``, returned)
        and the backward of this rank's share of the step's mean loss, accumulated into the gradients,
        which are reduced over the data-parallel ranks by the last micro-batch's backward."""

    def finish_step(self, loss: torch.Tensor, *, sync_free: SyncFree) -> tuple[torch.Tensor, bool]:
        """After the last micro-batch: ``(grad_norm, finite)``, the global gradient norm before clipping
        to ``train.grad_clip`` and whether it and the step's mean ``loss`` are finite (the step's one host
        read); the optimizer update, which each engine says it makes or skips."""

    def dcp_state(self) -> dict[str, Any]:
        """Model and optimizer state for DCP (empty when the engine writes its own)."""

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        """Apply what DCP loaded into :meth:`dcp_state`'s entries."""

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded FP32 weights on CPU, without held references (collective under FSDP2 / ZeRO-3)."""


class TorchEngine:
    """Plain autograd and a torch optimizer: one process, replicated data parallel or FSDP2."""

    write_collective = None
    read_collective = None

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        distributed: DistributedConfig,
        grad_accum: int,
        world_size: int,
        grad_clip: float,
    ):
        self.model = self.forward = model
        self.optimizer = optimizer
        self._distributed = distributed
        self._grad_accum = grad_accum
        # this rank's share of the global mean loss (FSDP sums gradients over ranks): dY, and so the held
        # dY references, do not depend on how the batch is split over ranks
        self._loss_divisor = grad_accum * world_size
        self._max_norm = grad_clip if grad_clip > 0 else float("inf")

    def begin_step(self, lr: float) -> None:
        """The learning rate, and the gradients of the last step dropped (kept until now: a non-finite
        step's report reads them)."""
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, loss_of: LossOf, *, micro_batch: int) -> torch.Tensor:
        """Autograd accumulates into the parameters' gradients; under FSDP2 with
        ``gradient_sync=per_step`` the reduce-scatter is switched on, before the forward, only for the
        last micro-batch (:func:`~nemofp4.training.parallel.set_gradient_sync`)."""
        set_gradient_sync(self.model, self._distributed, micro_batch=micro_batch, grad_accum=self._grad_accum)
        loss = loss_of(self.forward)
        (loss / self._loss_divisor).backward()
        return loss

    def finish_step(self, loss: torch.Tensor, *, sync_free: SyncFree) -> tuple[torch.Tensor, bool]:
        """Clip, read loss and norm, and step the optimizer only when both are finite (a non-finite step
        changes no weight: the trainer's ``train.nonfinite`` policy skips it or stops)."""
        with sync_free():
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._max_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        finite = finite_loss_and_norm(loss, grad_norm)
        if finite:
            with sync_free():
                self.optimizer.step()
        return grad_norm, finite

    def dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return without_quant_state(state)  # the weights alone: held references are not weights


def build_engine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: JobConfig,
    *,
    grad_accum: int,
    world_size: int,
    device_type: str,
    rank: int,
) -> TrainEngine:
    """The engine of ``cfg.distributed.backend`` (:attr:`~nemofp4.training.parallel.DistributedConfig.engine`),
    refusing the settings it cannot honour."""
    dist_cfg = cfg.distributed
    if dist_cfg.engine != "deepspeed":
        return TorchEngine(
            model,
            optimizer,
            distributed=dist_cfg,
            grad_accum=grad_accum,
            world_size=world_size,
            grad_clip=cfg.train.grad_clip,
        )
    if cfg.train.nonfinite == "skip":
        raise ValueError(
            "train.nonfinite=skip is not supported with DeepSpeed (its step cannot be "
            "undone after the fact); use train.nonfinite=stop"
        )
    if cfg.checkpoint.async_save and rank == 0:
        log.warning(
            "checkpoint.async_save=true has no effect with distributed.backend=%s: DeepSpeed writes "
            "its checkpoints synchronously",
            dist_cfg.backend,
        )
    config = deepspeed_engine.deepspeed_config(
        stage=deepspeed_engine.zero_stage(dist_cfg.backend),
        micro_batch=cfg.train.micro_batch,
        grad_accum=grad_accum,
        world_size=world_size,
        grad_clip=cfg.train.grad_clip,
        bf16=cfg.train.dtype == "bfloat16" and device_type == "cuda",
    )
    return DeepSpeedEngine(model, optimizer, config, grad_accum=grad_accum)
