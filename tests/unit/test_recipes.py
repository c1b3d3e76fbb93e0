"""Recipe registry, layer selection rules, the per-layer tables, configs and the TE recipe's error."""

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from torch import nn

from nemofp4.models import build_model, get_model_config
from nemofp4.quant import FP32Linear, LinearQuantConfig, QuantLinear, set_step, transformer_engine_status
from nemofp4.recipes import (
    HighPrecision,
    LayerSpan,
    PrecisionConfig,
    RecipeUnavailableError,
    Rule,
    TransformerEngineFP8,
    TransformerEngineNVFP4,
    apply_recipe,
    emulated_config,
    get_recipe,
    last_layers,
    list_recipes,
    precision_config,
    recipe_from_config,
    recipe_knobs,
)
from tests.conftest import StandInModel

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "precision"
ALL = [
    "bf16",
    "nvfp4",
    "nvfp4_te",
    "ue5m3",
    "ue5m3_te_settings",
    "nvfp4_all_fp4_no_rht",
    "mxfp4",
    "nvfp4_delayed",
    "fp8",
    "mxfp8",
    "fp8_te",
    "mxfp8_te",
]
EMULATED = [name for name in ALL if not name.endswith("_te")]


@pytest.fixture(scope="module")
def paper_tables():
    """Each emulated recipe applied to Nemotron-H 8B (paper config) on the meta device."""
    tables = {}
    for name in EMULATED:
        model = build_model(get_model_config("nemotron_h_8b_paper"), device="meta")
        tables[name] = (apply_recipe(model, get_recipe(name), log=False), model)
    return tables


def test_registry_lists_every_recipe_and_each_instantiates_with_its_own_description():
    assert list_recipes() == sorted(ALL)
    for name in ALL:
        recipe = get_recipe(name)
        assert recipe.name == name
        assert len(recipe.description) > 20
        # a copy-pasted docstring (Bridge's "MXFP8" on an NVFP4 recipe) would fail this
        key = {
            "bf16": "BF16",
            "nvfp4": "NVFP4",
            "nvfp4_te": "Transformer Engine",
            "ue5m3": "UE5M3",
            "ue5m3_te_settings": "UE5M3",
            "nvfp4_all_fp4_no_rht": "NVFP4",
            "mxfp4": "MXFP4",
            "nvfp4_delayed": "sample-and-hold",
            "fp8": "Float8CurrentScaling",
            "mxfp8": "MXFP8BlockScaling",
            "fp8_te": "Float8CurrentScaling",
            "mxfp8_te": "MXFP8BlockScaling",
        }[name]
        assert key in recipe.description, (name, recipe.description)


def _layers_of(table, kind):
    return sorted({row.layer for row in table.rows if row.kind == kind})


def test_layer_tables_on_the_paper_8b_model_have_the_documented_counts(paper_tables):
    counts = {name: table.counts() for name, (table, _) in paper_tables.items()}
    assert counts["bf16"] == {"bf16": 113}
    assert counts["ue5m3"] == {"fp4": 112, "fp32": 1}
    assert counts["nvfp4_all_fp4_no_rht"] == {"fp4": 112, "fp32": 1}
    for name in ("nvfp4", "ue5m3_te_settings", "mxfp4"):
        assert counts[name] == {"fp4": 96, "bf16": 16, "fp32": 1}, name
        table = paper_tables[name][0]
        assert _layers_of(table, "bf16") == list(range(44, 52))  # the last 8 pattern layers
        kinds = [row.block_type for row in table.rows if row.kind == "bf16"]
        assert kinds.count("mamba") == 8 and kinds.count("mlp") == 8  # 4 Mamba + 4 MLP layers
    fp4_rows = [row for row in paper_tables["ue5m3"][0].rows if row.kind == "fp4"]
    by_type = {t: sum(row.block_type == t for row in fp4_rows) for t in ("mamba", "attention", "mlp")}
    assert by_type == {"mamba": 48, "attention": 16, "mlp": 48}
    assert paper_tables["ue5m3"][0].by_fqn()["lm_head"].kind == "fp32"
    for name in ("fp8", "mxfp8"):  # every linear but the LM head (Megatron's and TE's default)
        assert counts[name] == {"fp4": 112, "fp32": 1}, name
        table = paper_tables[name][0]
        assert {table.by_fqn()[row.fqn].part for row in table.rows if row.kind == "fp4"} == {"fp8"}
        assert get_recipe(name).parts["fp8"].precision == "fp8"
    tail = build_model(get_model_config("nemotron_h_8b_paper"), device="meta")
    table = apply_recipe(tail, get_recipe("fp8", num_bf16_last_layers=8), log=False)
    assert table.counts() == {"fp4": 96, "bf16": 16, "fp32": 1} and _layers_of(table, "bf16") == list(range(44, 52))


