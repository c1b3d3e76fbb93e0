"""The engine of a training step: what runs backward, clips and steps, and owns model and optimizer state.

Two engines stand behind one small protocol, :class:`TrainEngine`, so the trainer's step reads the
same for both: :class:`TorchEngine` (one process, replicated data parallel or FSDP2: plain
autograd, ``clip_grad_norm_``, the optimizer's ``step``; model and optimizer state through DCP) and
:class:`DeepSpeedEngine` (ZeRO 1-3: DeepSpeed's engine scales, accumulates, clips and steps at the
accumulation boundary, and writes its own checkpoint format inside the step folder;
``deepspeed_engine.py`` holds its configuration and file layout). :func:`build_engine` picks one
from ``distributed.backend`` (:func:`~nemofp4.training.parallel.engine_kind`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from nemofp4.quant import without_quant_state
from nemofp4.training import deepspeed_engine
from nemofp4.training.optim import set_lr

if TYPE_CHECKING:
    from nemofp4.training.config import JobConfig

__all__ = ["DeepSpeedEngine", "TorchEngine", "TrainEngine", "build_engine"]

log = logging.getLogger("nemofp4")


class TrainEngine(Protocol):
    """Forward, backward, step and state of one training step, whichever library runs them."""

    model: nn.Module
    """The model (its parameters, quantizers and evaluation forward)."""
    forward: Callable[..., Any]
    """What a training micro-batch calls: the model, or the engine that wraps it."""
    write_collective: Callable[[Path], None] | None
    """Writes state the engine keeps outside DCP into a checkpoint folder, on every rank (None: none)."""
    read_collective: Callable[[Path], None] | None
    """Reads it back from a checkpoint folder, on every rank (None: none)."""

    def set_lr(self, lr: float) -> None: ...

    def zero_grad(self) -> None:
        """Before the first micro-batch of a step."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss (the engine applies the accumulation's and the data
        parallel ranks' share of it)."""

    def clip_grad_norm(self) -> torch.Tensor:
        """After the last micro-batch: the global gradient norm (before clipping), gradients clipped to
        ``train.grad_clip``."""

    def step(self) -> None:
        """The optimizer update of a step whose loss and gradient norm are finite."""

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

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, grad_accum: int, world_size: int,
                 grad_clip: float):  # fmt: skip
        self.model = self.forward = model
        self.optimizer = optimizer
        # this rank's share of the global mean loss (FSDP sums gradients over ranks): dY, and so the held
        # dY references, do not depend on how the batch is split over ranks
        self._loss_divisor = grad_accum * world_size
        self._max_norm = grad_clip if grad_clip > 0 else float("inf")

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self._loss_divisor).backward()

    def clip_grad_norm(self) -> torch.Tensor:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._max_norm)
        return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm

    def step(self) -> None:
        self.optimizer.step()

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


class DeepSpeedEngine:
    """DeepSpeed ZeRO: its engine scales the loss by 1/grad_accum, accumulates, clips and steps at the
    accumulation boundary, and keeps model and optimizer state in its own checkpoint format."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]):
        self.model = model
        self.forward = self._engine = deepspeed_engine.initialize(model, optimizer, config)

    def set_lr(self, lr: float) -> None:
        set_lr(self._engine.optimizer, lr)

    def zero_grad(self) -> None:
        pass  # the engine zeroes its gradients after each optimizer step

    def backward(self, loss: torch.Tensor) -> None:
        self._engine.backward(loss)  # scales by 1/grad_accum itself
        self._engine.step()  # clips and steps at the accumulation boundary

    def clip_grad_norm(self) -> torch.Tensor:
        return torch.as_tensor(float(self._engine.get_global_grad_norm()))  # clipped inside its step

    def step(self) -> None:
        pass  # stepped at the accumulation boundary of backward

    def write_collective(self, folder: Path) -> None:
        deepspeed_engine.save(self._engine, folder)

    def read_collective(self, folder: Path) -> None:
        deepspeed_engine.load(self._engine, folder)

    def dcp_state(self) -> dict[str, Any]:
        return {}  # DeepSpeed writes model and optimizer in its own format

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        pass

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in deepspeed_engine.full_model_state_dict(self._engine).items()}


def build_engine(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: JobConfig, *, grad_accum: int,
                 world_size: int, device_type: str, rank: int) -> TrainEngine:  # fmt: skip
    """The engine of ``cfg.distributed.backend`` (:attr:`~nemofp4.training.parallel.DistributedConfig.engine`),
    refusing the settings it cannot honour."""
    dist_cfg = cfg.distributed
    if dist_cfg.engine != "deepspeed":
        return TorchEngine(model, optimizer, grad_accum=grad_accum, world_size=world_size, grad_clip=cfg.train.grad_clip)
    if cfg.train.nonfinite == "skip":
        raise ValueError("train.nonfinite=skip is not supported with DeepSpeed (its step cannot be "
                         "undone after the fact); use train.nonfinite=stop")
    if cfg.checkpoint.async_save and rank == 0:
        log.warning("checkpoint.async_save=true has no effect with distributed.backend=%s: DeepSpeed writes "
                    "its checkpoints synchronously", dist_cfg.backend)
    config = deepspeed_engine.deepspeed_config(
        stage=deepspeed_engine.zero_stage(dist_cfg.backend), micro_batch=cfg.train.micro_batch, grad_accum=grad_accum,
        world_size=world_size, grad_clip=cfg.train.grad_clip,
        bf16=cfg.train.dtype == "bfloat16" and device_type == "cuda",
    )  # fmt: skip
    return DeepSpeedEngine(model, optimizer, config)
