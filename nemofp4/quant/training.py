"""The trainer's one handle on a model's quantized linears: set up once at build, entered once per step.

It converts no module. The swap of each selected ``nn.Linear`` for a ``QuantLinear`` (or
``FP32Linear``, ``TELinear``) is :func:`nemofp4.recipes.apply_recipe`, which the trainer calls on the
meta-device model before parallelization. :class:`QuantTraining` takes the model after that swap,
after parallelization and initialization, and sets what the swapped modules read at run time (their
kernels and the data-parallel reduction of held references); :meth:`QuantTraining.step` is the
per-step call (the step and its SR seeds, statistics on logging steps, the step's weight cache).
Every knob of the quantizers the trainer has is read here, once (:class:`QuantTrainingConfig`).

Held references are module state (each QuantLinear's extra state), so the model's state dict carries
them into and out of checkpoints with the weights. The checkpoint hooks here are what that cannot
say: the layout tag of the trainer state, each rank's own references where the ranks do not agree on
them (the replicated model state keeps one copy), and their reading (:mod:`nemofp4.quant.checkpoint`:
emptied for ``precision.restore_references=false``; older layouts converted).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from .checkpoint import MODULE_STATE, ReadState, read_references, references_layout_problem
from .state import (
    cached_weights,
    drop_nonfinite_references,
    quant_stats,
    reference_state_dict,
    set_held_reference_reduce_group,
    set_quant_backend,
    set_quant_stats,
    set_step,
)

__all__ = ["QuantTraining", "QuantTrainingConfig"]


@dataclass(frozen=True, kw_only=True)
class QuantTrainingConfig:
    """What the trainer's configuration says about the quantizers, interpreted once."""

    kernels: str = "auto"
    """train.kernels, one of :data:`nemofp4.kernels.BACKENDS` (:func:`nemofp4.quant.set_quant_backend`)."""
    seed: int = 0
    rank: int = 0
    """train.seed and this rank: the SR generators' seeds (:func:`nemofp4.quant.set_step`)."""
    held_reduce_group: Any = None
    """the data-parallel group that held references are all-reduced over (None: each rank its own)."""
    stats_interval: int = 0
    """logging.quant_stats_interval: statistics are kept on these steps only (0: never)."""
    weight_cache: bool = False
    """quantize each weight once per step (train.weight_cache, with gradient accumulation)."""
    restore_references: bool = True
    """precision.restore_references: resume with the saved references, or with empty ones."""

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the same references (one process, or reduced over the world)."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return world == 1 or self.held_reduce_group is not None


class QuantTraining:
    """The quantized linears of ``model``, already swapped in by :func:`nemofp4.recipes.apply_recipe`,
    as the trainer drives them (see the module docstring); a model without any is left as it is."""

    def __init__(self, model: nn.Module, config: QuantTrainingConfig) -> None:
        self.model = model
        self.config = config
        set_quant_backend(model, config.kernels)
        set_held_reference_reduce_group(model, config.held_reduce_group)

    # ------------------------------------------------------------------------------------ the step
    def stats_due(self, step: int) -> bool:
        return bool(self.config.stats_interval) and step % self.config.stats_interval == 0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around the forward and backward passes of optimizer step ``step`` (not its optimizer step,
        which changes the weights): reference schedule and SR seeds, statistics, the weight cache."""
        set_step(self.model, step, seed=self.config.seed, rank=self.config.rank)
        set_quant_stats(self.model, self.stats_due(step))
        with cached_weights(self.model, enabled=self.config.weight_cache):
            yield

    def stats(self, step: int) -> dict[str, dict[str, float]] | None:
        """The step's quantization statistics on a logging step (synchronizes), else None."""
        return quant_stats(self.model) if self.stats_due(step) else None

    def discard_nonfinite(self) -> list[str]:
        """After a skipped step: drop every non-finite held reference, so it is sampled again."""
        return drop_nonfinite_references(self.model)

    # ------------------------------------------------------------------------------------ checkpoints
    def trainer_entries(self) -> dict[str, str]:
        return {"quant_state": MODULE_STATE}

    def rank_entries(self) -> dict[str, Any]:
        """Each rank's own references, when the ranks do not agree on them (the model state, replicated,
        keeps one rank's)."""
        return {} if self.config.replicated else {"references": reference_state_dict(self.model)}

    def load_problem(self, trainer_state: Mapping[str, Any], *, reads_model_state: bool) -> str | None:
        """Why a checkpoint's references cannot be read here, from its saved trainer state alone
        (:func:`~nemofp4.quant.checkpoint.references_layout_problem`); None when they can."""
        return references_layout_problem(
            trainer_state, reads_model_state=reads_model_state, restore=self.config.restore_references
        )

    def read_checkpoint(
        self,
        state: dict[str, Any] | None,
        read: ReadState,
        *,
        trainer_state: Mapping[str, Any],
        rank_state: Mapping[str, Any],
    ) -> None:
        """Read a checkpoint of any layout into ``state`` in the current layout, its references checked,
        or emptied for ``precision.restore_references=false`` (:func:`~nemofp4.quant.checkpoint.read_references`)."""
        read_references(
            self.model,
            state,
            read,
            trainer_state=trainer_state,
            rank_state=rank_state,
            restore=self.config.restore_references,
        )
