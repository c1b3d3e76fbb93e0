"""A hybrid with SwiGLU MLPs (``model.mlp_activation=swiglu``) through the recipes, the trainer and the export."""

from __future__ import annotations

import math

import pytest
from torch.distributed.checkpoint import FileSystemReader

from nemofp4.models import build_model, get_model_config
from nemofp4.recipes import get_recipe, list_recipes
from nemofp4.recipes.apply import resolve_recipe
from tests.conftest import curve, held_references, train_here

PRECISIONS = ("bf16", "ue5m3")


@pytest.mark.parametrize("recipe", list_recipes())
def test_recipes_give_the_fused_gate_up_linear_the_part_they_give_up_proj(recipe):
    # The recipes select by module name (layers.*.mixer.*): the fused linear is one more mixer projection.
    def parts(mlp_activation):
        model = build_model(get_model_config("tiny", mlp_activation=mlp_activation), device="meta")
        return {
            name.replace("gate_up_proj", "up_proj"): rule for name, _, rule in resolve_recipe(model, get_recipe(recipe))
        }

    swiglu = parts("swiglu")
    assert swiglu == parts("relu2")
    assert any(rule is not None for name, rule in swiglu.items() if name.endswith("mixer.up_proj"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two steps of the tiny hybrid with SwiGLU MLPs in BF16 compute, per recipe: its run directory."""
    root = tmp_path_factory.mktemp("swiglu")
    for precision in PRECISIONS:
        train_here(
            root / precision,
            f"precision={precision}",
            "model.mlp_activation=swiglu",
            "train.max_steps=2",
            "train.dtype=bfloat16",
        )
    return {precision: root / precision for precision in PRECISIONS}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_swiglu_hybrid_trains(runs, precision):
    run = runs[precision]
    assert sorted(curve(run)) == [1, 2]
    assert all(math.isfinite(loss) and math.isfinite(norm) for loss, norm in curve(run).values())
    assert "mlp_activation: swiglu" in (run / "config.yaml").read_text()
    saved = FileSystemReader(str(run / "checkpoints" / "step-2")).read_metadata().state_dict_metadata
    tiny = get_model_config("tiny")
    for i in (i for i, symbol in enumerate(tiny.hybrid_layer_pattern) if symbol == "-"):
        assert tuple(saved[f"model.layers.{i}.mixer.gate_up_proj.weight"].size) == (
            2 * tiny.ffn_hidden_size,
            tiny.hidden_size,
        )
        assert f"model.layers.{i}.mixer.up_proj.weight" not in saved


def test_the_fused_gate_up_linear_is_quantized_like_any_other(runs):
    # ue5m3 holds a reference per operand of each FP4 linear, sampled at step 1: the checkpoint has them.
    references = held_references(runs["ue5m3"] / "checkpoints" / "step-2")
    fused = {k: v for k, v in references.items() if ".gate_up_proj." in k}
    assert {k.rsplit(".", 2)[-2] for k in fused} == {"x", "w", "dy"}
    assert all(v.item() == 1 for k, v in fused.items() if k.endswith(".refresh_step"))
    assert all(v.item() > 0 for k, v in fused.items() if k.endswith(".amax"))


def test_the_hf_export_refuses_a_swiglu_run_in_one_line(runs, tmp_path, capsys, monkeypatch):
    # transformers' NemotronH has no gated MLP: the export names the knob instead of writing a folder
    # transformers would load into another model.
    from nemofp4.cli.errors import run_cli
    from nemofp4.cli.export import export_checkpoint
    from nemofp4.evaluation.config import ExportConfig

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    out = tmp_path / "hf"
    with pytest.raises(SystemExit) as exit_info:
        run_cli(
            lambda: export_checkpoint(ExportConfig(checkpoint=str(runs["bf16"]), out=str(out))),
            name="nemofp4-export-hf",
        )
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nemofp4-export-hf: error: model.mlp_activation=swiglu does not export")
    assert not any(out.iterdir())
