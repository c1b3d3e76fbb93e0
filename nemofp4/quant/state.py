"""Model-level controls of the FP4 linears: the step, the tensor references, the statistics.

The trainer calls :func:`set_step` once per optimizer step, before the forward pass, and
saves the held references with each checkpoint as one :class:`QuantState` entry of its DCP
state. Every name here is canonical (:func:`canonical_fqn`): the module path without the
segments that activation checkpointing, ``torch.compile``, FSDP1 or DeepSpeed insert, so a
checkpoint resumes whichever of them the new run turns on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nemofp4 import kernels

from .linear import QuantLinear
from .reference import HeldReference

__all__ = [
    "WRAPPER_SEGMENTS",
    "QuantState",
    "canonical_fqn",
    "load_reference_state_dict",
    "quant_linears",
    "quant_stats",
    "reference_state_dict",
    "reset_references",
    "set_amax_reduce_group",
    "set_quant_backend",
    "set_quant_stats",
    "set_step",
]


WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
"""FQN segments that wrappers insert: activation checkpointing's ``checkpoint_wrapper``,
``torch.compile``'s ``OptimizedModule`` and FSDP1's ``FullyShardedDataParallel``."""


def canonical_fqn(fqn: str) -> str:
    """``fqn`` without wrapper segments (:data:`WRAPPER_SEGMENTS`) and without the leading
    ``module.`` of a DeepSpeed engine: the name of the same module in the unwrapped model.

    >>> canonical_fqn("layers.0._checkpoint_wrapped_module._orig_mod.mixer.in_proj")
    'layers.0.mixer.in_proj'
    """
    parts = [p for p in fqn.split(".") if p not in WRAPPER_SEGMENTS]
    if parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


def quant_linears(model: nn.Module) -> list[tuple[str, QuantLinear]]:
    """(canonical fqn, module) of every QuantLinear, in module order."""
    return [(canonical_fqn(name), m) for name, m in model.named_modules() if isinstance(m, QuantLinear)]


def set_step(model: nn.Module, step: int, *, seed: int = 0, rank: int = 0) -> None:
    """Enter optimizer step ``step`` (1-based). Call once per step, before the forward pass.

    Drives sample-and-hold refreshes (steps 1, D+1, 2D+1, ...; with gradient accumulation the
    first micro-batch samples and the rest hold) and reseeds every QuantLinear's stochastic
    rounding generator from (seed, rank, step, module index), so a resumed run draws the same
    random bits without any saved RNG state.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a 1-based int >= 1, got {step!r}")
    for _, module in quant_linears(model):
        module.set_step(step, seed=seed, rank=rank)


def reference_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """All held tensor references: ``'<fqn>.<ref>.amax'`` (fp32 0-d) and ``'<fqn>.<ref>.refresh_step'``
    (int64 0-d), on CPU, with canonical fqns. References are 'x', 'w', 'dy' (and 'x_rht', 'dy_rht')."""
    out: dict[str, torch.Tensor] = {}
    for fqn, module in quant_linears(model):
        for ref, held in sorted(module.references.held.items()):
            out[f"{fqn}.{ref}.amax"] = held.amax.detach().to("cpu", copy=True)
            out[f"{fqn}.{ref}.refresh_step"] = torch.tensor(held.refresh_step, dtype=torch.int64)
    return out


