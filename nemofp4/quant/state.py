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
* :class:`QuantState`: the held references as one DCP ``Stateful`` (the ``"quant"`` entry of a
  checkpoint), and the trainer's whole persistence of them: where they are saved (DCP when the
  ranks agree on them, per rank otherwise) and how they come back on resume.

Every name here is canonical (:func:`canonical_fqn`): the module path without the segments that
activation checkpointing, ``torch.compile``, FSDP1 or DeepSpeed insert, so a checkpoint resumes
whichever of them the new run turns on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemofp4 import kernels

from .linear import QuantLinear
from .reference import HeldReference

__all__ = [
    "WRAPPER_SEGMENTS",
    "QuantSnapshot",
    "QuantState",
    "cached_weights",
    "canonical_fqn",
    "held_amaxes",
    "hold",
    "load_reference_state_dict",
    "override_interval",
    "quant_linears",
    "quant_stats",
    "reference_state_dict",
    "reset_references",
    "restore",
    "set_amax_reduce_group",
    "set_quant_backend",
    "set_quant_stats",
    "set_step",
    "snapshot",
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
    return {f"{fqn}.{ref}": held.amax for fqn, module in quant_linears(model)
            for ref, held in sorted(module.references.held.items())}  # fmt: skip


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
    ``"quant"`` entry of its checkpoint state, beside ``"model"`` and ``"optim"``), and the rules of
    their persistence around it.

    Why a Stateful and not persistent buffers: the model's own state dict stays the weights
    alone, so HF export, evaluation loading and ``strict`` loads see exactly the parameters of
    the unquantized architecture, whatever the recipe. Why DCP and not a per-rank file: with
    ``distributed.reduce_references`` every data-parallel rank holds the same references, so
    they are one replicated value, saved once and loaded by any number of ranks (resuming at
    another world size keeps them). ``replicated=False`` (ranks that hold their own references)
    saves them per rank instead (:meth:`rank_entries`); ``restore=False`` starts them empty on
    resume, as the UE5M3 paper's runs did (``precision.restore_references``).

    The key set is fixed by the model and recipe, which DCP's in-place loading needs: one
    ``'<fqn>.<ref>.amax'`` (fp32 0-d) and ``'<fqn>.<ref>.refresh_step'`` (int64 0-d) per
    sample-and-hold reference, canonical fqns; a reference not sampled yet is saved as amax 0
    with refresh step 0 (steps are 1-based) and restored empty.
    """

    DCP_KEY = "quant"
    """The entry of the DCP state (and the prefix of its keys in the checkpoint)."""

    def __init__(self, model: nn.Module, *, replicated: bool = True, restore: bool = True) -> None:
        self.model = model
        self.replicated = replicated
        self.restore = restore

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

    # ------------------------------------------------------------------ persistence
    def dcp_entries(self, *, for_load: bool = False) -> dict[str, QuantState]:
        """``{"quant": self}`` for the DCP state when there are held references and the ranks agree
        on them (when loading, whatever was saved: :meth:`select_for_load` drops what is not wanted)."""
        if self.state_dict() and (for_load or self.replicated):
            return {self.DCP_KEY: self}
        return {}

    def trainer_entries(self) -> dict[str, str]:
        """What the trainer state records of them: where they were saved."""
        return {"quant_state": "dcp" if self.replicated else "per_rank"}

    def rank_entries(self) -> dict[str, Any]:
        """What a rank saves of them on its own: its references, when the ranks do not agree on them."""
        return {} if self.replicated else {"references": reference_state_dict(self.model)}

    @staticmethod
    def saved_in_dcp(trainer_state: Mapping[str, Any]) -> bool:
        """Whether a checkpoint keeps its held references in DCP (older ones, and runs whose ranks
        hold their own references, save them per rank)."""
        return trainer_state.get("quant_state") == "dcp"

    def select_for_load(self, trainer_state: Mapping[str, Any], dcp_state: dict[str, Any]) -> None:
        """Before DCP reads a checkpoint: drop the ``"quant"`` entry where the references are not
        wanted (``restore=False``) or were not saved there (per rank, or an older checkpoint)."""
        if not (self.restore and self.saved_in_dcp(trainer_state)):
            dcp_state.pop(self.DCP_KEY, None)

    def finish_load(self, trainer_state: Mapping[str, Any], rank_state: Mapping[str, Any]) -> None:
        """After DCP read a checkpoint: empty the references (``restore=False``), or load the per-rank
        ones (possibly under wrapper names: loaded by canonical name; a rank new to the run takes rank
        0's); references saved in DCP are already in place."""
        if not self.restore:
            reset_references(self.model)
        elif not self.saved_in_dcp(trainer_state):
            load_reference_state_dict(self.model, rank_state.get("references", {}))


# ------------------------------------------------------------------------------------ snapshots
@dataclass(frozen=True)
class QuantSnapshot:
    """Every FP4 linear's held references and refresh intervals, by canonical fqn (:func:`snapshot`)."""

    modules: dict[str, tuple[dict[str, HeldReference], dict[str, int]]]


def snapshot(model: nn.Module) -> QuantSnapshot:
    """The held references and refresh intervals of every FP4 linear of ``model``, to :func:`restore`."""
    return QuantSnapshot({fqn: (dict(m.references.held), dict(m.references.intervals)) for fqn, m in quant_linears(model)})


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
    """Drop every held reference whose amax is not finite, so it is sampled again at its next use;
    returns their names (``<fqn>.<ref>``). One host read per reference: for a step already lost."""
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
