"""The nvfp4_te recipe on a machine with Transformer Engine and an FP4 GPU (skipped elsewhere)."""

import pytest
import torch

from nemofp4.quant import TENVFP4Linear, set_step, transformer_engine_status
from nemofp4.recipes import apply_recipe, get_recipe
from tests.conftest import StandInModel

TE_OK, TE_REASON = transformer_engine_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not TE_OK, reason=f"nvfp4_te unavailable: {TE_REASON}")]


def _model(recipe: str, **knobs):
    torch.manual_seed(0)
    with torch.device("cuda"):  # te.Linear is created on the device of the linear it replaces
        model = StandInModel("M-*-M-", d=256, vocab=512)
    table = apply_recipe(model, get_recipe(recipe, **knobs), log=False)
    return model, table


def _sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    reference, approx = reference.double(), approx.double()
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - approx).pow(2).sum()))


def test_nvfp4_te_swaps_in_te_linear_and_trains_close_to_the_emulation():
    te_model, table = _model("nvfp4_te", num_bf16_last_layers=2)
    assert table.count("te_nvfp4") == 8 and table.count("bf16") == 4
    assert isinstance(te_model.layers[0].mixer.in_proj, TENVFP4Linear)
    emulated, _ = _model("nvfp4", num_bf16_last_layers=2)
    reference, _ = _model("bf16")
    emulated.load_state_dict(te_model.state_dict())
    reference.load_state_dict(te_model.state_dict())
    ids = torch.randint(0, 512, (4, 256), device="cuda")
    outputs = {}
    for name, model in (("te", te_model), ("emulated", emulated), ("bf16", reference)):
        set_step(model, 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
        logits.float().logsumexp(-1).mean().backward()
        outputs[name] = (logits.float().detach(), model.layers[0].mixer.in_proj.weight.grad.float())
    for i, what in enumerate(("logits", "in_proj dW")):
        te_vs_bf16 = _sqnr_db(outputs["bf16"][i], outputs["te"][i])
        emulated_vs_bf16 = _sqnr_db(outputs["bf16"][i], outputs["emulated"][i])
        # Native and emulated NVFP4 make errors of the same size against BF16.
        assert abs(te_vs_bf16 - emulated_vs_bf16) < 3.0, (what, te_vs_bf16, emulated_vs_bf16)
        assert te_vs_bf16 > 8.0, (what, te_vs_bf16)
