"""fp8_te and mxfp8_te on a machine with Transformer Engine and a GPU that runs the recipe (skipped
elsewhere): ``te.Linear`` under Float8CurrentScaling / MXFP8BlockScaling computes what the emulated
fp8 / mxfp8 recipe computes (the same codes and scales; only the GEMMs' accumulation and the BF16
outputs differ), and keeps for backward what the planner's stand-in says."""

import pytest
import torch
from torch import nn

from nemofp4.planning.te_linear import TELinearStandIn, te_linear_operands
from nemofp4.quant import QuantLinear, TELinear, set_step, transformer_engine_status
from nemofp4.quant.te_linear import fp8_gemm_any_layout
from nemofp4.recipes import apply_recipe, get_recipe
from tests.conftest import StandInModel, linear_names

EMULATED = {"fp8_te": "fp8", "mxfp8_te": "mxfp8"}
STATUS = {name: transformer_engine_status(get_recipe(name).parts["fp8"]) for name in EMULATED}
pytestmark = pytest.mark.gpu
RECIPES = [
    pytest.param(name, marks=pytest.mark.skipif(not STATUS[name][0], reason=f"{name} unavailable: {STATUS[name][1]}"))
    for name in EMULATED
]
TOKENS, K, N = 1024, 512, 768


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _run(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad


@pytest.mark.parametrize("name", RECIPES)
def test_te_linear_computes_what_the_emulated_recipe_computes(name):
    torch.manual_seed(0)
    linears = [nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for linear in linears[1:]:
        linear.weight.data.copy_(linears[0].weight.data)
    te = TELinear.from_linear(linears[0], get_recipe(name).parts["fp8"])
    emulated = QuantLinear.from_linear(linears[1], get_recipe(EMULATED[name]).parts["fp8"])
    set_step(emulated, 1)
    x = torch.randn(TOKENS, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(TOKENS, N, device="cuda", dtype=torch.bfloat16)
    outputs = {what: _run(module, x, dy) for what, module in (("te", te), ("emulated", emulated), ("bf16", linears[2]))}
    for i, what in enumerate(("Y", "dX", "dW")):
        native, emulation, reference = (outputs[k][i] for k in ("te", "emulated", "bf16"))
        # the same FP8 operands: the products differ by accumulation order and BF16 rounding alone, far
        # less than FP8's own error against BF16 (which shows the GEMMs did run on FP8 operands)
        assert _relative(native, emulation) < 1e-2, (what, _relative(native, emulation))
        assert 5e-3 < _relative(emulation, reference) < 0.2, (what, _relative(emulation, reference))


@pytest.mark.parametrize("name", RECIPES)
def test_apply_recipe_swaps_in_te_linear_for_every_linear_but_the_head(name):
    with torch.device("cuda"):
        model = StandInModel("M-*-M-", d=256, vocab=512)
    table = apply_recipe(model, get_recipe(name), log=False)
    eligible = sum(fqn != "lm_head" for fqn, _ in linear_names(model))
    assert table.counts() == {"te_fp8": eligible, "fp32": 1}
    assert isinstance(model.layers[0].mixer.in_proj, TELinear)
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids)
    logits.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(model.layers[0].mixer.in_proj.weight.grad).all()


def _saved(module: nn.Module, x: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of what autograd keeps, the parameters and scalars (scales, amaxes) aside."""
    params = {id(p) for p in module.parameters()}
    saved = []

    def pack(t):
        if id(t) not in params and t.numel() > 2:
            saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sorted(saved, key=str)


@pytest.mark.parametrize("name", RECIPES)
def test_the_te_standin_keeps_te_linears_fp8_copies(name):
    """Without FSDP2, as here, TE also keeps the weight's copies; under FSDP2 (what the plan models) it
    does not. Per-tensor FP8 on a GPU whose FP8 GEMMs take any layout (Blackwell) keeps the row-wise data
    for wgrad where Hopper keeps the transpose the stand-in allocates: the same bytes."""
    part = get_recipe(name).parts["fp8"]
    linear = nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TOKENS, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    real = _saved(TELinear.from_linear(linear, part), x)
    _, w_fprop, _, w_dgrad, _, _ = te_linear_operands(TOKENS, K, N, part)
    one_copy = part.te_recipe == "Float8CurrentScaling" and fp8_gemm_any_layout(torch.cuda.get_device_capability())
    standin = _saved(TELinearStandIn(linear, part), x)
    if one_copy:
        standin = [(tuple(reversed(shape)), dtype) for shape, dtype in standin]
    weight = []
    for op in (w_fprop,) if one_copy else (w_fprop, w_dgrad):
        rows, cols = op.stored_shape
        weight.append(((rows, cols // op.storage.codes_per_byte), torch.uint8))
        if op.stored_scale_shape:
            weight.append((op.stored_scale_shape, torch.uint8))
    assert real == sorted(standin + weight, key=str)
