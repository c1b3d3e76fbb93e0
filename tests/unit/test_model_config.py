"""NemotronHConfig: validation, presets, yaml files, parameter and FLOP counts."""

import dataclasses
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nemofp4.models import build_model, get_model_config
from nemofp4.models.nemotron_h import PRESETS, LayerType, NemotronHConfig, parse_pattern

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"


def test_parse_pattern():
    assert parse_pattern("M-*") == [LayerType.MAMBA, LayerType.MLP, LayerType.ATTENTION]
    with pytest.raises(ValueError, match=r"unknown symbols \['E', 'x'\]"):
        parse_pattern("M-Ex")
    with pytest.raises(ValueError, match="non-empty"):
        parse_pattern("")


@pytest.mark.parametrize(
    "overrides,names",
    [
        ({"hybrid_layer_pattern": "M-E"}, ["'E'"]),
        ({"hybrid_layer_pattern": ""}, ["hybrid_layer_pattern"]),
        ({"num_key_value_heads": 3}, ["num_attention_heads=4", "num_key_value_heads=3"]),
        ({"mamba_head_dim": 16}, ["mamba_num_heads * mamba_head_dim", "mamba_expand * hidden_size"]),
        ({"mamba_num_groups": 3}, ["mamba_num_groups=3", "mamba_num_heads=8", "hidden_size=128"]),
        ({"chunk_size": 0}, ["chunk_size=0"]),
        ({"norm_eps": -1.0}, ["norm_eps=-1.0"]),
        ({"time_step_min": 0.5}, ["time_step_min=0.5", "time_step_max=0.1"]),
        ({"mlp_activation": "gelu"}, ["mlp_activation='gelu'", "relu2, swiglu"]),
    ],
)
def test_invalid_config_raises_naming_the_fields(overrides, names):
    with pytest.raises(ValueError) as info:
        get_model_config("tiny", **overrides)
    for name in names:
        assert name in str(info.value)


def test_fields_only_checked_for_layer_types_present():
    # No attention layer: the head counts need not divide.
    cfg = get_model_config("tiny", hybrid_layer_pattern="M-M-", num_key_value_heads=3)
    assert cfg.num_layers == 4


def test_presets_and_overrides():
    cfg = get_model_config("tiny", vocab_size=1000)
    assert cfg.vocab_size == 1000 and PRESETS["tiny"].vocab_size == 8192  # presets are not mutated
    assert {t.value for t in cfg.layer_types} == {"M", "*", "-"}
    assert 1e6 < get_model_config("tiny").num_parameters() < 10e6
    assert 100e6 <= get_model_config("small").num_parameters() <= 150e6
    with pytest.raises(ValueError, match="valid presets"):
        get_model_config("huge")
    with pytest.raises(ValueError, match="unknown NemotronHConfig fields"):
        get_model_config("tiny", hidden=3)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_equals_preset_and_validates_against_the_dataclass(name):
    raw = OmegaConf.load(CONFIG_DIR / f"{name}.yaml")
    field_names = {f.name for f in dataclasses.fields(NemotronHConfig)}
    assert set(raw.keys()) == field_names  # every field, nothing else
    merged = OmegaConf.merge(OmegaConf.structured(NemotronHConfig), raw)
    assert OmegaConf.to_object(merged) == get_model_config(name)
    assert NemotronHConfig(**OmegaConf.to_container(raw)) == get_model_config(name)


def test_structured_config_rejects_misspelled_key():
    with pytest.raises(Exception, match="hiden_size"):
        OmegaConf.merge(OmegaConf.structured(NemotronHConfig), {"hiden_size": 3})


@pytest.mark.parametrize(
    "name,expected,non_embedding",
    [("nemotron_h_8b", 8.10e9, 7.03e9), ("nemotron_h_8b_paper", 8.08e9, 7.01e9)],
)
def test_8b_parameter_counts_on_meta(name, expected, non_embedding):
    cfg = get_model_config(name)
    assert cfg.num_layers == 52 and cfg.hybrid_layer_pattern.count("*") == 4
    assert abs(cfg.num_parameters() - expected) / expected < 1e-3
    assert abs(cfg.num_non_embedding_parameters() - non_embedding) / non_embedding < 1e-3
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


@pytest.mark.parametrize(
    "overrides", [{}, {"tie_word_embeddings": True, "use_conv_bias": False}, {"mlp_activation": "swiglu"}]
)
def test_num_parameters_is_exact(overrides):
    cfg = get_model_config("small", **overrides)
    model = build_model(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    embedding = model.embeddings.weight.numel() + (0 if cfg.tie_word_embeddings else model.lm_head.weight.numel())
    assert cfg.num_non_embedding_parameters() == cfg.num_parameters() - embedding


def test_swiglu_adds_one_gemm_of_the_mlp_width_per_mlp_layer():
    # Three GEMMs (gate and up fused, down) where relu2 has two: d x F more weights and 6 d F more
    # training FLOPs per token in every MLP layer, nothing else changes.
    relu2, swiglu = get_model_config("small"), get_model_config("small", mlp_activation="swiglu")
    mlp_layers, d, f = relu2.hybrid_layer_pattern.count("-"), relu2.hidden_size, relu2.ffn_hidden_size
    assert (relu2.mlp_in_proj_size, swiglu.mlp_in_proj_size) == (f, 2 * f)
    assert swiglu.num_parameters() - relu2.num_parameters() == mlp_layers * d * f
    assert swiglu.flops_per_token(1024) - relu2.flops_per_token(1024) == 6 * mlp_layers * d * f


@pytest.mark.parametrize("mlp_activation", ["relu2", "swiglu"])
def test_flops_per_token_equals_counted_forward_flops_times_three(mlp_activation):
    # The formula counts every matmul, the attention scores/values, the SSD scan and the conv; the
    # counted forward is the implementation's, so a term missing on either side shows up.
    cfg = get_model_config("tiny", mlp_activation=mlp_activation)
    model = build_model(cfg, device="cpu")
    batch, seq_len = 2, 128  # a multiple of the chunk size: no padded positions
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    # The math SDPA backend is made of matmuls the counter sees (the CPU flash kernel is not counted).
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids)
    # the math backend computes every score; the formula counts the causal half (2 B H L^2 d a layer)
    masked = (
        cfg.hybrid_layer_pattern.count("*") * 2 * batch * cfg.num_attention_heads * seq_len**2 * cfg.attention_head_dim
    )
    assert cfg.flops_per_token(seq_len) * batch * seq_len == 3 * (counter.get_total_flops() - masked)
    assert cfg.flops_per_token(seq_len) > 6 * cfg.num_non_embedding_parameters()
