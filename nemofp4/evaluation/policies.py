"""Inference policies: which tensor references (amaxes) an FP4 model quantizes its activations with.

At inference a weight's amax is the amax of that fixed weight (measured once; "current" and
"frozen" coincide). Activations follow one of the UE5M3 paper's three policies (recipes.md
§1.4), plus the unquantized baseline:

==============  ==========================================================================
unquantized     every FP4 linear computes in high precision (the BF16 path); alias ``bf16``
current         each activation reference is the amax of the tensor being quantized (D = 1),
                exactly what the recipe's forward does at a refresh step of training
delayed         delayed replay: the references are sampled on batch 1, D+1, 2D+1, ... of a
                fixed request order and held in between (sample-and-hold over inference batches)
calibrated      calibrated-frozen: each reference is the max over C calibration sequences
                (each run alone, under ``current``) and is then frozen
==============  ==========================================================================

The policies drive the quantizers through their held references, with the quant-state API
(:func:`nemofp4.quant.hold`, :func:`~nemofp4.quant.reset_references`): a held value is what an FP4
linear in eval mode quantizes with, and an empty one falls back to the current amax.
:class:`PolicyForward` takes a :func:`~nemofp4.quant.snapshot` of every module's reference state on
entry and restores it on exit, so evaluating never changes a model that goes on training.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from nemofp4.formats import amax as tensor_amax
from nemofp4.models import NemotronHModel
from nemofp4.quant import hold, quant_linears, reset_references, restore, snapshot, without_quant_state

__all__ = ["POLICIES", "ActivationAmaxRecorder", "InferencePolicy", "PolicyForward", "unquantized_copy"]

POLICIES = ("unquantized", "current", "delayed", "calibrated")
_ALIASES = {"bf16": "unquantized"}
ACTIVATION_REFERENCE = "x"
"""The held reference an FP4 linear's fprop quantizes its input with (see nemofp4.quant.config)."""


@dataclass(frozen=True, kw_only=True)
class InferencePolicy:
    """An inference policy and its parameters (see the module docstring)."""

    name: str = "current"
    """unquantized (alias bf16) | current | delayed | calibrated."""
    delay: int = 50
    """delayed: D, the number of forward batches a sampled reference is held for."""
    calibration_sequences: int = 64
    """calibrated: C, the number of calibration sequences whose amaxes are max-reduced."""
    calibration_batch_size: int = 1
    """calibrated: sequences per calibration forward. With 1 (the paper's definition) each
    reference is the max over single-sequence amaxes; with more, the activations of a batch
    share one current amax during calibration, which changes the references downstream of
    the first FP4 layer."""

    def __post_init__(self) -> None:
        name = _ALIASES.get(self.name, self.name)
        if name not in POLICIES:
            raise ValueError(f"policy={self.name!r}; valid: {POLICIES} (or 'bf16' for 'unquantized')")
        object.__setattr__(self, "name", name)
        if self.delay < 1:
            raise ValueError(f"policy delay D={self.delay} must be >= 1 (D=1 is the 'current' policy)")
        if self.calibration_sequences < 1 or self.calibration_batch_size < 1:
            raise ValueError(
                f"calibration_sequences={self.calibration_sequences} and calibration_batch_size="
                f"{self.calibration_batch_size} must be >= 1"
            )

    def describe(self) -> str:
        if self.name == "delayed":
            return f"delayed (D={self.delay})"
        if self.name == "calibrated":
            return f"calibrated (C={self.calibration_sequences})"
        return self.name


def unquantized_copy(model: NemotronHModel) -> NemotronHModel:
    """The same weights in a model without any precision recipe (plain linears), on the same device."""
    param = next(model.parameters())
    plain = NemotronHModel(model.config, device="meta", dtype=param.dtype)
    plain.to_empty(device=param.device)
    plain.load_state_dict(without_quant_state(model.state_dict()), strict=True)
    return plain.eval()


