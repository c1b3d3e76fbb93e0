"""Fault injection for the tests of resume and of the non-finite policy: the ``debug`` config, in one place.

The trainer reaches every injected fault through one seam, its :class:`Faults` object, at six named
points of a run; with every ``debug`` field at its default (0 or empty) each point does nothing, so
production code has no test branches of its own:

* :meth:`Faults.before_step`: fill ``debug.nan_param`` with NaN before ``debug.nan_at_step``;
* :meth:`Faults.loss`: the loss of ``debug.nan_loss_at_step`` made NaN (a transient fault);
* :meth:`Faults.during_checkpoint_write`: SIGKILL in the middle of a checkpoint write, or a stall
  there (a slow file system) in a run that did not resume;
* :meth:`Faults.async_save_hold_s`: how long a background checkpoint write is held back;
* :meth:`Faults.stall`: one rank sleeps after ``debug.stall_after_step`` (a hung rank) in a run that
  did not resume;
* :meth:`Faults.after_step`: SIGKILL right after a step (and its checkpoint), like a node failure.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import torch
from torch import nn

from nemofp4.quant import canonical_fqn
from nemofp4.training.config import CHECKPOINT_STALL_S, DebugConfig

__all__ = ["Faults"]

log = logging.getLogger(__name__)


class Faults:
    """The faults ``debug`` asks for. ``resumed``: this process resumed from a checkpoint (the stall
    and the held background save happen only in a run that did not, so a resubmitted job gets past)."""

    def __init__(self, debug: DebugConfig, *, resumed: bool) -> None:
        self.debug = debug
        self.resumed = resumed

    def before_step(self, model: nn.Module, step: int) -> None:
        if self.debug.nan_at_step == step and self.debug.nan_param:
            with torch.no_grad():
                {canonical_fqn(n): p for n, p in model.named_parameters()}[self.debug.nan_param].fill_(float("nan"))

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.debug.nan_loss_at_step == step:
            return loss * float("nan")  # one bad step, finite weights
        return loss

    def during_checkpoint_write(self, step: int) -> None:
        if self.debug.sigkill_during_checkpoint_step == step:
            os.kill(os.getpid(), signal.SIGKILL)  # die mid-write, like a node failure
        if self.debug.stall_during_checkpoint_step == step and not self.resumed:
            time.sleep(CHECKPOINT_STALL_S)  # a save that is still running when signalled

    def async_save_hold_s(self, step: int) -> float:
        hold = self.debug.hold_async_save_step == step and not self.resumed
        return self.debug.hold_async_save_s if hold else 0.0

    def stall(self, step: int, rank: int) -> None:
        if self.debug.stall_after_step == step and self.debug.stall_rank == rank and not self.resumed:
            log.warning("debug.stall_after_step=%d: rank %d stalls for %g s", step, rank, self.debug.stall_s)
            time.sleep(self.debug.stall_s)

    def after_step(self, step: int, *, wait_for_checkpoint: Callable[[], object] | None = None) -> None:
        """``wait_for_checkpoint``: this step's checkpoint is being written; the kill waits for it (one
        still in flight from before is not waited for)."""
        if self.debug.sigkill_at_step == step:
            if wait_for_checkpoint is not None:
                wait_for_checkpoint()
            os.kill(os.getpid(), signal.SIGKILL)