def test_scale_target_override_lands_on_exactly_the_four_down_projections(paper_tables):
    table, model = paper_tables["ue5m3"]
    targeted = {row.fqn for row in table.rows if row.part == "fp4_t2048"}
    assert targeted == {f"layers.{i}.mixer.down_proj" for i in (45, 47, 49, 51)}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            config = module.quant_config
            expected = 2048.0 if name in targeted else 448.0
            assert config.dy_wgrad.scale_target == expected, name
            assert config.dy_dgrad.scale_target == config.x.scale_target == config.w.scale_target == 448.0
    # a model without those layers gets no override, and that is not an error
    tiny = build_model(get_model_config("tiny"), device="meta")
    assert "fp4_t2048" not in {row.part for row in apply_recipe(tiny, get_recipe("ue5m3"), log=False).rows}


def test_recipe_settings_match_the_fact_sheet():
    ue5m3 = get_recipe("ue5m3").parts["fp4"]
    assert {ue5m3.operand(r).scale_format for r in ("x", "w", "dy_dgrad", "dy_wgrad", "x_wgrad")} == {"ue5m3"}
    assert ue5m3.w.two_d and ue5m3.x.reference_interval == 50
    assert (ue5m3.dy_dgrad.rounding, ue5m3.dy_wgrad.rounding, ue5m3.x.rounding, ue5m3.w.rounding) == (
        "sr8",
        "sr8",
        "rne",
        "rne",
    )
    assert not ue5m3.x_wgrad.hadamard and not ue5m3.dy_wgrad.hadamard
    nvfp4 = get_recipe("nvfp4").parts["fp4"]
    assert nvfp4.x.scale_format == "e4m3" and nvfp4.x.reference_interval == 0 and nvfp4.w.two_d
    assert nvfp4.x_wgrad.hadamard and nvfp4.dy_wgrad.hadamard and not nvfp4.x.hadamard
    assert nvfp4.dy_dgrad.rounding == "sr" and nvfp4.x_wgrad.rounding == "rne"
    te_settings = get_recipe("ue5m3_te_settings").parts["fp4"]
    assert (
        te_settings.x.scale_format == "ue5m3" and te_settings.x.reference_interval == 1 and te_settings.x_wgrad.hadamard
    )
    ablation = get_recipe("nvfp4_all_fp4_no_rht").parts["fp4"]
    assert ablation.x.scale_format == "e4m3" and not ablation.x_wgrad.hadamard
    mx = get_recipe("mxfp4").parts["fp4"]
    assert mx.x.scale_format == "ue8m0" and mx.x.block_size == 32 and not mx.w.two_d


def test_every_part_names_its_kind_and_the_emulated_config_that_stands_for_it():
    """A part's ``kind`` is what apply_recipe, the layer table and the memory plan dispatch on (no
    isinstance ladder): each part type has one kind, and TE's native NVFP4 stands for the emulated
    nvfp4 recipe's FP4 config (what the plan and the saves are computed with)."""
    nvfp4_fp4 = get_recipe("nvfp4").parts["fp4"]
    seen = set()
    for name in ALL:
        for part in get_recipe(name).parts.values():
            if isinstance(part, LinearQuantConfig):
                assert (part.kind, emulated_config(part)) == ("fp4", part)
            elif isinstance(part, TransformerEngineNVFP4):
                assert (part.kind, emulated_config(part)) == ("te_nvfp4", nvfp4_fp4)
            elif isinstance(part, TransformerEngineFP8):  # stands for the emulated fp8 / mxfp8 recipe's part
                emulated = get_recipe("fp8" if part.scaling == "current" else "mxfp8").parts["fp8"]
                assert (part.kind, emulated_config(part)) == ("te_fp8", emulated)
            else:
                assert isinstance(part, HighPrecision)
                assert (part.kind, emulated_config(part)) == ("fp32" if part.compute == "fp32" else "bf16", None)
            seen.add(part.kind)
    assert seen == {"fp4", "te_nvfp4", "te_fp8", "fp32", "bf16"}


