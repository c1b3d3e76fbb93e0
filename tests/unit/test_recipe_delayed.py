"""nvfp4_delayed: NVFP4 with a held tensor reference, and what its E4M3 scales do when a tensor
outgrows the held amax (saturate at 448 exactly as the scaling formula predicts), against UE5M3
(no saturation until its far larger range) and current-scaling NVFP4 (never, by construction)."""

import pytest
import torch
from torch import nn

from nemofp4.quant import QuantLinear, quant_stats, set_step
from nemofp4.recipes import get_recipe, recipe_knobs

pytestmark = pytest.mark.usefixtures("one_thread")

A = 2.0  # the amax held from step 1
# Growth of each block's amax at step 2 (fp32-exact multiples of A); 100x is inside UE5M3's range
# (61,440 / 448 = 137x), 200x is past it.
GROWTH = (0.25, 0.75, 1.0, 1.015625, 1.5, 4.0, 100.0, 200.0)
K = 16 * len(GROWTH)  # one block per growth factor along each row
F32 = torch.float32


def _grid(bias: int, max_finite: float) -> list[float]:
    """Every non-negative value of an unsigned 3-mantissa-bit minifloat with subnormals, by code."""
    values = []
    for code in range(256):
        e, m = code >> 3, code & 7
        v = (m / 8) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 8) * 2.0 ** (e - bias)
        if v > max_finite:
            break
        values.append(v)
    return values


GRIDS = {"e4m3": _grid(7, 448.0), "ue5m3": _grid(15, 61440.0)}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _rne_code(v: float, grid: list[float]) -> int:
    """Round-to-nearest-even onto ``grid`` (v <= max): nearest value, ties to the even code."""
    hi = next(i for i, g in enumerate(grid) if g >= v)
    if grid[hi] == v or hi == 0:
        return hi
    lo = hi - 1
    d_lo, d_hi = v - grid[lo], grid[hi] - v
    return lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else hi


def _expected(scale_format: str, held: float, x_blocks: torch.Tensor):
    """The scaling formula of formats/scaling.py and formats/block.py, written out in FP32 steps:
    (tensor scale 1/G, saturated blocks, block scale codes, scaled operand = E2M1 x block scale)."""
    grid = GRIDS[scale_format]
    g = torch.tensor(held, dtype=F32)
    big_g = torch.tensor(448.0 * 6.0, dtype=F32) / g  # G = fp32(T * 6) / g
    tensor_scale = torch.reciprocal(big_g)
    multiplier = big_g * torch.tensor(1.0 / 6.0, dtype=F32)  # G * fp32(1/6), one product
    ideal = x_blocks.abs().amax(-1) * multiplier  # fp32
    saturated = ideal > grid[-1]
    codes = torch.tensor([_rne_code(min(float(v), grid[-1]), grid) for v in ideal.flatten()]).view(ideal.shape)
    block_scale = torch.tensor([grid[c] for c in codes.flatten()], dtype=F32).view(codes.shape)
    enc = torch.reciprocal(block_scale * tensor_scale)[..., None]  # reciprocal, then multiply
    y = x_blocks * enc
    payload = torch.tensor([_rne_code(min(abs(float(v)), 6.0), E2M1) for v in y.flatten()]).view(y.shape)
    magnitude = torch.tensor(E2M1, dtype=F32)[payload]
    scaled = torch.where(y < 0, -magnitude, magnitude) * block_scale[..., None]
    return tensor_scale, saturated, codes, scaled, y


def _inputs():
    """X at step 1 (every 16-block has amax exactly A) and at step 2 (block j grown by GROWTH[j])."""
    gen = torch.Generator().manual_seed(5)
    x1 = (torch.rand(16, K, generator=gen) * 2 - 1) * (A * 0.99)
    x1[:, ::16] = A * torch.where(torch.rand(16, len(GROWTH), generator=gen) < 0.5, -1.0, 1.0)
    growth = torch.tensor(GROWTH, dtype=F32).repeat_interleave(16)
    return x1, x1 * growth


def _fprop_x(recipe: str):
    """The quantized X of the fprop GEMM at step 2, after a step 1 that sampled amax A."""
    layer = QuantLinear.from_linear(nn.Linear(K, 16, bias=False), get_recipe(recipe).parts["fp4"])
    layer.quant_backend = "eager"  # the torch program uncompiled (bitwise the compiled one; no compile wait)
    x1, x2 = _inputs()
    set_step(layer, 1)
    layer(x1)
    set_step(layer, 2)
    layer._capture = []
    layer(x2)
    (qx,) = [qa for name, qa, _, _, _ in layer._capture if name == "fprop"]
    return layer, x2, qx


