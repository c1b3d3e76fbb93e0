"""Composing the training config: every preset composes into a validated JobConfig; typos fail."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from nemofp4.cli.train import compose_job_config
from nemofp4.data import DataConfig
from nemofp4.models import build_model, get_model_config
from nemofp4.recipes import apply_recipe, list_recipes, recipe_from_config
from nemofp4.training.config import JobConfig, compute_budget


@pytest.mark.parametrize("recipe", list_recipes())  # test_recipes.py holds the registry to its own list
def test_each_recipe_composes(recipe):
    cfg = compose_job_config([f"precision={recipe}"])
    assert isinstance(cfg, JobConfig) and cfg.precision.name == recipe
    assert cfg.name == f"tiny-{recipe}" and cfg.run_dir == f"runs/tiny-{recipe}"


@pytest.mark.parametrize("preset", ["tiny", "small", "nemotron_h_8b", "nemotron_h_8b_paper"])
def test_each_model_preset_composes_to_the_registered_preset(preset):
    assert compose_job_config([f"model={preset}"]).model == get_model_config(preset)


@pytest.mark.parametrize("data", ["tiny", "olmo_mix_189b"])
def test_each_data_preset_composes(data):
    assert isinstance(compose_job_config([f"data={data}"]).data, DataConfig)


def test_paper_experiment_reproduces_the_8b_run():
    cfg = compose_job_config(["experiment=nemotron_h_8b_ue5m3"])
    assert cfg.model == get_model_config("nemotron_h_8b_paper") and cfg.model.num_key_value_heads == 4
    assert cfg.precision.name == "ue5m3" and cfg.distributed.backend == "fsdp"
    assert (cfg.optim.lr, cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps, cfg.optim.weight_decay) == (
        8e-4,
        0.9,
        0.95,
        1e-8,
        0.1,
    )
    assert (cfg.schedule.name, cfg.schedule.warmup_steps, cfg.schedule.decay_fraction, cfg.schedule.min_lr_ratio) == (
        "wsd",
        0,
        0.15,
        0.01,
    )
    assert (cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, cfg.train.grad_clip) == (8192, 768, 42, 1.0)
    assert compute_budget(cfg.train, dp_size=32).total_steps == 30_000


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4", "ue5m3", "ue5m3_te_settings", "nvfp4_all_fp4_no_rht", "mxfp4"])
def test_tiny_experiments_compose_and_their_recipe_applies(recipe):
    cfg = compose_job_config([f"experiment=tiny_{recipe}"])
    assert cfg.precision.name == recipe and cfg.model == get_model_config("tiny")
    table = apply_recipe(build_model(cfg.model, device="meta"), recipe_from_config(cfg.precision), log=False)
    if recipe != "bf16":
        assert table.count("fp4") >= 10  # at most one of the six layers (two linears) kept in BF16


def test_misspelled_key_fails_with_its_name():
    with pytest.raises((ConfigCompositionException, ConfigKeyError), match="lrr"):
        compose_job_config(["optim.lrr=1e-3"])


def test_wrong_type_fails():
    with pytest.raises((ConfigCompositionException, ValidationError), match="train.global_batch|global_batch"):
        compose_job_config(["train.global_batch=many"])


def test_unknown_recipe_lists_the_options():
    with pytest.raises(ConfigCompositionException, match="ue5m3"):
        compose_job_config(["precision=fp3"])


def test_invalid_value_is_rejected_by_the_dataclass():
    with pytest.raises(ValueError, match="train.dtype='float16'"):
        compose_job_config(["train.dtype=float16"])


@pytest.mark.parametrize(
    "experiment",
    ["nemotron_h_8b_bf16", "nemotron_h_8b_nvfp4", "nemotron_h_8b_ue5m3", "nemotron_h_8b_ue5m3_te_settings"],
)
def test_8b_presets_keep_the_papers_fp32_head_and_keep_it_gathered(experiment):
    cfg = compose_job_config([f"experiment={experiment}"])
    assert cfg.model.head_precision == "fp32"  # the paper reproductions: the authors' FP32 output layer
    assert cfg.distributed.keep_head_gathered and cfg.distributed.backend == "fsdp"
    assert compose_job_config([f"experiment={experiment}", "model.head_precision=bf16"]).model.head_precision == "bf16"


def test_head_tf32_is_the_older_spelling_of_head_precision_tf32():
    from nemofp4.training.run_identity import config_changes

    assert compose_job_config([]).model.head_precision == "fp32"
    cfg = compose_job_config(["train.head_tf32=true"])
    assert cfg.model.head_precision == "tf32"
    assert compose_job_config(["train.head_tf32=true", "model.head_precision=tf32"]).model.head_precision == "tf32"
    with pytest.raises(ValueError, match="train.head_tf32=true asks for a TF32 head but model.head_precision=bf16"):
        compose_job_config(["train.head_tf32=true", "model.head_precision=bf16"])
    with pytest.raises(Exception, match="head_precision='fp16' must be one of fp32, tf32, bf16"):
        compose_job_config(["model.head_precision=fp16"])
    # a run saved before model.head_precision existed, with train.head_tf32=true, resumes unchanged
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(OmegaConf.structured(cfg))
    del saved["model"]["head_precision"]
    assert config_changes(OmegaConf.to_yaml(OmegaConf.create(saved)), cfg) == []


def test_mlp_activation_is_a_model_override_and_runs_saved_before_it_are_relu2():
    from omegaconf import OmegaConf

    from nemofp4.evaluation import run_config_from_yaml
    from nemofp4.training.run_identity import config_changes

    relu2, swiglu = compose_job_config([]), compose_job_config(["model.mlp_activation=swiglu"])
    assert (relu2.model.mlp_activation, swiglu.model.mlp_activation) == ("relu2", "swiglu")
    assert swiglu.model == get_model_config("tiny", mlp_activation="swiglu")
    with pytest.raises(Exception, match="mlp_activation='gelu' must be one of relu2, swiglu"):
        compose_job_config(["model.mlp_activation=gelu"])
    # a run saved before the knob had Nemotron-H's relu2 MLP: it resumes and evaluates as one
    saved = OmegaConf.to_container(OmegaConf.structured(relu2))
    del saved["model"]["mlp_activation"]
    older = OmegaConf.to_yaml(OmegaConf.create(saved))
    assert config_changes(older, relu2) == [] and run_config_from_yaml(older).model.mlp_activation == "relu2"
    assert [c.key for c in config_changes(older, swiglu) if c.key.startswith("model.")] == ["model.mlp_activation"]


def test_a_longer_seq_len_than_max_position_embeddings_trains_and_is_recorded_as_the_context_length(caplog):
    # Nemotron-H has no positional embedding: nothing limits the length, so the run records what it trained on
    from omegaconf import OmegaConf

    from nemofp4.evaluation import run_config_from_yaml
    from nemofp4.models.nemotron_h.hf_adapter import to_hf_config
    from nemofp4.training.run_identity import config_changes

    assert compose_job_config(["train.seq_len=512"]).model.max_position_embeddings == 1024  # shorter: the preset's
    with caplog.at_level("INFO", logger="nemofp4"):
        job = compose_job_config(["train.seq_len=4096"])
    assert job.model.max_position_embeddings == 4096
    assert "train.seq_len=4096 is longer than model.max_position_embeddings=1024" in caplog.text
    saved = OmegaConf.to_yaml(OmegaConf.structured(job))
    assert "max_position_embeddings: 4096" in saved and config_changes(saved, job) == []
    # a run saved before this rule (1024 with 4096-token sequences) resumes, and its export says 4096
    older = saved.replace("max_position_embeddings: 4096", "max_position_embeddings: 1024")
    assert config_changes(older, job) == []
    model = run_config_from_yaml(older).model
    assert model.max_position_embeddings == 4096 and to_hf_config(model)["max_position_embeddings"] == 4096
