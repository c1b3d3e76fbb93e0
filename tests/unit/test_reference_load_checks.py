"""Held references are range-checked when a checkpoint is loaded (``read_references``): a refresh step
below 0 or beyond the checkpoint's step, a non-finite or negative amax, or an amax of 0 with a refresh step
set is one ValueError naming the module and the key, through every layout (the model state, each rank's
file, DeepSpeed's modules); a good state, empty references included, loads as before."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nemofp4.quant import QuantTraining, QuantTrainingConfig, quant_linears, reference_state_dict
from nemofp4.quant.reference import held_state_problem
from nemofp4.quant.state import EXTRA_STATE, set_quant_backend
from tests.conftest import fresh_standin, train_standin

pytestmark = pytest.mark.usefixtures("one_thread")

STEP = 2
BAD = [
    pytest.param(
        "x.refresh_step",
        torch.tensor(10**9),
        r"x\.refresh_step=1000000000 \(valid: 0 \(empty\) or a step "
        r"from 1 to the checkpoint's step 2\)",
        id="refresh step beyond the checkpoint's step",
    ),
    pytest.param("x.refresh_step", torch.tensor(STEP + 1), r"x\.refresh_step=3 ", id="refresh step one past"),
    pytest.param("x.refresh_step", torch.tensor(-1), r"x\.refresh_step=-1 ", id="negative refresh step"),
    pytest.param("x.amax", torch.tensor(float("nan")), r"x\.amax=nan ", id="nan amax"),
    pytest.param("x.amax", torch.tensor(float("inf")), r"x\.amax=inf ", id="inf amax"),
    pytest.param("x.amax", torch.tensor(-1.0), r"x\.amax=-1\.0 \(valid: a finite amax >= 0", id="negative amax"),
    pytest.param(
        "x.amax", torch.tensor(0.0), r"x\.amax=0 with x\.refresh_step=1 \(valid: a held amax > 0", id="zero amax held"
    ),
]


def _trained():
    """The stand-in model after two steps: every FP4 linear holds its x, w and dy references from step 1."""
    model, optimizer = fresh_standin()
    set_quant_backend(model, "eager")
    train_standin(model, optimizer, range(1, STEP + 1))
    return model


def _load(model, dcp_state, rank_state=None, *, step=STEP, restore=True):
    quant = QuantTraining(model, QuantTrainingConfig(kernels="eager", restore_references=restore))
    trainer_state = {**quant.trainer_entries(), "step": step}
    quant.read_checkpoint(dcp_state, lambda state: None, trainer_state=trainer_state, rank_state=rank_state or {})


@pytest.mark.parametrize("key, value, message", BAD)
def test_a_bad_value_in_the_model_state_is_one_error_naming_module_and_key(key, value, message):
    model = _trained()
    fqn = quant_linears(model)[-1][0]
    state = {"model": get_model_state_dict(model)}
    state["model"][fqn + EXTRA_STATE][key] = value
    with pytest.raises(ValueError, match=rf"held FP4 reference of module {fqn} is invalid: {message}"):
        _load(model, state)


def test_a_good_state_loads_with_empty_references_and_a_refresh_at_the_checkpoints_step():
    model = _trained()
    held = reference_state_dict(model)
    assert {int(v) for k, v in held.items() if k.endswith("refresh_step")} == {1}
    fqn = quant_linears(model)[0][0]
    state = {"model": get_model_state_dict(model)}
    extra = state["model"][fqn + EXTRA_STATE]
    extra["x.refresh_step"] = torch.tensor(STEP)  # sampled at the checkpoint's own step
    extra["w.amax"], extra["w.refresh_step"] = torch.zeros(()), torch.tensor(0)  # empty, as state_dict saves it
    _load(model, state)
    assert int(state["model"][fqn + EXTRA_STATE]["x.refresh_step"]) == STEP
    # without the trainer's step (an older caller), everything but the step bound is still checked
    assert held_state_problem(extra, step=None) is None
    assert held_state_problem({**extra, "x.amax": torch.tensor(-1.0)}, step=None).startswith("x.amax=-1.0")


def test_each_ranks_own_references_are_checked_too():
    model = _trained()
    own = {
        k: (torch.tensor(float("inf")) if k.endswith(".dy.amax") else v) for k, v in reference_state_dict(model).items()
    }
    first = sorted(k for k in own if k.endswith(".dy.amax"))[0].removesuffix(".dy.amax")
    with pytest.raises(ValueError, match=rf"module {first} is invalid: dy\.amax=inf "):
        _load(model, {"model": get_model_state_dict(model)}, {"references": own})


def test_references_deepspeed_read_into_the_modules_are_checked():
    model = _trained()
    fqn, module = quant_linears(model)[0]
    module.references.held["w"].refresh_step = 7  # as DeepSpeed's own load would leave a bad checkpoint's
    with pytest.raises(ValueError, match=rf"module {fqn} is invalid: w\.refresh_step=7 "):
        _load(model, None)


def test_references_not_restored_are_not_checked():
    model = _trained()
    fqn = quant_linears(model)[0][0]
    state = {"model": get_model_state_dict(model)}
    state["model"][fqn + EXTRA_STATE]["x.amax"] = torch.tensor(float("nan"))
    _load(model, state, restore=False)  # precision.restore_references=false: they start empty
    assert all(int(v) == 0 for k, v in state["model"][fqn + EXTRA_STATE].items() if k.endswith("refresh_step"))