class ActivationAmaxRecorder:
    """Records the amax of every FP4 linear's input during the forward passes it is active for,
    keeping the max over passes: exactly what the linear would sample as its activation reference."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.amax: dict[str, torch.Tensor] = {}

    @contextmanager
    def recording(self) -> Iterator[ActivationAmaxRecorder]:
        handles = [
            module.register_forward_pre_hook(self._hook(fqn))
            for fqn, module in quant_linears(self.model)
            if ACTIVATION_REFERENCE in module.references
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, fqn: str):
        def hook(module: nn.Module, args: tuple) -> None:
            value = tensor_amax(args[0])
            held = self.amax.get(fqn)
            self.amax[fqn] = value if held is None else torch.maximum(held, value)

        return hook


def _set_activation_references(model: nn.Module, amaxes: dict[str, torch.Tensor] | None) -> None:
    """Hold ``amaxes`` (fqn -> fp32 0-d) as the activation references and nothing else, or hold nothing
    (current scaling). A held value is only read in eval mode when the reference's interval is
    nonzero, so a current-scaling recipe (D = 0) gets interval 1 while a value is held (:func:`hold`)."""
    reset_references(model)
    if amaxes is not None:
        hold(model, ACTIVATION_REFERENCE, amaxes)


class PolicyForward:
    """Calls a model's forward under an inference policy; use as a context manager.

    ``forward(input_ids) -> logits``. Calls are counted: under ``delayed`` the references are
    sampled on calls 1, D+1, 2D+1, ... so the result depends on the call order, which every
    caller here keeps fixed. ``calibration_batches`` (input ids ``[B, L]``) are needed for
    ``calibrated`` only; the first ``policy.calibration_sequences`` sequences are used.
    """

    def __init__(
        self,
        model: NemotronHModel,
        policy: InferencePolicy,
        *,
        calibration_batches: Iterable[torch.Tensor] | None = None,
        autocast=None,
    ) -> None:
        self.model = model
        self.policy = policy
        self.autocast = autocast
        self.calibration_batches = calibration_batches
        self.calls = 0
        self.references: dict[str, torch.Tensor] | None = None
        """The activation references in use (calibrated: after entry; delayed: the last sampled)."""
        self._saved = None
        self._plain: NemotronHModel | None = None

    # ------------------------------------------------------------------ context
    def __enter__(self) -> PolicyForward:
        self._saved = (self.model.training, snapshot(self.model))
        self.model.eval()
        self.calls = 0
        if self.policy.name == "unquantized":
            self._plain = unquantized_copy(self.model) if quant_linears(self.model) else self.model
        elif self.policy.name == "calibrated":
            self.references = self.calibrate()
            _set_activation_references(self.model, self.references)
        else:
            _set_activation_references(self.model, None)
        return self

    def __exit__(self, *exc) -> None:
        training, saved = self._saved
        restore(self.model, saved)
        self.model.train(training)
        self._plain = None

    # ------------------------------------------------------------------ forward
    def _model_forward(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.autocast() if self.autocast else _null():
            return model(input_ids)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._saved is None:
            raise RuntimeError("PolicyForward must be entered (`with PolicyForward(...) as forward:`) before use")
        name = self.policy.name
        self.calls += 1
        if name == "unquantized":
            return self._model_forward(self._plain, input_ids)
        if name == "delayed" and (self.calls - 1) % self.policy.delay == 0:
            # A refresh batch: run with current references and keep what each linear sampled.
            _set_activation_references(self.model, None)
            recorder = ActivationAmaxRecorder(self.model)
            with recorder.recording():
                logits = self._model_forward(self.model, input_ids)
            self.references = recorder.amax
            _set_activation_references(self.model, self.references)
            return logits
        return self._model_forward(self.model, input_ids)

    def calibrate(self) -> dict[str, torch.Tensor]:
        """Max over the calibration sequences of each FP4 linear's current activation amax."""
        if self.calibration_batches is None:
            raise ValueError("policy 'calibrated' needs calibration_batches (input ids of calibration sequences)")
        sequences = []
        for batch in self.calibration_batches:
            sequences += list(batch)
            if len(sequences) >= self.policy.calibration_sequences:
                break
        if len(sequences) < self.policy.calibration_sequences:
            raise ValueError(
                f"policy 'calibrated' asks for C={self.policy.calibration_sequences} calibration sequences, "
                f"got only {len(sequences)}"
            )
        sequences = sequences[: self.policy.calibration_sequences]
        _set_activation_references(self.model, None)
        recorder = ActivationAmaxRecorder(self.model)
        device = next(self.model.parameters()).device
        step = self.policy.calibration_batch_size
        with recorder.recording():
            for i in range(0, len(sequences), step):
                self._model_forward(self.model, torch.stack(sequences[i : i + step]).to(device))
        return recorder.amax


@contextmanager
def _null():
    yield
