"""Tensor references (amaxes) of one FP4 linear: current scaling or sample-and-hold.

The UE5M3 recipe refreshes each tensor's reference only every D optimizer steps and holds
the sampled value in between ("sample-and-hold", not a history window or rolling max): a
reference is sampled at its first use in a step when it is empty or when
``step - refresh_step >= D``. Started at step 1 that gives refreshes at 1, D+1, 2D+1, ...
With gradient accumulation the first micro-batch of a refresh step samples the reference
and the others hold it, so every micro-batch of a step uses the same value.

Block amaxes are always current (computed inside the block quantizer); only the
tensor-wide reduction is skipped between refreshes.

Held references are module state (:meth:`ReferenceState.state_dict`, a QuantLinear's extra state),
so checkpoints carry them for exact resume; clearing them reproduces the paper, whose caches start
empty in every process (the first use after a resume re-samples, and the D-step phase restarts
from there).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemofp4 import kernels

__all__ = ["HeldReference", "ReferenceState", "finite_sample_or_previous", "held_state_problem"]


@dataclass
class HeldReference:
    """One held amax (fp32 0-d tensor on the operand's device) and the step that sampled it.

    The refresh step is a host int because the host decides, at every use, whether the reference
    is due: a device tensor would cost a synchronization per linear per micro-batch. It is saved as
    an int64 tensor beside the amax (:meth:`ReferenceState.state_dict`).
    """

    amax: torch.Tensor
    refresh_step: int


def finite_sample_or_previous(sampled: torch.Tensor, previous: HeldReference | None) -> torch.Tensor:
    """Guard at the sampling of a held amax, on the device (no host sync): a NaN/Inf sample (a bad step,
    skipped by the trainer) or a zero one (an all-zero tensor, which scales nothing) must never become
    the reference for the next D steps. With a previous value, that value is kept for another interval.
    With none, the sample is held as it is: a non-finite one makes the step's loss non-finite, and the
    trainer drops it when it skips the step (:meth:`nemofp4.quant.QuantTraining.discard_nonfinite`), so
    the next step samples again; a zero one is saved as an empty reference (:meth:`ReferenceState.state_dict`)."""
    if previous is not None:
        return torch.where(torch.isfinite(sampled) & (sampled > 0), sampled, previous.amax)
    return sampled


def held_state_problem(state: Mapping[str, torch.Tensor], *, step: int | None) -> str | None:
    """What is wrong with a module's saved references (:meth:`ReferenceState.state_dict`'s form) as state
    saved at optimizer step ``step`` (None: not known), or None when nothing is. A refresh step is 0
    (empty) or a step from 1 to ``step``; a held amax is finite and positive (the sampled max |x| of a
    tensor that scales by it; an empty reference saves 0). Checked once when a checkpoint is loaded: a
    refresh step in the future would freeze the reference for the rest of the run, an amax of 0 or
    below breaks every block that scales by it, and none of them says so where it goes wrong.
    One host read per module."""
    refs = sorted({k.rpartition(".")[0] for k in state})
    amax_keys = [f"{ref}.amax" for ref in refs if f"{ref}.amax" in state]
    for key in amax_keys:
        if state[key].numel() != 1:
            return f"{key} has shape {tuple(state[key].shape)} (valid: one value)"
    amaxes = (
        dict(zip(amax_keys, torch.stack([state[k].detach().reshape(()).float() for k in amax_keys]).tolist()))
        if amax_keys
        else {}
    )
    for ref in refs:
        refresh_key, amax_key = f"{ref}.refresh_step", f"{ref}.amax"
        refresh_step = int(state[refresh_key]) if refresh_key in state else 0
        if refresh_step < 0 or (step is not None and refresh_step > step):
            valid = (
                "0 (empty) or a step the run had reached"
                if step is None
                else (f"0 (empty) or a step from 1 to the checkpoint's step {step}")
            )
            return f"{refresh_key}={refresh_step} (valid: {valid})"
        amax = amaxes.get(amax_key)
        if amax is None:
            continue
        if not math.isfinite(amax) or amax < 0:
            return f"{amax_key}={amax} (valid: a finite amax >= 0; 0 only with {refresh_key}=0, empty)"
        if amax == 0 and refresh_step >= 1:
            return (
                f"{amax_key}=0 with {refresh_key}={refresh_step} (valid: a held amax > 0, or "
                f"{refresh_key}=0 for an empty reference)"
            )
    return None


class ReferenceState:
    """The references of one module, keyed by tensor name ('x', 'w', 'dy', 'x_rht', 'dy_rht').

    ``intervals`` maps each reference to its refresh interval (0 = current scaling).
    ``step`` is the 1-based optimizer step set by :func:`nemofp4.quant.set_step`.
    ``reduce_group``, when set, makes every amax that is measured an all-reduce (max) over
    that process group, for operands sharded across it (tensor parallelism).
    ``held_reduce_group``, when set, all-reduces (max) only the samples of held references, so
    data-parallel ranks hold one reference while current scaling stays per rank, as in TE.
    """

    def __init__(self, intervals: dict[str, int]) -> None:
        self.intervals = dict(intervals)
        self.held: dict[str, HeldReference] = {}
        self.step: int | None = None
        self.reduce_group: dist.ProcessGroup | None = None
        self.held_reduce_group: dist.ProcessGroup | None = None
        self._warned_no_step = False

    def measure(
        self, x: torch.Tensor | Callable[[], torch.Tensor], *, backend: kernels.Backend, for_held: bool = False
    ) -> torch.Tensor:
        """Current amax of ``x`` as fp32 0-d, by ``backend`` (the module's resolved kernels), all-reduced
        (max) over ``reduce_group`` if set (and over ``held_reduce_group`` when sampling a held
        reference). ``x`` may be a function that makes the tensor (an operand the quantizer transforms
        in its own loop is made only when measured here)."""
        value = backend.amax(x() if callable(x) else x)
        group = self.reduce_group if self.reduce_group is not None else (self.held_reduce_group if for_held else None)
        if group is not None:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value

    def get(
        self, name: str, x: torch.Tensor | Callable[[], torch.Tensor], *, training: bool, backend: kernels.Backend
    ) -> torch.Tensor | None:
        """The reference to quantize ``x`` with (None: the quantizer measures it), refreshing the held
        value when it is due.

        Outside training (eval) a held value is used as is and never refreshed, so evaluation
        cannot change a training trajectory; an empty reference then falls back to the current
        amax without storing it. ``backend`` measures the amaxes (see :meth:`measure`).
        """
        interval = self.intervals[name]
        if interval == 0:  # current scaling: the quantizer measures max |x| in its own pass
            return None if self.reduce_group is None else self.measure(x, backend=backend)
        held = self.held.get(name)
        if not training:
            return held.amax if held is not None else self.measure(x, backend=backend)
        if self.step is None:
            if not self._warned_no_step:
                warnings.warn(
                    "a sample-and-hold FP4 linear ran in training mode before nemofp4.quant.set_step(model, "
                    "step) was called; it uses current scaling until a step is set",
                    stacklevel=2,
                )
                self._warned_no_step = True
            return self.measure(x, backend=backend)
        if held is None or self.step - held.refresh_step >= interval:
            sampled = self.measure(x, for_held=True, backend=backend).detach().clone()
            held = HeldReference(amax=finite_sample_or_previous(sampled, held), refresh_step=self.step)
            self.held[name] = held
        return held.amax

    def state_dict(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The held references as tensors: ``'<ref>.amax'`` (fp32 0-d, on its device, copied) and
        ``'<ref>.refresh_step'`` (int64 0-d, CPU) for every sample-and-hold reference. The key set is
        fixed by the recipe, as DCP's in-place loading needs: a reference not sampled yet is amax 0
        (on ``device``) with refresh step 0 (steps are 1-based), and loads back empty. A reference first
        sampled from an all-zero tensor is saved empty too (refresh step 0), so a resume samples it at its
        next use: an amax of 0 with a refresh step set is what :func:`held_state_problem` refuses."""
        out: dict[str, torch.Tensor] = {}
        for ref in sorted(r for r in self.intervals if self.is_held(r)):
            held = self.held.get(ref)
            if held is None:
                out[f"{ref}.amax"] = torch.zeros((), device=device)
                out[f"{ref}.refresh_step"] = torch.tensor(0, dtype=torch.int64)
                continue
            out[f"{ref}.amax"] = held.amax.detach().clone()
            refresh_step = torch.tensor(held.refresh_step, dtype=torch.int64, device=held.amax.device)
            out[f"{ref}.refresh_step"] = torch.where(held.amax.detach() > 0, refresh_step, 0).cpu()
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor], device: torch.device) -> None:
        """Hold exactly (bitwise) what :meth:`state_dict` saved, replacing whatever is held now; a
        reference absent from ``state`` or saved with refresh step 0 starts empty (sampled at its first
        use). A key naming no sample-and-hold reference of this module is an error: the state was
        saved for another model or recipe."""
        refs = {k.rpartition(".")[0] for k in state}
        expected = {f"{r}.{f}" for r in refs for f in ("amax", "refresh_step")}
        unknown = sorted(set(state) ^ expected) + sorted(r for r in refs if not self.is_held(r))
        if unknown:
            raise ValueError(
                f"held-reference state {sorted(state)} has key(s) {unknown} that match no held "
                f"reference {sorted(r for r in self.intervals if self.is_held(r))} of this module; "
                "it was saved for a different model or precision recipe"
            )
        held = {}
        for ref in sorted(refs):
            refresh_step = int(state[f"{ref}.refresh_step"])
            if refresh_step >= 1:
                amax = state[f"{ref}.amax"].detach().to(device=device, dtype=torch.float32, copy=True).reshape(())
                held[ref] = HeldReference(amax=amax, refresh_step=refresh_step)
        self.held = held

    def __contains__(self, name: str) -> bool:
        """Whether this module quantizes with the reference ``name`` at all (held or current)."""
        return name in self.intervals

    def is_held(self, name: str) -> bool:
        """Whether ``name`` is a sample-and-hold reference of this module (current ones are not stored)."""
        return self.intervals.get(name, 0) > 0
