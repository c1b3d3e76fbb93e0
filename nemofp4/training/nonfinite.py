"""Finding where a non-finite value first appears, so a NaN run stops with a name, not a shrug."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from nemofp4.quant import canonical_fqn, held_amaxes

NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient norm under policy 'stop'."""


def finite_loss_and_norm(loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
    """Whether a step's mean loss and gradient norm are both finite: the step's one host read of each."""
    return bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))


def first_nonfinite_parameter(model: nn.Module) -> str | None:
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param  # this rank's FSDP shard
        if not torch.isfinite(local).all():
            return canonical_fqn(name)
    return None


def first_nonfinite_reference(model: nn.Module) -> str | None:
    """The first held FP4 tensor reference (amax) that is not finite, as '<fqn>.<ref> amax'."""
    for name, amax in held_amaxes(model).items():
        if not torch.isfinite(amax).all():
            return f"{name} amax"
    return None


def first_nonfinite_state(model: nn.Module) -> str | None:
    """The first non-finite parameter or held reference of this rank's shard, or None when all are finite
    (what a checkpoint would save; the optimizer state stays finite when the weights do)."""
    name = first_nonfinite_parameter(model)
    if name is not None:
        return f"parameter {name}"
    ref = first_nonfinite_reference(model)
    return f"held reference {ref}" if ref is not None else None


def first_nonfinite_module(model: nn.Module, run_forward: Callable[[], object]) -> str | None:
    """Re-run a forward pass with hooks; return the name of the first leaf module (in execution
    order) whose output contains a NaN or Inf, or None when the forward is finite everywhere."""
    found: list[str] = []
    handles = []

    def hook(name: str):
        def check(_module, _inputs, output):
            if found:
                return
            tensors = output if isinstance(output, (tuple, list)) else (output,)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                    found.append(canonical_fqn(name))
                    return

        return check

    for name, module in model.named_modules():
        if name and not any(True for _ in module.children()):
            handles.append(module.register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def first_nonfinite_gradient(model: nn.Module) -> str | None:
    """The non-finite gradient that backward produced first: parameters are visited output side first
    (backward order), so a NaN born in the last layer is not blamed on the embeddings it flowed into."""
    for name, param in reversed(list(model.named_parameters())):
        grad = param.grad
        if grad is not None:
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            if not torch.isfinite(grad).all():
                return canonical_fqn(name)
    return None


def first_nonfinite_state_on_any_rank(model: nn.Module, world_size: int) -> str | None:
    """:func:`first_nonfinite_state` over every rank (collective): the first rank's finding, naming the
    rank, or None; the same answer on every rank, so they all take the same path after it."""
    found = first_nonfinite_state(model)
    if world_size > 1:
        gathered: list[str | None] = [None] * world_size
        dist.all_gather_object(gathered, found)
        found = next((f"{g} (rank {r})" for r, g in enumerate(gathered) if g), None)
    return found


def where_nonfinite_starts(model: nn.Module, input_ids: torch.Tensor, world_size: int) -> str:
    """Where a step's non-finite loss or gradient starts: weights, then held FP4 references (they poison
    outputs or gradients downstream), then the first layer output in execution order (a forward of
    ``input_ids`` again, on every rank), then the first gradient in backward order."""
    where = first_nonfinite_state_on_any_rank(model, world_size)
    if where is None:
        module = first_nonfinite_module(model, lambda: model(input_ids))
        where = f"output of {module}" if module else None
    if where is None:
        grad = first_nonfinite_gradient(model)
        where = f"gradient of {grad}" if grad else "no single layer (the loss itself)"
    return where
