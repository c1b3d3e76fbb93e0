"""Parity with transformers' NemotronHForCausalLM through our export, and the state-dict round trip."""

import json

import pytest
import torch

from nemofp4.models import build_model, get_model_config
from nemofp4.models.nemotron_h import (
    export_hf,
    from_hf_config,
    from_hf_state_dict,
    import_hf,
    to_hf_config,
    to_hf_state_dict,
)
from tests import conftest

transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-5
"""Both models compute in float32 but sum in different orders (their chunked einsum scan against our
scan, fused against split projections): about 1e-6 apart at logits of magnitude ~2 (transformers
5.25, the perturbed tiny model), a few float32 ulps per layer. A real mismatch (a weight not loaded,
dt clamped differently) moves them by 1e-4 or more."""


def perturbed_tiny(seed=0, **overrides):
    return conftest.perturbed_tiny(seed, **overrides).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = perturbed_tiny()
    out = export_hf(model, tmp_path_factory.mktemp("hf_tiny"))
    hf, info = transformers.NemotronHForCausalLM.from_pretrained(out, output_loading_info=True)
    return model, out, hf.eval(), info


def test_export_loads_with_no_missing_or_unexpected_keys(exported):
    _, out, hf, info = exported
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert hf.config.hybrid_override_pattern == "M-*-M-"


def test_logits_match_transformers(exported):
    model, _, hf, _ = exported
    ids = torch.randint(0, model.config.vocab_size, (2, 150))  # 150: not a multiple of the chunk (64)
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert theirs.abs().max() > 1.0  # a meaningful scale, not an all-near-zero output
    assert (ours - theirs).abs().max() <= LOGIT_TOL


def test_state_dict_round_trip_is_exact(exported):
    model, out, hf, _ = exported
    ours = model.state_dict()
    hf_state = to_hf_state_dict(ours)
    # The released checkpoints' layout ("backbone."), which transformers renames to "model." on load.
    assert {k.replace("backbone.", "model.", 1) for k in hf_state} == set(hf.state_dict())
    back = from_hf_state_dict(hf_state)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    # transformers' in-memory names use "model." rather than "backbone.": both import.
    for imported in (import_hf(out), import_hf(hf)):
        got = imported.state_dict()
        assert got.keys() == ours.keys() and all(torch.equal(got[k], ours[k]) for k in ours)
        assert imported.config == model.config


def test_hf_in_memory_names_map_onto_ours(exported):
    model, _, hf, _ = exported
    hf_names = set(from_hf_state_dict(hf.state_dict()))
    assert hf_names == set(model.state_dict())


def test_a_swiglu_model_is_refused_by_the_export_before_anything_is_written(exported, tmp_path):
    # transformers' NemotronH MLP is up_proj -> relu2 -> down_proj, with no gate to load SwiGLU's into
    _, _, hf, _ = exported
    mlp = next(layer.mixer for layer in hf.model.layers if layer.block_type == "mlp")
    assert {name for name, m in mlp.named_modules() if isinstance(m, torch.nn.Linear)} == {"up_proj", "down_proj"}
    model = build_model(get_model_config("tiny", mlp_activation="swiglu"), device="meta")
    with pytest.raises(ValueError, match="model.mlp_activation=swiglu does not export to Hugging Face"):
        export_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="model.mlp_activation=swiglu"):
        to_hf_config(model.config)


def test_config_round_trip_and_legacy_keys():
    cfg = get_model_config("nemotron_h_8b")
    assert from_hf_config(to_hf_config(cfg)) == cfg
    legacy = to_hf_config(cfg)
    del legacy["hybrid_override_pattern"], legacy["n_groups"], legacy["head_dim"]
    legacy["layers_block_type"] = [
        "mamba" if s == "M" else "attention" if s == "*" else "mlp" for s in cfg.hybrid_layer_pattern
    ]
    legacy["mamba_n_groups"], legacy["attention_head_dim"] = 8, 128
    assert from_hf_config(legacy) == cfg
    with pytest.raises(ValueError, match="MoE"):
        from_hf_config({**to_hf_config(cfg), "hybrid_override_pattern": "ME"})
    with pytest.raises(ValueError, match="mlp_bias"):
        from_hf_config({**to_hf_config(cfg), "mlp_bias": True})


def test_import_rejects_mismatched_weights(tmp_path):
    model = perturbed_tiny()
    out = export_hf(model, tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["hybrid_override_pattern"] = "M-*-M-M"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing"):
        import_hf(out)
    with pytest.raises(FileNotFoundError):
        import_hf(tmp_path / "nowhere")


@pytest.mark.parametrize("clamp_dt_to_min", [True, False])
def test_dt_clamp_exports_as_time_step_limit(tmp_path, clamp_dt_to_min):
    """Both dt conventions survive export: the clamp at time_step_min, and the released checkpoints'
    time_step_limit (0, inf), which transformers >= 5.25 honours as the published NemotronH does."""
    model = perturbed_tiny(seed=5, clamp_dt_to_min=clamp_dt_to_min)
    other = perturbed_tiny(seed=5, clamp_dt_to_min=not clamp_dt_to_min)
    out = export_hf(model, tmp_path)
    limit = json.loads((out / "config.json").read_text())["time_step_limit"]
    assert limit == [model.config.time_step_min if clamp_dt_to_min else 0.0, float("inf")]
    hf = transformers.NemotronHForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 150))
    with torch.no_grad():
        ours, theirs, flipped = model(ids), hf(ids).logits, other(ids)
    assert (ours - flipped).abs().max() > 20 * LOGIT_TOL  # the clamp is exercised by these weights
    assert (ours - theirs).abs().max() <= LOGIT_TOL
    assert import_hf(out).config == model.config


def test_released_time_step_limits_import(tmp_path):
    released = to_hf_config(get_model_config("nemotron_h_8b")) | {"time_step_limit": [0.0, float("inf")]}
    assert from_hf_config(released).clamp_dt_to_min is False
    del released["time_step_limit"]  # configs that predate the key: the (0, inf) default
    assert from_hf_config(released).clamp_dt_to_min is False
    saved = transformers.NemotronHConfig(**released)  # as save_pretrained writes it: inf as {"__float__": ...}
    saved.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["time_step_limit"][1] == {"__float__": "Infinity"}
    assert from_hf_config(written).clamp_dt_to_min is False
    with pytest.raises(ValueError, match=r"time_step_limit=\[0.0, 0.1\]"):
        from_hf_config(released | {"time_step_limit": [0.0, 0.1]})


def test_tied_model_exports_and_matches(tmp_path):
    model = perturbed_tiny(seed=3, tie_word_embeddings=True)
    out = export_hf(model, tmp_path)
    hf = transformers.NemotronHForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= LOGIT_TOL
    back = import_hf(out)
    assert back.lm_head.weight is back.embeddings.weight
    assert torch.equal(back.embeddings.weight, model.embeddings.weight)
