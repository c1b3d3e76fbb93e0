"""Per-operand quantization statistics, and the staleness of held tensor references.

A sample-and-hold reference (the UE5M3 recipe's D-step amax) is only safe while the tensor stays
near the value it was sampled at. The staleness ratio

    rho = current amax / held amax

says how far it has drifted: rho > 1 means the tensor grew past its reference (its largest blocks'
scale codes exceed the format's T-based target and saturate once they pass the largest code),
rho < 1 that it shrank (small blocks underflow sooner). It is recorded only for operands quantized
with a held reference, and only while statistics are collected (the trainer's
``logging.quant_stats_interval``), as a device scalar read lazily: no host sync until
:meth:`OperandStats.read`. The current amax is this rank's tensor's; a held reference all-reduced
over data-parallel ranks is their max, so there rho is this rank's drift from the shared reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemofp4 import kernels
from nemofp4.formats import QuantizedBlocks

__all__ = ["AMAX_RATIO", "OperandStats", "amax_ratio", "operand_stats"]

AMAX_RATIO = "amax_ratio"
"""Statistic name of rho = current amax / held amax."""


def amax_ratio(current: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """rho = current / held as a float32 0-d device tensor (one IEEE division: exact for power-of-two
    ratios). A held zero gives 1 for a tensor that is still zero and +inf for one that is not."""
    current, held = current.float(), held.float()
    ones = torch.ones_like(current)
    empty_ratio = torch.where(current > 0, torch.full_like(current, float("inf")), ones)
    return torch.where(held > 0, current / torch.where(held > 0, held, ones), empty_ratio)


@dataclass(frozen=True)
class OperandStats:
    """What the statistics keep of one quantized operand: its block counts and, for a held
    reference, rho (device tensors; the data itself is dropped)."""

    blocks: QuantizedBlocks
    ratio: torch.Tensor | None = None

    def read(self) -> dict[str, float]:
        """Block fractions (:meth:`QuantizedBlocks.stats`) and ``amax_ratio`` where held. Synchronizes."""
        out = self.blocks.stats()
        if self.ratio is not None:
            out[AMAX_RATIO] = float(self.ratio)
        return out


def operand_stats(q: QuantizedBlocks, source: torch.Tensor | None, *, backend: kernels.Backend) -> OperandStats:
    """The statistics of ``q``. ``source``: the high-precision tensor ``q`` was quantized from, given
    only when its tensor reference was a held one (``q.tensor_amax``); its current amax is then
    measured (one extra read of the operand, on the device, by ``backend``: the module's kernels)
    for rho."""
    ratio = None if source is None else amax_ratio(backend.amax(source.detach()), q.tensor_amax)
    return OperandStats(q.without_data(), ratio)
