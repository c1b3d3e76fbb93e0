"""The language-modelling loss, shared by training and evaluation (so neither imports the other)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in float32 over all positions."""
    logits = model(input_ids)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
