"""Held-out negative log-likelihood over a fixed validation stream, under an inference policy."""

from __future__ import annotations

import math

import torch

from nemofp4.models import lm_loss

from .policies import PolicyForward

__all__ = ["validation_nll"]


@torch.no_grad()
def validation_nll(forward: PolicyForward, batches: list[dict[str, torch.Tensor]], *, device: torch.device) -> dict:
    """Token-weighted mean next-token NLL over ``batches`` in their order (the same reduction as
    the trainer's periodic eval, so a current-scaling recipe reproduces its ``val_loss`` exactly)."""
    if not batches:
        raise ValueError("validation_nll needs at least one batch")
    total, count = torch.zeros((), dtype=torch.float64), 0
    for batch in batches:
        input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        loss = lm_loss(forward, input_ids, labels)
        total += loss.double().cpu() * labels.numel()
        count += labels.numel()
    val_loss = (total / count).item()
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_tokens": count}