def test_apply_swaps_classes_in_place_on_meta_and_keeps_the_parameters():
    model = build_model(get_model_config("tiny"), device="meta")
    params = {name: p for name, p in model.named_parameters()}
    table = apply_recipe(model, get_recipe("ue5m3"), log=False)
    assert {name: p for name, p in model.named_parameters()} == params  # same objects, same names
    assert all(p.is_meta for p in model.parameters())
    assert type(model.layers[0].mixer.in_proj) is QuantLinear and type(model.lm_head) is FP32Linear
    assert type(model.embeddings) is nn.Embedding
    assert table.count("fp4") == 14
    model.to_empty(device="cpu")
    model.init_weights()
    set_step(model, 1)
    model(torch.randint(0, 100, (2, 32))).float().sum().backward()
    with pytest.raises(ValueError, match="already applied"):
        apply_recipe(model, get_recipe("ue5m3"), log=False)


@pytest.mark.parametrize(
    ("num_layers", "requested", "kept"),
    [(52, 8, 8), (62, 8, 8), (20, 8, 4), (24, 8, 4), (6, 8, 1), (6, 2, 1), (3, 8, 1), (2, 8, 1), (52, 3, 3)],
)
def test_the_bf16_tail_is_at_most_a_fifth_of_the_layers_and_at_least_one(num_layers, requested, kept):
    # The NVFP4 paper's proportions: last 4 of 20 blocks (1.2B), last 8 of 52 (8B) and of 62 (12B).
    span = last_layers(requested, at_most_fifth=True)
    assert span.resolve(num_layers) == list(range(num_layers - kept, num_layers))
    assert last_layers(requested).resolve(num_layers) == list(range(max(num_layers - requested, 0), num_layers))


@pytest.mark.parametrize("name", ["nvfp4", "ue5m3_te_settings", "mxfp4"])
def test_bf16_tail_recipes_run_on_the_tiny_and_small_presets_by_one_override(name):
    tiny = build_model(get_model_config("tiny"), device="meta")  # 6 layers: "last 8" keeps layer 5 only
    assert _layers_of(apply_recipe(tiny, get_recipe(name), log=False), "bf16") == [5]
    small = build_model(get_model_config("small"), device="meta")  # 24 layers: the last 4
    assert _layers_of(apply_recipe(small, get_recipe(name), log=False), "bf16") == [20, 21, 22, 23]


def test_an_empty_selection_is_an_error_that_names_the_rule_and_the_fix():
    with pytest.raises(ValueError, match="num_bf16_last_layers"):
        apply_recipe(StandInModel("M"), get_recipe("nvfp4"), log=False)  # 1 layer: nothing left for FP4
    with pytest.raises(ValueError, match="at_most_fifth"):
        LayerSpan(first=2, at_most_fifth=True)
    recipe = dataclasses.replace(get_recipe("ue5m3"), rules=(Rule(pattern="layers.*.mixer.in_projj", part="fp4"),))
    with pytest.raises(ValueError, match="in_projj"):
        apply_recipe(StandInModel("M-"), recipe, log=False)


def test_rules_and_layer_spans():
    assert last_layers(8).resolve(52) == list(range(44, 52))
    assert LayerSpan(first=2).resolve(52) == [0, 1]
    assert LayerSpan(indices=(45, 47, 99)).resolve(52) == [45, 47]
    assert last_layers(8).resolve(6) == list(range(6))
    with pytest.raises(ValueError, match="exactly one"):
        LayerSpan(first=1, last=1)
    with pytest.raises(ValueError, match="{layer}"):
        Rule(pattern="layers.*.mixer.*", part="bf16", layers=last_layers(2))
    rule = Rule(pattern="layers.{layer}.mixer.*", part="bf16", layers=last_layers(2))
    match = rule.matcher(12)
    assert match("layers.11.mixer.in_proj") and match("layers.10.mixer.up_proj")
    assert not match("layers.1.mixer.in_proj")  # trailing dot: layers.1 is not layers.10/11


def test_get_recipe_validates_names_and_knobs():
    with pytest.raises(ValueError, match="registered recipes are"):
        get_recipe("nvfp8")
    with pytest.raises(ValueError, match="reference_interval"):
        get_recipe("mxfp4", reference_interval=50)  # UE8M0 scales have no tensor reference
    recipe = get_recipe("ue5m3", reference_interval=10, scale_target=1024.0, gemm="decoded")
    fp4 = recipe.parts["fp4"]
    assert fp4.x.reference_interval == 10 and fp4.x.scale_target == 1024.0 and fp4.gemm == "decoded"
    assert recipe.parts["fp4_t2048"].dy_wgrad.scale_target == 2048.0


