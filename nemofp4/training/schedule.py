"""Learning-rate schedules as pure functions of the optimizer step.

A schedule is a function of the (1-based) optimizer step alone, so resuming needs no state
beyond the step itself and a resumed run sets exactly the learning rate an uninterrupted run
would have set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("wsd", "cosine", "constant")


@dataclass(kw_only=True)
class ScheduleConfig:
    """Learning-rate schedule.

    `wsd` (warmup-stable-decay) is the paper's: linear warmup over `warmup_steps` (0 in the paper),
    the peak held until the final `decay_fraction` of training, then a linear decay to
    `min_lr_ratio` x peak at the last step.
    """

    name: str = "wsd"
    """One of wsd, cosine, constant."""
    warmup_steps: int = 0
    """Linear warmup from 0 to the peak over this many steps (0: start at the peak)."""
    decay_fraction: float = 0.15
    """wsd: fraction of the total steps spent decaying at the end."""
    min_lr_ratio: float = 0.01
    """Final learning rate as a fraction of the peak (wsd and cosine)."""

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule.name={self.name!r} is not one of {SCHEDULES}")
        if self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"schedule.decay_fraction must lie in [0, 1], got {self.decay_fraction}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"schedule.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")


def lr_multiplier(cfg: ScheduleConfig, step: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (1-based) of `total_steps`."""
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "wsd":
        decay_steps = round(cfg.decay_fraction * total_steps)
        decay_start = total_steps - decay_steps  # last step at the peak
        if decay_steps == 0 or step <= decay_start:
            return 1.0
        progress = (step - decay_start) / decay_steps  # in (0, 1], 1 at the last step
        return 1.0 - progress * (1.0 - cfg.min_lr_ratio)
    # cosine from the end of warmup to the last step
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + 0.5 * (1.0 - cfg.min_lr_ratio) * (1.0 + math.cos(math.pi * progress))
