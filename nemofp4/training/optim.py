"""The optimizer: AdamW over FP32 master weights, with weight decay on matrices only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW settings (the paper's: betas 0.9/0.95, eps 1e-8, weight decay 0.1, peak LR 8e-4)."""

    name: str = "adamw"
    """Only adamw is provided."""
    lr: float = 8e-4
    """Peak learning rate; the schedule multiplies it."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Applied to the decay group only (see nemofp4.models.param_groups)."""
    foreach: bool = True
    """Use the multi-tensor implementation (faster; same numerics up to summation order)."""

    def __post_init__(self) -> None:
        if self.name != "adamw":
            raise ValueError(f"optim.name={self.name!r} is not supported; valid: 'adamw'")
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        for field, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"optim.{field} must lie in [0, 1), got {value}")


def build_optimizer(cfg: OptimConfig, param_groups: Iterable[dict]) -> torch.optim.Optimizer:
    """AdamW over the given groups; each group may carry its own `weight_decay`."""
    groups = []
    for group in param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        if params:
            groups.append({**group, "params": params})
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=cfg.foreach,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
