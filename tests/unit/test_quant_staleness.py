"""The staleness statistic rho = current / held amax, and the saturation a stale reference causes,
against hand computations on constructed tensors."""

import math

import pytest
import torch
from torch import nn

from nemofp4.quant import QuantLinear, quant_stats, set_quant_backend, set_quant_stats, set_step
from nemofp4.quant.stats import amax_ratio
from nemofp4.recipes import get_recipe
from nemofp4.training.metrics import quant_role_summary

pytestmark = pytest.mark.usefixtures("one_thread")

# Block amaxes of the 32 blocks of X (16 rows x 2 blocks of 16 along K = 32) at step 1: the held
# reference A is their max, 2.0.
BLOCK_AMAX = torch.tensor([0.25, 1.0, 2.0, 0.375] * 8).reshape(16, 2)
G = 4.0  # the step-2 tensor is G times the step-1 one


def _x(scale: float) -> torch.Tensor:
    """[16, 32] with block (r, b)'s amax BLOCK_AMAX[r, b] * scale, the other elements a quarter of it."""
    x = (BLOCK_AMAX * 0.25).repeat_interleave(16, dim=1).clone()
    x[:, 0::16] = BLOCK_AMAX
    return x * scale


def _layer(recipe: str) -> QuantLinear:
    torch.manual_seed(0)
    config = get_recipe(recipe).parts["fp4"].replace_operands(reference_interval=50)
    layer = QuantLinear.from_linear(nn.Linear(32, 16, bias=False), config)
    set_quant_backend(layer, "eager")  # same numerics as the compiled program, without its compile time
    return layer


def _step(layer: QuantLinear, step: int, scale: float, dy_scale: float) -> dict[str, float]:
    set_step(layer, step)
    x = _x(scale).requires_grad_()
    layer(x).backward(torch.full((16, 16), -0.5 * dy_scale))
    return layer.quant_stats()


def _hand_saturated_fraction(held: float, scale: float) -> float:
    """E4M3 block code = block amax * (448 / held) (T = 448): saturated when it exceeds 448, the largest
    E4M3 value, i.e. when the block amax exceeds the held amax."""
    block_amax = BLOCK_AMAX * scale
    return int((block_amax > held).sum()) / block_amax.numel()


def test_rho_is_the_growth_since_the_sample_and_e4m3_saturates_the_blocks_past_the_held_amax():
    for recipe in ("nvfp4", "ue5m3"):
        layer = _layer(recipe)
        first = _step(layer, 1, 1.0, 1.0)
        assert {k: v for k, v in first.items() if k.endswith("amax_ratio")} == {
            f"{role}/amax_ratio": 1.0 for role in ("x", "w", "dy_dgrad", "dy_wgrad", "x_wgrad")
        }
        assert first["x/saturated_blocks"] == 0.0
        second = _step(layer, 2, G, 0.25)  # X grew 4x and dY shrank 4x since step 1; W is unchanged
        assert second["x/amax_ratio"] == G  # exact: a power-of-two ratio of floats
        assert second["dy_dgrad/amax_ratio"] == 0.25
        assert second["w/amax_ratio"] == 1.0
        if recipe == "nvfp4":  # E4M3 scales: the blocks now above A = 2 saturate (1 x 4 and 2 x 4: 2 of every 4)
            assert second["x/saturated_blocks"] == _hand_saturated_fraction(2.0, G) == 0.5
        else:  # UE5M3 reaches 61,440: 448 x 4 is still representable
            assert second["x/saturated_blocks"] == 0.0
        assert second["dy_dgrad/saturated_blocks"] == 0.0  # a shrunk tensor never saturates


def test_rho_is_kept_on_the_device_only_for_held_references_and_only_while_collecting():
    layer = QuantLinear.from_linear(nn.Linear(32, 16, bias=False), get_recipe("nvfp4").parts["fp4"])
    set_quant_backend(layer, "eager")
    stats = _step(layer, 1, 1.0, 1.0)  # current scaling: nothing is held, so no rho
    assert stats and not any(k.endswith("amax_ratio") for k in stats)
    held = _layer("ue5m3")
    _step(held, 1, 1.0, 1.0)
    assert isinstance(held._stats["x"].ratio, torch.Tensor) and held._stats["x"].ratio.dim() == 0
    set_quant_stats(held, False)
    _step(held, 2, G, 1.0)
    assert quant_stats(held) == {"": {}}


def test_amax_ratio_of_an_empty_reference():
    t = torch.tensor
    assert float(amax_ratio(t(3.0), t(0.0))) == math.inf
    assert float(amax_ratio(t(0.0), t(0.0))) == 1.0
    assert float(amax_ratio(t(0.75), t(3.0))) == 0.25


def test_the_logged_role_summary_averages_fractions_and_spans_rho_over_layers():
    layers = {
        "a": {"x/saturated_blocks": 0.5, "x/amax_ratio": 4.0, "w/saturated_blocks": 0.0},
        "b": {"x/saturated_blocks": 0.0, "x/amax_ratio": 0.5, "w/saturated_blocks": 0.25},
    }
    summary = quant_role_summary(layers)
    assert summary == {
        "x": {"saturated_blocks": 0.25, "amax_ratio_min": 0.5, "amax_ratio_mean": 2.25, "amax_ratio_max": 4.0},
        "w": {"saturated_blocks": 0.125},
    }


def test_collecting_statistics_does_not_change_a_single_bit_of_the_step():
    results = []
    for collect in (True, False):
        layer = _layer("ue5m3")
        set_quant_stats(layer, collect)
        outputs = []
        for step, scale in ((1, 1.0), (2, G)):
            set_step(layer, step)
            x = _x(scale).requires_grad_()
            y = layer(x)
            y.backward(torch.full((16, 16), -0.5))
            outputs += [y.detach(), x.grad, layer.weight.grad.clone()]
        assert bool(layer._stats) == collect
        results.append(outputs)
    assert all(torch.equal(a, b) for a, b in zip(*results))
