"""Held references in checkpoints: the layout a checkpoint records, and the one path that reads a
checkpoint of any layout into a model's state in the current layout (the trainer's resume and
evaluation's loading share it).

Current checkpoints keep them in the model state, as each QuantLinear's extra state, which
``get_model_state_dict`` gives with the weights (``quant_state: "module"`` in the trainer state); ranks
that hold their own references (``distributed.reduce_references=false``) also keep theirs in their rank
files. Older checkpoints kept them in a ``"quant"`` DCP entry under the same canonical module names
(``"dcp"``), or only in each rank's file under the run's module names (``"per_rank"``, or no tag).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .reference import held_state_problem
from .state import EXTRA_STATE, quant_linears, references_by_module

__all__ = ["MODULE_STATE", "read_references", "references_layout_problem"]

MODULE_STATE = "module"
"""The trainer state's ``quant_state`` for checkpoints whose model state holds the references."""
_LEGACY_DCP_ENTRY = "quant"

ReadState = Callable[[dict[str, Any] | None], None]
"""Reads a checkpoint's tensors in place into a DCP state dict (None: only what the engine keeps in its
own files, DeepSpeed's)."""


def references_layout_problem(
    trainer_state: Mapping[str, Any], *, reads_model_state: bool, restore: bool = True
) -> str | None:
    """Why a checkpoint's references cannot be read into a model whose model state DCP does not read
    (``reads_model_state=False``: DeepSpeed reads its own), from its saved trainer state alone; None
    when they can."""
    if restore and not reads_model_state and trainer_state.get("quant_state") == "dcp":
        return (
            "this checkpoint keeps its held FP4 references in a 'quant' DCP entry (written before they "
            "were module state), which a DeepSpeed run does not read; resume it with "
            "precision.restore_references=false, or with distributed.backend=fsdp or none"
        )
    return None


def read_references(
    model: nn.Module,
    state: dict[str, Any] | None,
    read: ReadState,
    *,
    trainer_state: Mapping[str, Any],
    rank_state: Mapping[str, Any],
    restore: bool = True,
) -> None:
    """Read a checkpoint of any layout through ``read`` into ``state`` (the DCP state dict of the current
    layout, whose ``"model"`` entry is the model state as ``get_model_state_dict`` gives it; None when
    DeepSpeed reads its own) and leave it in the current layout: each FP4 linear's extra state holds the
    references to restore, this rank's own where its file has them (``rank_state['references']``), none
    with ``restore=False`` (``precision.restore_references=false``; a model evaluated under another
    recipe). Without a model state in ``state`` they go into the modules directly. The one converter of
    the older layouts (``trainer_state['quant_state']``): their model state has no references, which
    are read from the ``"quant"`` entry or from the rank files instead. The references restored are
    checked against the checkpoint's step (``trainer_state['step']``, where it has one): one ValueError
    naming the module and the key of the first bad value (:func:`held_state_problem`)."""
    layout = trainer_state.get("quant_state")
    problem = references_layout_problem(trainer_state, reads_model_state=state is not None, restore=restore)
    if problem is not None:
        raise ValueError(problem)
    model_state = (state or {}).get("model")
    set_aside: dict[str, dict[str, torch.Tensor]] = {}  # the model state's references, not read by DCP
    if model_state is not None and (layout != MODULE_STATE or not restore):
        set_aside = {k: model_state.pop(k) for k in [k for k in model_state if k.endswith(EXTRA_STATE)]}
    legacy = layout == "dcp" and restore
    if legacy:
        state[_LEGACY_DCP_ENTRY] = {k.removesuffix(EXTRA_STATE): v for k, v in set_aside.items()}
    read(state)
    if legacy:
        del state[_LEGACY_DCP_ENTRY]  # read in place into the set-aside extra states
    per_rank = rank_state.get("references") if restore else None  # possibly under wrapper names
    held = None if per_rank is None else references_by_module(per_rank)
    restored: dict[str, Mapping[str, torch.Tensor]] = {}
    if model_state is not None:
        model_state.update(set_aside)
        for key, extra in model_state.items():
            if key.endswith(EXTRA_STATE):
                _fill(extra, None if held is None else held.pop(key.removesuffix(EXTRA_STATE), {}), restore)
                restored[key.removesuffix(EXTRA_STATE)] = extra
    else:
        for fqn, module in quant_linears(model):
            extra = module.get_extra_state()
            if held is not None or not restore:
                _fill(extra, None if held is None else held.pop(fqn, {}), restore)
                module.set_extra_state(extra)
            restored[fqn] = extra
    if held:
        raise ValueError(
            f"the checkpoint holds references of {sorted(held)[:3]}, which are not FP4 linears of "
            "this model; it was saved for a different model or precision recipe"
        )
    if restore:
        _check_restored(restored, step=trainer_state.get("step"))


def _fill(state: dict[str, torch.Tensor], saved: Mapping[str, torch.Tensor] | None, restore: bool) -> None:
    """Make a module's extra state ``state`` hold ``saved`` (a reference absent there: empty), or
    nothing (``restore=False``); None with ``restore``: keep what was read."""
    if restore and saved is None:
        return
    unknown = set(saved or {}) - set(state)
    if unknown:
        raise ValueError(
            f"saved references {sorted(unknown)} match no held reference of this model's FP4 linear; "
            "the checkpoint was saved for a different model or precision recipe"
        )
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
            raise ValueError(
                f"the held FP4 reference of module {fqn} is invalid: {problem}; the checkpoint was written wrong"
            )
