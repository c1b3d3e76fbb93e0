"""The plan's Transformer Engine stand-in against ``te.Linear`` under ``NVFP4BlockScaling`` itself:
the FP4 copies TE keeps for backward have the stand-in's shapes and dtypes (skipped without TE and an
FP4 GPU). Without FSDP2, as here, TE also keeps the weight's two copies; under FSDP2 (what the plan
models) it does not."""

import pytest
import torch
from torch import nn

from nemofp4.planning.te_linear import TELinearStandIn, te_linear_operands
from nemofp4.quant import TENVFP4Linear, transformer_engine_status
from nemofp4.recipes import get_recipe

TE_OK, TE_REASON = transformer_engine_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not TE_OK, reason=f"nvfp4_te unavailable: {TE_REASON}")]


def _saved(module: nn.Module, x: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of what autograd keeps, the parameters and scalars (amaxes, RNG states) aside."""
    params = {id(p) for p in module.parameters()}
    saved = []

    def pack(t):
        if id(t) not in params and t.numel() > 2:
            saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cuda", dtype=torch.bfloat16):
        module(x)
    return sorted(saved, key=str)


@pytest.mark.parametrize("disable_rht", [False, True])
def test_the_te_standin_keeps_te_linears_fp4_copies(disable_rht):
    tokens, k, n = 1024, 512, 768
    part = get_recipe("nvfp4_te", disable_rht=disable_rht).parts["fp4"]
    linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    real = _saved(TENVFP4Linear.from_linear(linear, part), x)
    _, w_fprop, _, w_dgrad, _, _ = te_linear_operands(tokens, k, n, part)
    weight_copies = [((rows, cols // 2), torch.uint8) for rows, cols in (w_fprop.shape, w_dgrad.shape)]
    weight_copies += [(w_fprop.scale_shape, torch.uint8), (w_dgrad.scale_shape, torch.uint8)]
    assert real == sorted(_saved(TELinearStandIn(linear, part), x) + weight_copies, key=str)
