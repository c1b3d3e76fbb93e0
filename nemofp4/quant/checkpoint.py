"""Held references in checkpoints: the layout a checkpoint records, and the one path that reads the
references of any layout into a model (the trainer's resume and evaluation's loading share it).

Current checkpoints keep them in the model state, as each QuantLinear's extra state, which
``get_model_state_dict`` gives with the weights (``quant_state: "module"`` in the trainer state); ranks
that hold their own references (``distributed.reduce_references=false``) also keep theirs in their rank
files. Older checkpoints kept them in a ``"quant"`` DCP entry under the same canonical module names
(``"dcp"``), or only in each rank's file under the run's module names (``"per_rank"``, or no tag).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .reference import held_state_problem
from .state import EXTRA_STATE, quant_linears, references_by_module

__all__ = ["MODULE_STATE", "ReferenceLoad"]

MODULE_STATE = "module"
"""The trainer state's ``quant_state`` for checkpoints whose model state holds the references."""
_LEGACY_DCP_ENTRY = "quant"


class ReferenceLoad:
    """Reading one checkpoint's held references into ``model``: :meth:`select` before DCP reads the
    state (which holds the model state as ``get_model_state_dict`` gives it, or no model state when
    DeepSpeed reads its own), :meth:`finish` after, before the model state is set. ``restore=False``
    leaves them empty (``precision.restore_references=false``; a model evaluated under another recipe)."""

    def __init__(self, model: nn.Module, *, restore: bool = True) -> None:
        self.model = model
        self.restore = restore
        self._set_aside: dict[str, dict[str, torch.Tensor]] = {}
        """the model state's references, taken out of DCP's reading (older layouts, not restored)"""

    def select(self, trainer_state: Mapping[str, Any], dcp_state: dict[str, Any] | None) -> None:
        """Before DCP reads: an older checkpoint has no references in its model state, and one that is
        not restored need not read them; the ``"quant"`` entry of an older one is read in their place."""
        layout = trainer_state.get("quant_state")
        model_state = (dcp_state or {}).get("model")
        self._set_aside = {}
        if model_state is not None and (layout != MODULE_STATE or not self.restore):
            self._set_aside = {k: model_state.pop(k) for k in [k for k in model_state if k.endswith(EXTRA_STATE)]}
        if layout == "dcp" and self.restore:
            if dcp_state is None:
                raise ValueError(
                    "this checkpoint keeps its held FP4 references in a 'quant' DCP entry (written before they "
                    "were module state), which a DeepSpeed run does not read; resume it with "
                    "precision.restore_references=false, or with distributed.backend=fsdp or none"
                )
            dcp_state[_LEGACY_DCP_ENTRY] = {k.removesuffix(EXTRA_STATE): v for k, v in self._set_aside.items()}

    def finish(self, trainer_state: Mapping[str, Any], rank_state: Mapping[str, Any],
               dcp_state: dict[str, Any] | None) -> None:  # fmt: skip
        """After DCP (and DeepSpeed) read: the references to hold go into the model state (this rank's
        own, from its file, where there are such; none when not restored); without a model state in DCP
        (DeepSpeed, which read its own) into the modules directly. The references restored are checked
        against the checkpoint's step (``trainer_state['step']``, where it has one): one ValueError
        naming the module and the key of the first bad value (:func:`held_state_problem`)."""
        per_rank = rank_state.get("references") if self.restore else None  # possibly under wrapper names
        held = None if per_rank is None else references_by_module(per_rank)
        model_state = (dcp_state or {}).get("model")
        restored: dict[str, Mapping[str, torch.Tensor]] = {}
        if model_state is not None:
            model_state.update(self._set_aside)
            for key, state in model_state.items():
                if key.endswith(EXTRA_STATE):
                    _fill(state, None if held is None else held.pop(key.removesuffix(EXTRA_STATE), {}), self.restore)
                    restored[key.removesuffix(EXTRA_STATE)] = state
        else:
            for fqn, module in quant_linears(self.model):
                state = module.get_extra_state()
                if held is not None or not self.restore:
                    _fill(state, None if held is None else held.pop(fqn, {}), self.restore)
                    module.set_extra_state(state)
                restored[fqn] = state
        if held:
            raise ValueError(f"the checkpoint holds references of {sorted(held)[:3]}, which are not FP4 linears of "
                             "this model; it was saved for a different model or precision recipe")  # fmt: skip
        if self.restore:
            _check_restored(restored, step=trainer_state.get("step"))


def _fill(state: dict[str, torch.Tensor], saved: Mapping[str, torch.Tensor] | None, restore: bool) -> None:
    """Make a module's extra state ``state`` hold ``saved`` (a reference absent there: empty), or
    nothing (``restore=False``); None with ``restore``: keep what was read."""
    if restore and saved is None:
        return
    unknown = set(saved or {}) - set(state)
    if unknown:
        raise ValueError(f"saved references {sorted(unknown)} match no held reference of this model's FP4 linear; "
                         "the checkpoint was saved for a different model or precision recipe")  # fmt: skip
    for key in state:
        if key.endswith(".refresh_step"):
            state[key] = torch.zeros((), dtype=torch.int64)
    if restore:
        state.update(saved)


def _check_restored(restored: Mapping[str, Mapping[str, torch.Tensor]], *, step: Any) -> None:
    """Every restored module's references are values the trainer could have saved at ``step``; a writer's
    bug (consistent checksums, wrong values) stops the load here, not steps later."""
    step = None if step is None else int(step)
    for fqn, state in restored.items():
        problem = held_state_problem(state, step=step)
        if problem is not None:
            raise ValueError(f"the held FP4 reference of module {fqn} is invalid: {problem}; the checkpoint was "
                             "written wrong")
