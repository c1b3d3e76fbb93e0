"""Model-level controls of the FP4 linears: the step, the tensor references, the statistics.

The quant-state API: code outside this package (the trainer, evaluation) reads and changes the
tensor references of a model only through these functions, never through a module's fields.

* :func:`set_step` once per optimizer step, before the forward pass (refreshes, SR seeds);
* :func:`cached_weights` around the micro-batches of one step: each weight quantized once;
* :func:`held_amaxes` / :func:`reference_state_dict`: the held references, read;
* :func:`snapshot` / :func:`restore`: every module's held references and refresh intervals, taken
  and put back whole (evaluation leaves a model that goes on training as it found it);
* :func:`hold` / :func:`override_interval` / :func:`reset_references`: hold given amaxes as a
  reference, change how often one refreshes, empty them all (the inference policies);
* :func:`without_quant_state`: a model's state dict without the held references, which every
  QuantLinear keeps as its extra state (checkpoints carry them with the weights).

Every name here is canonical (:func:`canonical_fqn`): the module path without the segments that
activation checkpointing, ``torch.compile``, FSDP1 or DeepSpeed insert, as ``get_model_state_dict``
names the modules too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .linear import QuantLinear
from .reference import HeldReference

__all__ = [
    "WRAPPER_SEGMENTS",
    "QuantSnapshot",
    "cached_weights",
    "canonical_fqn",
    "held_amaxes",
    "hold",
    "load_reference_state_dict",
    "references_by_module",
    "override_interval",
    "quant_linears",
    "quant_stats",
    "reference_state_dict",
    "drop_nonfinite_references",
    "reset_references",
    "restore",
    "set_amax_reduce_group",
    "set_held_reference_reduce_group",
    "set_quant_backend",
    "set_quant_stats",
    "set_step",
    "snapshot",
    "without_quant_state",
]


EXTRA_STATE = "." + nn.modules.module._EXTRA_STATE_KEY_SUFFIX
"""How a module's extra state is named in a state dict (``'<fqn>._extra_state'``): a QuantLinear's
held references."""

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


@contextlib.contextmanager
def cached_weights(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside (the forward and backward passes of one optimizer step's micro-batches, the weights
    unchanged): every FP4 linear quantizes its weight's fprop operand, and a 1-D weight's dgrad
    operand, on first use and reuses them, packed, as Transformer Engine does with
    ``is_first_microbatch``. Bit for bit what quantizing in every micro-batch gives: a weight is
    rounded to nearest (one with stochastic rounding is not cached), and its reference is the same
    all step. Freed on exit, before the optimizer step changes the weights."""
    modules = [m for _, m in quant_linears(model)] if enabled else []
    for module in modules:
        module.quant_state.weight_cache = {}
    try:
        yield
    finally:
        for module in modules:
            module.quant_state.weight_cache = None