def load_reference_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore held references exactly (bitwise), replacing whatever is held now.

    Keys may carry wrapper segments (checkpoints written before names were canonical): they
    are matched by their canonical names. A reference absent from ``state``, or saved with
    refresh step 0 (:class:`QuantState`'s "empty"), starts empty (it is sampled at its first use).
    A key that names no held reference of this model is an error: the checkpoint was written
    for another model or recipe.
    """
    modules = dict(quant_linears(model))
    restored: dict[str, dict[str, HeldReference]] = {fqn: {} for fqn in modules}
    state = {canonical_fqn(k): v for k, v in state.items()}
    amaxes = {k[: -len(".amax")]: v for k, v in state.items() if k.endswith(".amax")}
    steps = {k[: -len(".refresh_step")]: v for k, v in state.items() if k.endswith(".refresh_step")}
    unknown = sorted(set(state) - {f"{k}.amax" for k in amaxes} - {f"{k}.refresh_step" for k in steps})
    if set(amaxes) != set(steps):
        unknown += sorted(set(amaxes) ^ set(steps))
    for key in sorted(amaxes):
        fqn, _, ref = key.rpartition(".")
        module = modules.get(fqn)
        if module is None or not module.references.is_held(ref):
            unknown.append(key)
            continue
        refresh_step = int(steps[key])
        if refresh_step < 1:
            continue  # saved empty
        device = module.weight.device
        amax = amaxes[key].detach().to(device=device, dtype=torch.float32, copy=True).reshape(())
        restored[fqn][ref] = HeldReference(amax=amax, refresh_step=refresh_step)
    if unknown:
        raise ValueError(
            f"reference state has {len(unknown)} key(s) that match no held reference of this model "
            f"(e.g. {unknown[:3]}); it was saved for a different model or precision recipe"
        )
    for fqn, module in modules.items():
        module.references.held = restored[fqn]


class QuantState:
    """The held tensor references of a model as one DCP ``Stateful`` (the trainer saves it as the
    ``"quant"`` entry of its checkpoint state, beside ``"model"`` and ``"optim"``).

    Why a Stateful and not persistent buffers: the model's own state dict stays the weights
    alone, so HF export, evaluation loading and ``strict`` loads see exactly the parameters of
    the unquantized architecture, whatever the recipe. Why DCP and not a per-rank file: with
    ``distributed.reduce_references`` every data-parallel rank holds the same references, so
    they are one replicated value, saved once and loaded by any number of ranks (resuming at
    another world size keeps them).

    The key set is fixed by the model and recipe, which DCP's in-place loading needs: one
    ``'<fqn>.<ref>.amax'`` (fp32 0-d) and ``'<fqn>.<ref>.refresh_step'`` (int64 0-d) per
    sample-and-hold reference, canonical fqns; a reference not sampled yet is saved as amax 0
    with refresh step 0 (steps are 1-based) and restored empty.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        held = reference_state_dict(self.model)
        out: dict[str, torch.Tensor] = {}
        for fqn, module in quant_linears(self.model):
            for ref in sorted(r for r in module.references.intervals if module.references.is_held(r)):
                key = f"{fqn}.{ref}"
                out[f"{key}.amax"] = held.get(f"{key}.amax", torch.zeros((), dtype=torch.float32))
                out[f"{key}.refresh_step"] = held.get(f"{key}.refresh_step", torch.zeros((), dtype=torch.int64))
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_reference_state_dict(self.model, state)


def reset_references(model: nn.Module) -> None:
    """Empty every held reference: the UE5M3 paper's behaviour after a restart (its caches
    are process-local), where each reference is re-sampled at its first use."""
    for _, module in quant_linears(model):
        module.references.held = {}


def quant_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """Per QuantLinear, the fractions of its last quantization of each operand role:
    ``{fqn: {'<role>/saturated_blocks', '<role>/underflow_blocks', '<role>/zero_blocks',
    '<role>/clipped_elements'}}``, plus ``'<role>/amax_ratio'`` (current / held amax) for operands
    with a held reference. Reading them synchronizes with the device."""
    return {fqn: module.quant_stats() for fqn, module in quant_linears(model)}


def set_quant_stats(model: nn.Module, enabled: bool) -> None:
    """Turn the bookkeeping behind :func:`quant_stats` on or off (on by default; it keeps a few
    scalar counts per operand, computed on the device with no synchronization)."""
    for _, module in quant_linears(model):
        module.collect_stats = enabled
        if not enabled:
            module._stats = {}


def set_quant_backend(model: nn.Module, backend: str) -> None:
    """Which kernels quantize every QuantLinear's operands: 'auto' (Triton on CUDA, the compiled
    torch program on CPU with a C++ compiler, else eager), 'triton', 'compiled' or 'eager'. All
    have the same numerics (see :mod:`nemofp4.kernels`)."""
    kernels.check_backend(backend)
    for _, module in quant_linears(model):
        module.quant_backend = backend


def set_held_reference_reduce_group(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """All-reduce (max) each sampled held reference over ``group`` (the data-parallel ranks), so every
    rank holds the same reference; current-scaling measurements stay per rank. None turns it off."""
    for _, module in quant_linears(model):
        module.references.held_reduce_group = group


def set_amax_reduce_group(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """All-reduce (max) every measured tensor amax over ``group``: for operands sharded across
    it (tensor parallelism), so all shards quantize with one reference. None turns it off."""
    for _, module in quant_linears(model):
        module.references.reduce_group = group