def test_every_recipe_has_a_precision_yaml_that_builds_it():
    assert sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) == sorted(ALL)
    for name in ALL:
        node = OmegaConf.load(CONFIG_DIR / f"{name}.yaml")
        cfg = precision_config(node)
        assert cfg.name == name and cfg.restore_references is True and type(cfg) is not PrecisionConfig
        set_knobs = {k: v for k, v in OmegaConf.to_container(node).items() if k not in ("name", "restore_references")}
        assert set_knobs == recipe_knobs(name) == cfg.knobs(), name  # the yaml shows every knob at its default
        assert recipe_from_config(cfg) == get_recipe(name) == recipe_from_config(PrecisionConfig(name=name))
        assert recipe_from_config(node) == get_recipe(name)  # a DictConfig works too


def test_a_knob_the_recipe_does_not_have_is_an_error_naming_it_the_recipe_and_its_knobs():
    recipe = recipe_from_config(precision_config("ue5m3", reference_interval=1, gemm="decoded"))
    assert recipe.parts["fp4"].x.reference_interval == 1 and recipe.parts["fp4"].gemm == "decoded"
    with pytest.raises(
        ValueError, match=r"precision.scale_target=2048.0: recipe 'bf16' has no such knob; its knobs are none"
    ):
        recipe_from_config({"name": "bf16", "scale_target": 2048.0})
    with pytest.raises(ValueError, match=r"num_bf16_last_layers=1: recipe 'ue5m3'.*'block_size', 'gemm'"):
        get_recipe("ue5m3", num_bf16_last_layers=1)
    with pytest.raises(ValueError, match=r"reference_interval=5: recipe 'mxfp4'"):
        precision_config(OmegaConf.create({"name": "mxfp4", "reference_interval": 5}))
    # Hydra-style values are converted and type-checked by the recipe's own dataclass.
    assert precision_config("nvfp4", scale_target=256).scale_target == 256.0
    with pytest.raises(ValidationError, match="reference_interval"):
        precision_config("nvfp4", reference_interval="often")


def test_nvfp4_scale_target_is_a_knob_that_reaches_every_operand():
    fp4 = get_recipe("nvfp4", scale_target=224.0).parts["fp4"]
    assert {fp4.operand(r).scale_target for r in ("x", "w", "dy_dgrad", "dy_wgrad", "x_wgrad")} == {224.0}
    assert get_recipe("nvfp4").parts["fp4"].x.scale_target == 448.0


def test_the_table_is_logged_at_start(caplog):
    with caplog.at_level(logging.INFO, logger="nemofp4.recipes"):
        apply_recipe(StandInModel("M-*-"), get_recipe("ue5m3"))
    text = caplog.text
    assert "recipe ue5m3" in text and "layers.0.mixer.in_proj" in text and "part fp4:" in text


@pytest.mark.skipif(transformer_engine_status()[0], reason="Transformer Engine NVFP4 is available here")
def test_nvfp4_te_without_te_is_a_clear_error_that_suggests_nvfp4():
    recipe = get_recipe("nvfp4_te")  # building the recipe works everywhere
    assert recipe.needs_transformer_engine
    model = build_model(get_model_config("nemotron_h_8b_paper"), device="meta")
    with pytest.raises(RecipeUnavailableError, match="precision=nvfp4") as info:
        apply_recipe(model, recipe, log=False)
    assert "transformer_engine" in str(info.value) or "GPU" in str(info.value)
    assert type(model.layers[0].mixer.in_proj) is nn.Linear  # nothing was swapped


def test_compare_recipes_passes_a_precision_knob_only_to_recipes_that_have_it():
    from types import SimpleNamespace

    from tests.conftest import load_script

    script = load_script("scripts/study/compare_recipes.py")
    args = SimpleNamespace(
        preset="tiny",
        steps=3,
        train_override=["precision.num_bf16_last_layers=1", "precision.restore_references=false", "optim.lr=1e-3"],
    )
    for recipe, kept in (("nvfp4", True), ("ue5m3", False), ("bf16", False)):
        overrides = script.train_overrides(args, recipe, seed=1)
        assert ("precision.num_bf16_last_layers=1" in overrides) is kept, recipe
        assert "precision.restore_references=false" in overrides and "optim.lr=1e-3" in overrides
