"""Naming where a non-finite value lives: held references before the gradients they poison, and
gradients in backward order."""

import torch

from nemofp4.models import build_model, get_model_config
from nemofp4.quant import quant_linears
from nemofp4.quant.reference import HeldReference
from nemofp4.recipes import PrecisionConfig, apply_recipe, recipe_from_config
from nemofp4.training.nonfinite import first_nonfinite_gradient, first_nonfinite_state


def _ue5m3_model():
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny"), device="meta")
    apply_recipe(model, recipe_from_config(PrecisionConfig(name="ue5m3")), log=False)
    model.to_empty(device="cpu")
    model.init_weights()
    for _, module in quant_linears(model):
        module.references.held["dy"] = HeldReference(amax=torch.tensor(1.0), refresh_step=1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def test_a_nan_held_reference_is_named_before_the_gradients_it_poisons():
    model = _ue5m3_model()
    assert first_nonfinite_state(model) is None
    fqn, module = quant_linears(model)[2]
    module.references.held["dy"].amax.fill_(float("nan"))
    for p in model.parameters():
        p.grad.fill_(float("nan"))  # what the NaN reference does to the next backward
    assert first_nonfinite_state(model) == f"held reference {fqn}.dy amax"
    name, param = next(iter(model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("inf")
    assert first_nonfinite_state(model) == f"parameter {name}"  # a bad weight comes first


def test_the_first_gradient_in_backward_order_is_named():
    model = _ue5m3_model()
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    params[names[0]].grad.fill_(float("nan"))  # the embeddings: reached last by backward
    params[names[-3]].grad.fill_(float("nan"))
    assert first_nonfinite_gradient(model) == names[-3]
