"""A QuantLinear inside a ``torch.compile(fullgraph=True)`` graph computes what the eager one does, to the
bit: outputs and both gradients, stochastic rounding included (same seeds, same steps). Inductor may
compile the ops around it differently from eager (a norm's reduction order), so the norm->linear case
feeds the eager linear the compiled norm's output: any difference left would be the FP4 linear's."""

import copy

import pytest
import torch
from torch import nn

from nemofp4.kernels import cpu_compile_available
from nemofp4.models.nemotron_h.model import RMSNorm
from nemofp4.quant import QuantLinear
from nemofp4.recipes import get_recipe

pytestmark = [
    pytest.mark.usefixtures("one_thread", "eager_quantizer"),
    pytest.mark.skipif(not cpu_compile_available(), reason="needs a C++ compiler for torch.compile"),
]


def _linear(recipe: str) -> QuantLinear:
    torch.manual_seed(0)
    part = next(p for p in get_recipe(recipe).parts.values() if p.kind == "fp4")  # the emulated quantized part
    return QuantLinear.from_linear(nn.Linear(64, 48), part, index=2)


def _step(module, x, dy, step):
    for m in module.modules():
        if isinstance(m, QuantLinear):
            m.set_step(step, seed=5, rank=1)
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(
        a.view(torch.int32) if a.dtype == torch.float32 else a, b.view(torch.int32) if b.dtype == torch.float32 else b
    )


@pytest.mark.parametrize("recipe", ["ue5m3", "nvfp4", "fp8", "mxfp8"])
def test_compiled_quant_linear_is_bitwise_the_eager_one(recipe):
    eager = _linear(recipe)
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    for step in (1, 2):  # a new step reseeds the SR generator: the compiled graph must follow
        x, dy = torch.randn(3, 40, 64, generator=gen), torch.randn(3, 40, 48, generator=gen)
        y_e, dx_e, g_e = _step(eager, x, dy, step)
        y_c, dx_c, g_c = _step(compiled, x, dy, step)
        for a, b in zip([y_e, dx_e, *g_e], [y_c, dx_c, *g_c], strict=True):
            _assert_bitwise(a, b)


class _NormLinear(nn.Module):
    def __init__(self, recipe: str) -> None:
        super().__init__()
        self.norm = RMSNorm(64, 1e-5)
        self.norm.reset_parameters()
        self.linear = _linear(recipe)

    def forward(self, x):
        return self.linear(self.norm(x))


@pytest.mark.parametrize("recipe", ["ue5m3", "nvfp4"])
def test_compiled_norm_then_quant_linear_quantizes_what_the_eager_linear_would(recipe):
    """The compiled block's linear gets the compiled norm's output; the eager linear fed that same
    tensor (and the compiled norm's backward fed the eager linear's dX) gives the same bits."""
    block = _NormLinear(recipe)
    compiled = torch.compile(copy.deepcopy(block), fullgraph=True)
    norm_alone = torch.compile(copy.deepcopy(block.norm), fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    x, dy = torch.randn(2, 24, 64, generator=gen), torch.randn(2, 24, 48, generator=gen)
    y_c, dx_c, (g_norm_c, *g_lin_c) = _step(compiled, x, dy, 1)

    h = norm_alone(x.clone().requires_grad_())
    h_in = h.detach().requires_grad_()
    y_e, dh_e, g_lin_e = _step(block.linear, h_in, dy, 1)
    for a, b in zip([y_e, *g_lin_e], [y_c, *g_lin_c], strict=True):
        _assert_bitwise(a, b)
    x_in = x.clone().requires_grad_()
    norm_alone(x_in).backward(dh_e)
    _assert_bitwise(x_in.grad, dx_c)


@pytest.mark.parametrize("recipe", ["ue5m3", "nvfp4"])
def test_a_captured_graph_without_inductor_is_bitwise_eager(recipe):
    """The norm->linear block captured whole (the FP4 ops in the graph) and run without Inductor's code
    generation (``backend="aot_eager"``) gives eager's bits, norm included: what a compiled model's
    loss moves by comes from Inductor's code for the ops around the FP4 linears, not from the capture."""
    block = _NormLinear(recipe)
    captured = torch.compile(copy.deepcopy(block), fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(5)
    for step in (1, 2):
        x, dy = torch.randn(2, 24, 64, generator=gen), torch.randn(2, 24, 48, generator=gen)
        y_e, dx_e, g_e = _step(block, x, dy, step)
        y_c, dx_c, g_c = _step(captured, x, dy, step)
        for a, b in zip([y_e, dx_e, *g_e], [y_c, dx_c, *g_c], strict=True):  # the norm's and linear's gradients too
            _assert_bitwise(a, b)
