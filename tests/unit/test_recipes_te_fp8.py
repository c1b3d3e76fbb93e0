"""The Transformer Engine FP8 recipes, fp8_te (Float8CurrentScaling) and mxfp8_te (MXFP8BlockScaling):
their parts and layer tables, the emulated recipe that stands for each, the TE recipe object built from
the part's fields, which GPUs run them, and the one-line refusal where TE or such a GPU is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest
import torch
from torch import nn

from nemofp4.models import build_model, get_model_config
from nemofp4.quant import TE_RECIPES, TELinear, transformer_engine_status
from nemofp4.quant import te_linear as quant_te
from nemofp4.recipes import (
    RecipeUnavailableError,
    TransformerEngineFP8,
    apply_recipe,
    emulated_config,
    emulated_recipe,
    get_recipe,
    precision_config,
    runs_in_transformer_engine,
)
from nemofp4.recipes import apply as recipe_apply
from nemofp4.recipes.recipe import TE_FP8_FORMATS
from nemofp4.recipes.registry import FP8_FORMATS

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
TE_FP8 = {"fp8_te": ("fp8", "Float8CurrentScaling"), "mxfp8_te": ("mxfp8", "MXFP8BlockScaling")}
"""recipe -> (the emulated recipe standing for it, TE's recipe class)."""


class _StandInTELinear(TELinear):
    """What apply_recipe puts in place of te.Linear here, where TE is not installed."""

    def __init__(self, linear: nn.Linear, part) -> None:
        super().__init__()
        self.weight, self.part = linear.weight, part


@pytest.fixture
def te_present(monkeypatch):
    """apply_recipe as on a machine that runs every TE recipe (the swap itself is a stand-in)."""
    monkeypatch.setattr(recipe_apply, "transformer_engine_status", lambda part=None: (True, ""))
    monkeypatch.setattr(TELinear, "from_linear", staticmethod(_StandInTELinear))


def _table(preset: str, recipe: str, **knobs):
    model = build_model(get_model_config(preset), device="meta")
    return apply_recipe(model, get_recipe(recipe, **knobs), log=False), model


@pytest.mark.parametrize("name", list(TE_FP8))
def test_the_recipes_build_a_te_fp8_part_for_every_eligible_linear(name):
    emulated, te_class = TE_FP8[name]
    recipe = get_recipe(name)
    part = recipe.parts["fp8"]
    assert recipe.needs_transformer_engine and runs_in_transformer_engine(part)
    assert (part.kind, part.te_recipe, part.power_of_two_scales) == ("te_fp8", te_class, False)
    assert part.fp8_format == ("hybrid" if name == "fp8_te" else "e4m3")  # TE's default of each recipe
    assert te_class in recipe.description
    doc = " ".join(type(precision_config(name)).__doc__.split())  # which linears run FP8, and the source
    assert "Every linear but the" in doc and "LM head in FP32" in doc and "Megatron" in doc
    assert recipe.knobs["num_bf16_last_layers"] == 0
    assert emulated_recipe(part).name == emulated
    assert TE_RECIPES[te_class].gemm == "fp8"


@pytest.mark.parametrize("name", list(TE_FP8))
def test_layer_tables_every_linear_but_the_head_in_te_fp8_and_the_bf16_tail(name, te_present):
    emulated = TE_FP8[name][0]
    table, model = _table("nemotron_h_8b_paper", name)
    assert table.counts() == {"te_fp8": 112, "fp32": 1}
    assert table.by_fqn()["lm_head"].kind == "fp32"
    assert isinstance(model.layers[0].mixer.in_proj, _StandInTELinear)
    assert model.layers[0].mixer.in_proj.part == get_recipe(name).parts["fp8"]
    # the same rows as the emulated recipe's table, kind aside
    emulated_table, _ = _table("nemotron_h_8b_paper", emulated)
    assert [(r.fqn, r.part, r.kind.replace("fp4", "te_fp8")) for r in emulated_table.rows] == [
        (r.fqn, r.part, r.kind) for r in table.rows
    ]
    tail, _ = _table("nemotron_h_8b_paper", name, num_bf16_last_layers=8)
    assert tail.counts() == {"te_fp8": 96, "bf16": 16, "fp32": 1}
    assert sorted({r.layer for r in tail.rows if r.kind == "bf16"}) == list(range(44, 52))
    tiny, _ = _table("tiny", name)
    tiny_linears = sum(isinstance(m, nn.Linear) for m in build_model(get_model_config("tiny"), device="meta").modules())
    assert tiny.counts() == {"te_fp8": tiny_linears - 1, "fp32": 1}
    tiny_tail, _ = _table("tiny", name, num_bf16_last_layers=8)  # capped at a fifth of the 6 layers: the last
    assert {r.layer for r in tiny_tail.rows if r.kind == "bf16"} == {5}
    assert "part fp8: te.Linear " + TE_FP8[name][1] in tail.format()


def test_the_emulated_config_of_each_te_fp8_part_is_the_emulated_recipes():
    fp8, mxfp8 = (get_recipe(n).parts["fp8"] for n in ("fp8", "mxfp8"))
    assert emulated_config(get_recipe("fp8_te").parts["fp8"]) == fp8
    assert emulated_config(get_recipe("mxfp8_te").parts["fp8"]) == mxfp8
    assert mxfp8.x.mx_scale_mode == "ceil"  # TE's round-up E8M0 scale
    assert (fp8.x.element_format, fp8.w.element_format, fp8.dy_dgrad.element_format) == ("e4m3", "e4m3", "e5m2")
    knobs = dict(fp8_format="e4m3", power_of_two_scales=True)
    assert emulated_config(get_recipe("fp8_te", **knobs).parts["fp8"]) == get_recipe("fp8", **knobs).parts["fp8"]
    hybrid = emulated_config(get_recipe("mxfp8_te", fp8_format="hybrid").parts["fp8"])
    assert hybrid == get_recipe("mxfp8", fp8_format="hybrid").parts["fp8"] and hybrid.dy_wgrad.element_format == "e5m2"


def test_a_bad_part_setting_names_the_value_and_what_is_valid():
    assert TE_FP8_FORMATS == FP8_FORMATS  # one list of TE's training formats for the TE and emulated recipes
    with pytest.raises(ValueError, match=r"scaling='delayed'; valid: current, mxfp8"):
        TransformerEngineFP8(scaling="delayed")
    with pytest.raises(ValueError, match=r"fp8_format='e5m2'; valid: hybrid, e4m3"):
        get_recipe("fp8_te", fp8_format="e5m2")
    with pytest.raises(ValueError, match="power_of_two_scales=True is for per-tensor"):
        TransformerEngineFP8(scaling="mxfp8", power_of_two_scales=True)


def test_which_gpus_run_which_te_recipe():
    def runs(capability):
        return {name: spec.supports(capability) for name, spec in TE_RECIPES.items()}

    # TE's rules (quantization.py): FP8 from SM 8.9; MXFP8 on 10.x and 11.x, not 12.x; NVFP4 on 10.x here
    assert runs((8, 6)) == {"NVFP4BlockScaling": False, "Float8CurrentScaling": False, "MXFP8BlockScaling": False}
    assert (
        runs((8, 9))
        == runs((9, 0))
        == {"NVFP4BlockScaling": False, "Float8CurrentScaling": True, "MXFP8BlockScaling": False}
    )
    assert runs((10, 0)) == dict.fromkeys(TE_RECIPES, True)
    assert runs((12, 0)) == {"NVFP4BlockScaling": False, "Float8CurrentScaling": True, "MXFP8BlockScaling": False}
    # per-tensor FP8 keeps a transpose where FP8 GEMMs are TN-only (nvte_is_non_tn_fp8_gemm_supported)
    assert [quant_te.fp8_gemm_any_layout(c) for c in ((9, 0), (10, 0), (11, 0), (12, 0), (13, 0))] == [
        False,
        True,
        True,
        False,
        True,
    ]


# ------------------------------------------------------------------------------------ TE's recipe objects
class _Format(Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"


@dataclass(frozen=True)
class _QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


@dataclass
class _Float8CurrentScaling:
    """TE's shape of it: the quantizer settings are class attributes seeded from the environment at import."""

    use_power_2_scales: bool = False
    fp8_format: _Format = _Format.HYBRID
    backward_override: str | None = "high_precision"  # as if NVTE_BACKWARD_OVERRIDE were set
    fp8_quant_fwd_inp = _QParams(power_2_scale=True)  # as if NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1
    fp8_quant_fwd_weight = _QParams(power_2_scale=True)
    fp8_quant_bwd_grad = _QParams(power_2_scale=True)


@dataclass
class _MXFP8BlockScaling:
    fp8_format: _Format = _Format.E4M3
    backward_override: str | None = "dequantized"


@dataclass
class _NVFP4BlockScaling:
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False


def _fake_transformer_engine(monkeypatch, *, qparams: bool = True, checkers: dict | None = None) -> None:
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.Float8CurrentScaling = _Format, _Float8CurrentScaling
    recipe.MXFP8BlockScaling, recipe.NVFP4BlockScaling = _MXFP8BlockScaling, _NVFP4BlockScaling
    if qparams:
        recipe.QParams = _QParams
    common, pytorch, package = (types.ModuleType(f"transformer_engine{s}") for s in (".common", ".pytorch", ""))
    common.recipe, package.common, package.pytorch = recipe, common, pytorch
    for name, checker in (checkers or {}).items():
        setattr(pytorch, name, checker)
    for module in (package, common, recipe, pytorch):
        monkeypatch.setitem(sys.modules, module.__name__, module)


def test_the_te_recipe_object_comes_from_the_parts_fields_not_the_environment(monkeypatch):
    _fake_transformer_engine(monkeypatch)
    current = quant_te.build_te_recipe(get_recipe("fp8_te").parts["fp8"])
    assert isinstance(current, _Float8CurrentScaling) and current.fp8_format is _Format.HYBRID
    assert current.backward_override is None
    assert [getattr(current, q) for q in quant_te._QPARAMS] == [_QParams(power_2_scale=False)] * 3
    pow2 = quant_te.build_te_recipe(get_recipe("fp8_te", fp8_format="e4m3", power_of_two_scales=True).parts["fp8"])
    assert pow2.fp8_format is _Format.E4M3 and pow2.use_power_2_scales
    assert [getattr(pow2, q).power_2_scale for q in quant_te._QPARAMS] == [True] * 3
    mx = quant_te.build_te_recipe(get_recipe("mxfp8_te").parts["fp8"])
    assert isinstance(mx, _MXFP8BlockScaling) and mx.fp8_format is _Format.E4M3 and mx.backward_override is None
    nvfp4 = quant_te.build_te_recipe(get_recipe("nvfp4_te", disable_rht=True).parts["fp4"])
    assert isinstance(nvfp4, _NVFP4BlockScaling) and nvfp4.disable_rht and not nvfp4.disable_2d_quantization


def test_availability_follows_te_and_the_gpu(monkeypatch):
    fp8, mxfp8 = get_recipe("fp8_te").parts["fp8"], get_recipe("mxfp8_te").parts["fp8"]
    _fake_transformer_engine(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert transformer_engine_status(fp8) == (False, "no CUDA GPU is visible")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    # a TE without its own checks: the capability rule
    assert transformer_engine_status(fp8) == (True, "")
    ok, reason = transformer_engine_status(mxfp8)
    assert not ok and reason == (
        "the GPU (NVIDIA H100 80GB HBM3, SM 9.0) cannot run MXFP8BlockScaling, which needs "
        "MXFP8 tensor cores (SM 10.x: Blackwell)"
    )
    # TE's own check, where it has one, decides
    reason = "Device compute capability 10.0 or higher required for MXFP8 execution."
    _fake_transformer_engine(monkeypatch, checkers={"is_mxfp8_available": lambda return_reason=False: (False, reason)})
    assert transformer_engine_status(mxfp8) == (
        False,
        f"Transformer Engine reports MXFP8BlockScaling unavailable ({reason})",
    )
    # a knob the installed TE cannot honour is refused before any linear is swapped
    _fake_transformer_engine(monkeypatch, qparams=False)
    ok, reason = transformer_engine_status(get_recipe("fp8_te", power_of_two_scales=True).parts["fp8"])
    assert not ok and "precision.power_of_two_scales=true" in reason and "power_of_two_scales=false" in reason
    assert transformer_engine_status(fp8) == (True, "")


# ------------------------------------------------------------------------------------ the refusal here
@pytest.mark.parametrize("name", list(TE_FP8))
def test_without_te_the_recipe_is_refused_in_one_line_naming_the_emulated_alternative(name):
    emulated, te_class = TE_FP8[name]
    recipe = get_recipe(name)
    if transformer_engine_status(recipe.parts["fp8"])[0]:
        pytest.skip(f"Transformer Engine runs {te_class} here")
    model = build_model(get_model_config("tiny"), device="meta")
    with pytest.raises(RecipeUnavailableError) as info:
        apply_recipe(model, recipe, log=False)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"recipe {name!r} runs te.Linear under Transformer Engine's {te_class}, but ")
    assert message.endswith(f"Use precision={emulated} instead: the same recipe emulated bit-faithfully in PyTorch.")
    assert type(model.layers[0].mixer.in_proj) is nn.Linear  # nothing was swapped


def test_nemofp4_train_with_fp8_te_here_exits_with_that_one_line(tmp_path):
    if transformer_engine_status(get_recipe("fp8_te").parts["fp8"])[0]:
        pytest.skip("Transformer Engine runs Float8CurrentScaling here")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemofp4.cli.train",
            "experiment=tiny_bf16",
            "precision=fp8_te",
            f"run_dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "nemofp4-train: error: recipe 'fp8_te' runs te.Linear under Transformer Engine's Float8CurrentScaling, but "
    )
    assert "Use precision=fp8 instead" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