def held_amaxes(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every held tensor reference's amax as ``'<fqn>.<ref>'`` -> fp32 0-d, on its device and not
    copied (reading them costs no synchronization; checking them does), in module order."""
    return {
        f"{fqn}.{ref}": held.amax
        for fqn, module in quant_linears(model)
        for ref, held in sorted(module.references.held.items())
    }


def reference_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """All held tensor references: ``'<fqn>.<ref>.amax'`` (fp32 0-d) and ``'<fqn>.<ref>.refresh_step'``
    (int64 0-d), on CPU, with canonical fqns. References are 'x', 'w', 'dy' (and 'x_rht', 'dy_rht')."""
    out: dict[str, torch.Tensor] = {}
    for fqn, module in quant_linears(model):
        for ref, held in sorted(module.references.held.items()):
            out[f"{fqn}.{ref}.amax"] = held.amax.detach().to("cpu", copy=True)
            out[f"{fqn}.{ref}.refresh_step"] = torch.tensor(held.refresh_step, dtype=torch.int64)
    return out


def references_by_module(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A model's references as :func:`reference_state_dict` names them (fqns possibly with wrapper
    segments: older checkpoints' per-rank files), by canonical module name, each as the module's extra
    state names them: ``{fqn: {'<ref>.amax': ..., '<ref>.refresh_step': ...}}``."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        fqn, ref, field = key.rsplit(".", 2)
        out.setdefault(canonical_fqn(fqn), {})[f"{ref}.{field}"] = value
    return out


def load_reference_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Hold exactly (bitwise) what :func:`reference_state_dict` gave, replacing whatever is held now:
    keys are matched by canonical name (:func:`references_by_module`); a reference absent from
    ``state``, or saved with refresh step 0, starts empty (it is sampled at its first use). A key that
    names no held reference of this model is an error: the state was written for another model or
    recipe."""
    modules = dict(quant_linears(model))
    by_module = references_by_module(state)
    unknown = sorted(set(by_module) - set(modules))
    if unknown:
        raise ValueError(
            f"references of {unknown[:3]}, which are not FP4 linears of this model; they were "
            "saved for a different model or precision recipe"
        )
    for fqn, module in modules.items():
        module.set_extra_state(by_module.get(fqn, {}))


def without_quant_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` (a model's, as ``state_dict()`` or ``get_model_state_dict`` give it) without the FP4
    linears' held references (their extra state): the weights alone, for an export or a model without
    the recipe."""
    return {k: v for k, v in state_dict.items() if not f".{k}".endswith(EXTRA_STATE)}


# ------------------------------------------------------------------------------------ snapshots
@dataclass(frozen=True)
class QuantSnapshot:
    """Every FP4 linear's held references and refresh intervals, by canonical fqn (:func:`snapshot`)."""

    modules: dict[str, tuple[dict[str, HeldReference], dict[str, int]]]


def snapshot(model: nn.Module) -> QuantSnapshot:
    """The held references and refresh intervals of every FP4 linear of ``model``, to :func:`restore`."""
    return QuantSnapshot(
        {fqn: (dict(m.references.held), dict(m.references.intervals)) for fqn, m in quant_linears(model)}
    )


def restore(model: nn.Module, saved: QuantSnapshot) -> None:
    """Put back what :func:`snapshot` took: every module's held references and intervals, whole."""
    for fqn, module in quant_linears(model):
        held, intervals = saved.modules[fqn]
        module.references.held, module.references.intervals = dict(held), dict(intervals)


def hold(model: nn.Module, reference: str, amaxes: Mapping[str, torch.Tensor]) -> None:
    """Hold ``amaxes[fqn]`` (fp32 0-d, copied) as the reference ``reference`` of every FP4 linear named
    in ``amaxes`` that quantizes with it, as if sampled before step 1 (refresh step 0). An FP4 linear
    in eval mode then quantizes with it; one whose reference is current (interval 0) would not read a
    held value, so its interval becomes 1 (:func:`override_interval`)."""
    current = []
    for fqn, module in quant_linears(model):
        refs = module.references
        if fqn in amaxes and reference in refs:
            refs.held[reference] = HeldReference(amax=amaxes[fqn].clone(), refresh_step=0)
            if not refs.is_held(reference):
                current.append(fqn)
    override_interval(model, reference, 1, only=current)


def override_interval(model: nn.Module, reference: str, interval: int, *, only: Collection[str] | None = None) -> None:
    """Set the refresh interval of ``reference`` (0: current scaling, D >= 1: sample-and-hold) in every
    FP4 linear that quantizes with it, or in those named in ``only``. :func:`snapshot` first and
    :func:`restore` after: a recipe's intervals are part of what a checkpoint resumes."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(f"interval={interval!r}: 0 (current scaling) or D >= 1")
    for fqn, module in quant_linears(model):
        if reference in module.references and (only is None or fqn in only):
            module.references.intervals[reference] = interval


def reset_references(model: nn.Module) -> None:
    """Empty every held reference: the UE5M3 paper's behaviour after a restart (its caches
    are process-local), where each reference is re-sampled at its first use."""
    for _, module in quant_linears(model):
        module.references.held = {}


def drop_nonfinite_references(model: nn.Module) -> list[str]:
    """Drop every held reference whose amax is not finite (a first sample taken in a step whose loss or
    gradients were not finite), so it is sampled again at its next use; returns their names
    (``<fqn>.<ref>``). The sampling keeps such a sample without a host read; this runs only when the
    trainer skips a step (one host read per reference, on a step that is already lost)."""
    dropped = []
    for fqn, module in quant_linears(model):
        for ref, held in sorted(module.references.held.items()):
            if not torch.isfinite(held.amax).all():
                del module.references.held[ref]
                dropped.append(f"{fqn}.{ref}")
    return dropped


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
    """Which kernels quantize every QuantLinear's operands: one of :data:`nemofp4.kernels.BACKENDS`
    ('auto': Triton on CUDA, the native kernel and the compiled torch program on CPU with a C++
    compiler, else eager), checked by each module's setter. All have the same numerics (see
    :mod:`nemofp4.kernels`)."""
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
