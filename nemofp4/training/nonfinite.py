"""Finding where a non-finite value first appears, so a NaN run stops with a name, not a shrug."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient norm under policy 'stop'."""


def first_nonfinite_parameter(model: nn.Module) -> str | None:
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            return name
    return None


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
                    found.append(name)
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
    for name, param in model.named_parameters():
        if param.grad is not None and not torch.isfinite(param.grad).all():
            return name
    return None