def test_nvfp4_delayed_is_nvfp4_with_the_ue5m3_hold():
    nvfp4, delayed = get_recipe("nvfp4"), get_recipe("nvfp4_delayed")
    hold = get_recipe("ue5m3").parts["fp4"].x.reference_interval
    assert hold == 50 and delayed.knobs["reference_interval"] == hold
    assert delayed.parts["fp4"] == nvfp4.parts["fp4"].replace_operands(reference_interval=hold)
    assert delayed.rules == nvfp4.rules and {k: v for k, v in delayed.parts.items() if k != "fp4"} == {
        k: v for k, v in nvfp4.parts.items() if k != "fp4"
    }
    assert get_recipe("nvfp4_delayed", reference_interval=0).parts == nvfp4.parts


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4_all_fp4_no_rht", "ue5m3", "ue5m3_te_settings", "nvfp4_delayed"])
def test_every_recipe_with_a_tensor_reference_takes_the_hold_interval_as_a_knob(recipe):
    assert "reference_interval" in recipe_knobs(recipe)
    for interval in (0, 7):
        fp4 = get_recipe(recipe, reference_interval=interval).parts["fp4"]
        # ue5m3_te_settings measures its Hadamard-transformed wgrad operands afresh at every call (the paper)
        current = ("dy_wgrad", "x_wgrad") if recipe == "ue5m3_te_settings" else ()
        held = [r for r in ("x", "w", "dy_dgrad", "dy_wgrad", "x_wgrad") if r not in current]
        assert {fp4.operand(r).reference_interval for r in held} == {interval}
        assert all(fp4.operand(r).reference_interval == 0 for r in current)


def test_e4m3_scales_under_a_held_reference_saturate_exactly_as_the_formula_predicts():
    layer, x2, qx = _fprop_x("nvfp4_delayed")
    assert float(qx.tensor_amax) == A  # the held step-1 amax, not the current one (200 A)
    blocks = x2.view(16, len(GROWTH), 16)
    tensor_scale, saturated, codes, scaled, y = _expected("e4m3", A, blocks)
    # Every block that grew past the held amax saturates at 448 (code 126); the others do not.
    assert saturated[:, GROWTH.index(1.015625) :].all() and not saturated[:, : GROWTH.index(1.0)].any()
    assert (codes[saturated] == 126).all()
    assert int(qx.counts["saturated_blocks"]) == int(saturated.sum()) == 16 * 5
    assert quant_stats(layer)[""]["x/saturated_blocks"] == float(saturated.float().mean())
    # The operand the GEMM reads, bitwise: E2M1 x block scale, and the tensor scale 1/G.
    assert torch.equal(qx.tensor_scale, tensor_scale)
    assert torch.equal(qx.scaled_values().view(16, len(GROWTH), 16), scaled)
    # Clipped values: in a saturated block every element with |x * enc| > 6 is +-6 x 448 = 2688
    # (scaled), +-fp32(2688 / G) dequantized; the grown blocks lose most of their elements to it.
    clipped = (y.abs() > 6) & saturated[..., None]
    assert torch.equal(scaled[clipped].abs(), torch.full((int(clipped.sum()),), 2688.0))
    assert int(clipped.sum()) > 16 * 3 * 8
    dequantized = qx.dequantize().view(16, len(GROWTH), 16)
    assert torch.equal(dequantized[clipped].abs(), torch.full((int(clipped.sum()),), 2688.0) * tensor_scale)


def test_ue5m3_under_the_same_held_reference_saturates_only_past_its_range():
    _, x2, qx = _fprop_x("ue5m3")
    assert float(qx.tensor_amax) == A
    blocks = x2.view(16, len(GROWTH), 16)
    tensor_scale, saturated, codes, scaled, _ = _expected("ue5m3", A, blocks)
    assert saturated[:, GROWTH.index(200.0)].all() and not saturated[:, : GROWTH.index(200.0)].any()
    assert int(qx.counts["saturated_blocks"]) == 16
    assert torch.equal(qx.tensor_scale, tensor_scale)
    assert torch.equal(qx.scaled_values().view(16, len(GROWTH), 16), scaled)


def test_current_scaling_nvfp4_never_saturates_on_the_same_tensor():
    _, x2, qx = _fprop_x("nvfp4")
    assert float(qx.tensor_amax) == float(x2.abs().max())
    assert int(qx.counts["saturated_blocks"]) == 0
