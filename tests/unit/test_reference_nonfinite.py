"""The non-finite guard where a held amax is sampled: a NaN/Inf sample never outlives its step."""

import torch

from nemofp4.kernels import backend_for
from nemofp4.quant.reference import HeldReference, ReferenceState, finite_sample_or_previous

EAGER = backend_for("eager", "cpu")


def _state(interval=3):
    return ReferenceState({"dy": interval})


def test_a_non_finite_sample_keeps_the_previous_reference_for_another_interval():
    state = _state()
    state.step = 1
    assert state.get("dy", torch.tensor([1.0, -4.0]), training=True, backend=EAGER).item() == 4.0
    state.step = 4  # refresh due: the gradient is NaN (a skipped step)
    used = state.get("dy", torch.tensor([float("nan"), 2.0]), training=True, backend=EAGER)
    assert used.item() == 4.0 and state.held["dy"].amax.item() == 4.0 and state.held["dy"].refresh_step == 4
    state.step = 5  # held, not re-sampled, finite
    assert state.get("dy", torch.tensor([9.0]), training=True, backend=EAGER).item() == 4.0
    state.step = 7  # the next refresh samples again
    assert state.get("dy", torch.tensor([9.0]), training=True, backend=EAGER).item() == 9.0


def test_a_non_finite_first_sample_is_dropped_when_the_step_is_skipped_and_the_next_step_samples_again():
    """No host read at the sampling: the sample is held as it is; the trainer, which sees the step's
    non-finite loss, drops it (QuantTraining.discard_nonfinite) and the next step samples again."""
    from torch import nn

    from nemofp4.quant import QuantLinear, QuantTraining, QuantTrainingConfig, quant_linears
    from nemofp4.recipes import get_recipe

    state = _state()
    state.step = 1
    assert torch.isinf(state.get("dy", torch.tensor([float("inf")]), training=True, backend=EAGER))
    assert torch.isinf(state.held["dy"].amax)
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    part = next(p for p in get_recipe("ue5m3").parts.values() if hasattr(p, "reference_roles"))
    QuantLinear.from_linear(model[0], part)
    ((_, linear),) = quant_linears(model)
    linear.quant_state.references = state
    assert (
        QuantTraining(model, QuantTrainingConfig(kernels="eager")).discard_nonfinite() == ["0.dy"]
        and "dy" not in state.held
    )
    state.step = 2
    assert state.get("dy", torch.tensor([3.0]), training=True, backend=EAGER).item() == 3.0
    assert state.held["dy"].refresh_step == 2


def test_guard_passes_finite_samples_through_bitwise():
    prev = HeldReference(amax=torch.tensor(2.0), refresh_step=1)
    sample = torch.tensor(0.1234567)
    assert torch.equal(finite_sample_or_previous(sample, prev), sample)
    assert torch.equal(finite_sample_or_previous(sample, None), sample)
    assert torch.isnan(finite_sample_or_previous(torch.tensor(float("nan")), None))  # kept: no host read


def test_a_zero_sample_never_replaces_a_held_reference_and_is_saved_empty():
    """An all-zero tensor at a refresh step keeps the previous reference; with none, the zero is held for
    the step but saved as an empty reference, which a resume samples again (never an amax of 0 with a
    refresh step, the state a checkpoint's load refuses)."""
    from nemofp4.quant.reference import held_state_problem

    prev = HeldReference(amax=torch.tensor(2.0), refresh_step=1)
    assert finite_sample_or_previous(torch.tensor(0.0), prev).item() == 2.0
    state = ReferenceState({"x": 50})
    state.step = 3
    assert state.get("x", torch.zeros(4, 4), training=True, backend=EAGER).item() == 0.0
    saved = state.state_dict()
    assert saved["x.refresh_step"].item() == 0 and held_state_problem(saved, step=3) is None
    state.step = 4
    assert state.get("x", torch.full((4, 4), 5.0), training=True, backend=EAGER).item() == 0.0  # held this run
    state.step = 7
    assert state.get("x", torch.full((4, 4), 5.0), training=True, backend=EAGER).item() == 0.0
