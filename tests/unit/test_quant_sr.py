"""Stochastic rounding on dY: unbiased gradients (statistically) and reproducible random bits."""

import pytest
import torch
from torch import nn

from nemofp4.formats import quantize_blocks
from nemofp4.quant import QuantLinear
from nemofp4.recipes import get_recipe

pytestmark = pytest.mark.usefixtures("one_thread", "eager_quantizer")

T, K, N = 64, 32, 32


def _layer(recipe: str, index: int = 0) -> QuantLinear:
    torch.manual_seed(0)
    layer = nn.Linear(K, N, bias=False)
    return QuantLinear.from_linear(layer, get_recipe(recipe).parts["fp4"], index=index)


def _inputs():
    """X, and a dY whose every 16-block, along N (dgrad) and along T (wgrad), holds one element of
    magnitude A = amax(dY): every block scale is then exactly T = 448, so no payload is clipped
    and stochastic rounding is the only source of error (clipping would bias the mean)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, K, generator=g)
    dy = (torch.rand(T, N, generator=g) * 1.8 - 0.9) * 3.0
    t, n = torch.meshgrid(torch.arange(T), torch.arange(N), indexing="ij")
    on_pattern = (t + n) % 16 == 0
    dy[on_pattern] = torch.where(torch.rand(int(on_pattern.sum()), generator=g) < 0.5, -3.0, 3.0)
    return x, dy


def _grads(layer, x, dy, *, seed, step=1, rank=0):
    layer.set_step(step, seed=seed, rank=rank)
    layer.weight.grad = None
    x = x.clone().requires_grad_()
    layer(x).backward(dy)
    return x.grad.double(), layer.weight.grad.double()


@pytest.mark.parametrize("recipe", ["ue5m3", "nvfp4_all_fp4_no_rht"])  # sr8 and exact SR, no RHT
def test_stochastic_rounding_makes_the_expected_gradients_unbiased(recipe):
    layer = _layer(recipe)
    config = layer.quant_config
    x, dy = _inputs()
    # What SR is unbiased for: the products with dY unrounded and the deterministic (RNE)
    # quantized other operands.
    w_q = quantize_blocks(layer.weight.detach(), config.w.scale_format, 16, True).dequantize().double()
    x_q = quantize_blocks(x.t().contiguous(), config.x_wgrad.scale_format, 16).dequantize().double()
    exact_dx = dy.double() @ w_q
    exact_dw = dy.double().t() @ x_q.t()

    draws = 200
    samples = [_grads(layer, x, dy, seed=s) for s in range(draws)]
    for which, exact in ((0, exact_dx), (1, exact_dw)):
        stack = torch.stack([s[which] for s in samples])
        mean, var = stack.mean(0), stack.var(0)
        z2 = (mean - exact).pow(2) / (var / draws)
        # Unbiased: the mean's error is pure sampling noise, so z^2 averages 1 over the ~2k
        # elements (a chi-square per degree of freedom). Elements sharing a row of dY are
        # correlated, so the spread is wider than for 2k independent ones (measured 0.89-1.06).
        assert 0.7 < float(z2.mean()) < 1.35, (recipe, which, float(z2.mean()))
        # Round-to-nearest instead would leave a bias that averaging cannot remove.
        rne_layer = _layer(recipe)
        rne_layer._setup_quant(config.replace_operands(rounding="rne"), 0)
        rne = _grads(rne_layer, x, dy, seed=0)[which]
        assert (mean - exact).norm() < 0.25 * (rne - exact).norm(), (recipe, which)


def test_random_bits_are_reproducible_from_seed_rank_step_and_module():
    x, dy = _inputs()
    layer = _layer("ue5m3")
    base = _grads(layer, x, dy, seed=3, step=5)
    assert all(torch.equal(a, b) for a, b in zip(base, _grads(layer, x, dy, seed=3, step=5)))
    for kwargs in (dict(seed=4, step=5), dict(seed=3, step=6), dict(seed=3, step=5, rank=1)):
        other = _grads(layer, x, dy, **kwargs)
        assert not torch.equal(base[0], other[0]) and not torch.equal(base[1], other[1]), kwargs
    other_module = _grads(_layer("ue5m3", index=1), x, dy, seed=3, step=5)
    assert not torch.equal(base[0], other_module[0])


def test_dgrad_and_wgrad_draw_independent_bits():
    """With every block scale equal (see _inputs) an element's payload before rounding is the
    same in both layouts; identical random bits would round it the same way in both."""
    layer = _layer("ue5m3")
    x, dy = _inputs()
    layer._capture = []
    _grads(layer, x, dy, seed=0)
    captured = {name: (qa, qb) for name, qa, qb, _, _ in layer._capture}
    dgrad_dy = captured["dgrad"][0].dequantize()
    wgrad_dy = captured["wgrad"][0].dequantize().t()[:T]
    differ = (dgrad_dy != wgrad_dy).float().mean()
    assert 0.1 < float(differ) < 0.9
