"""Held-out negative log-likelihood over a fixed validation stream: the one implementation, used by
nemofp4-eval (under an inference policy) and by the trainer's periodic evaluation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from nemofp4.models import lm_loss

__all__ = ["validation_nll"]


@torch.no_grad()
def validation_nll(
    forward: Callable,
    batches: list[dict[str, torch.Tensor]],
    *,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    head_chunk_tokens: int = 0,
) -> dict:
    """Token-weighted mean next-token NLL over ``batches`` (the model's FP32 head), summed in float64 in
    the batches' order. Under an initialized process group it is data-parallel: each rank scores every
    world-th batch and the NLL sums and token counts are all-reduced, so the value is the single-process
    one up to the order of that sum. ``forward``: the model, or a policy's forward
    (:class:`~nemofp4.evaluation.policies.PolicyForward`)."""
    if not batches:
        raise ValueError("validation_nll needs at least one batch")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # NLL sum, token count
    for index in range(rank, -(-len(batches) // world) * world, world):
        # a rank past the end re-runs the last batch uncounted: every rank makes the same number of
        # forward calls, so FSDP's / ZeRO-3's collectives stay matched
        batch = batches[min(index, len(batches) - 1)]
        input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        with autocast():
            loss = lm_loss(forward, input_ids, labels, head_chunk_tokens=head_chunk_tokens)
        if index < len(batches):
            sums[0] += loss.double() * labels.numel()
            sums[1] += labels.numel()
    if world > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    total, count = sums.tolist()
    val_loss = total / max(count, 1)
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_tokens": int(count)}
