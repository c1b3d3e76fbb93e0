"""The stand-in for the Nemotron-H model (tests/conftest.py), with the same module names.

The recipe and QuantLinear tests train it for hundreds of steps in a few seconds; the test below
keeps its linear FQNs and block types identical to the real model's, so what the recipes select on
it is what they select on the real one.
"""

from __future__ import annotations

from nemofp4.models import build_model, get_model_config
from tests.conftest import StandInModel, linear_names


def test_standin_has_the_real_models_linear_names():
    config = get_model_config("tiny")
    real = build_model(config, device="meta")
    standin = StandInModel(config.hybrid_layer_pattern)
    assert linear_names(standin) == linear_names(real)
