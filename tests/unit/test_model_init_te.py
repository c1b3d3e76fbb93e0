"""nvfp4_te initialisation: a projection swapped for a non-``nn.Linear`` (Transformer Engine's
``te.Linear``) gets exactly the init the emulated recipes give, draw for draw."""

import torch
from torch import nn

from nemofp4.models import build_model, get_model_config
from nemofp4.quant import TENVFP4Linear
from nemofp4.recipes import apply as recipe_apply
from nemofp4.recipes import apply_recipe, get_recipe


class StandInTELinear(TENVFP4Linear):
    """What te.Linear looks like to init code: not an nn.Linear, its own weight, a placeholder bias."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = torch.empty(0, device=linear.weight.device)  # TE keeps an empty tensor when bias=False

    def forward(self, x):
        return nn.functional.linear(x, self.weight)


def _initialised(recipe_name: str) -> nn.Module:
    cfg = get_model_config("tiny")
    model = build_model(cfg, device="meta")
    apply_recipe(model, get_recipe(recipe_name, num_bf16_last_layers=2), log=False)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(float("nan"))
    torch.manual_seed(11)
    model.init_weights()
    return model


def test_nvfp4_te_init_equals_emulated_nvfp4_init(monkeypatch):
    monkeypatch.setattr(recipe_apply, "transformer_engine_status", lambda part=None: (True, ""))
    monkeypatch.setattr(TENVFP4Linear, "from_linear", staticmethod(lambda linear, part: StandInTELinear(linear)))
    te_model = _initialised("nvfp4_te")
    emulated = _initialised("nvfp4")
    swapped = [name for name, m in te_model.named_modules() if isinstance(m, StandInTELinear)]
    assert len(swapped) >= 4  # the tiny model's FP4 projections really are non-nn.Linear modules
    te_state, emu_state = te_model.state_dict(), emulated.state_dict()
    assert set(te_state) >= {f"{name}.weight" for name in swapped}
    for name, value in emu_state.items():
        if name in te_state:
            assert torch.isfinite(te_state[name]).all(), f"{name} was never initialised"
            assert torch.equal(te_state[name], value), name
