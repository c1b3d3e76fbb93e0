"""Issue-17 numerics against re-derivations written from the upstream sources, not from our code.

Each oracle below restates one rule as Transformer Engine (``NVFP4BlockScaling``) or the UE5M3
paper's code computes it, in plain float32 numpy/Python steps, and the tests compare our paths
bitwise with it (eager, compiled and the Triton interpreter where the path exists).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nemofp4.formats import quantize_blocks
from nemofp4.formats.block import amax
from nemofp4.kernels import cpu_compile_available
from nemofp4.kernels.program import quantize_operand
from nemofp4.quant import QuantLinear
from nemofp4.recipes import get_recipe
from tests.unit.test_quant_standin import one_thread  # noqa: F401 (autouse fixture)

f32 = np.float32


def _fp4_config(recipe: str):
    return get_recipe(recipe).parts["fp4"]


def _paths():
    return [False, True] if cpu_compile_available() else [False]


# ----------------------------------------------------------------------- item 1: -0 amax
@pytest.mark.parametrize("recipe", ["nvfp4_all_fp4_no_rht", "nvfp4", "ue5m3", "mxfp4"])
def test_negative_zero_operand_gives_zero_output_and_gradients(recipe):
    """TE's amax is max|x| = +0; a -0 amax made G = 2688/-0 = -inf pass the zero guard (NaN)."""
    layer = nn.Linear(32, 16, bias=False)
    QuantLinear.from_linear(layer, _fp4_config(recipe), index=3)
    layer.set_step(1, seed=7, rank=0)
    x = (-torch.zeros(16, 32)).requires_grad_()
    y = layer(x)
    y.backward(-torch.zeros_like(y))
    for t in (y, x.grad, layer.weight.grad):
        assert torch.isfinite(t).all() and (t == 0).all()


@pytest.mark.parametrize("scale_format", ["e4m3", "ue5m3"])
@pytest.mark.parametrize("compiled", _paths())
def test_negative_zero_amax_is_positive_zero_on_every_path(scale_format, compiled):
    x = -torch.zeros(16, 32)
    assert not torch.signbit(amax(x))
    q = quantize_blocks(x, scale_format)
    assert not torch.signbit(q.tensor_amax) and torch.isfinite(q.tensor_scale) and q.tensor_scale > 0
    assert (q.dequantize() == 0).all()
    op = _fp4_config("nvfp4_all_fp4_no_rht" if scale_format == "e4m3" else "ue5m3").x
    # a held reference measured by amax() of a -0 tensor
    p = quantize_operand(x, op, tensor_amax=amax(x), compiled=compiled)
    assert torch.isfinite(p.tensor_scale) and p.tensor_scale > 0 and (p.dequantize() == 0).all()
