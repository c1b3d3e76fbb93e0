"""train.init_from's checks and loader on folders written here: exact loads from one file or shards, bf16
or fp32, tied heads; clear refusals of weights that do not fit, of another tokenizer, of another source."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemofp4.cli.train import compose_job_config
from nemofp4.data import DataConfig
from nemofp4.data.paths import REPO_ROOT
from nemofp4.models import build_model, get_model_config
from nemofp4.models.nemotron_h import config_mismatches, export_hf, from_hf_config
from nemofp4.training.init_from import (
    check_compatible,
    check_recorded_source,
    load_initial_weights,
    resolve_source,
    source_identity,
    starts_fresh,
    write_record,
)
from nemofp4.training.run_identity import check_resume_config, validate_accept_list
from tests.conftest import perturbed_tiny

SHIPPED_TOKENIZER = REPO_ROOT / "data" / "tokenizer"


def folder_of(model, path, dtype=None, *, tokenizer=True):
    out = export_hf(model, path, dtype=dtype)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(SHIPPED_TOKENIZER / name, out / name)
    return out


def fresh_model(config, seed=7):
    model = build_model(config, device="meta")
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def shard(folder):
    """Split model.safetensors into two files with an index, as save_pretrained's max_shard_size does."""
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in parts.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    weight_map = {n: file for file, part in parts.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.mark.parametrize(
    "dtype, sharded, tied", [(None, False, False), (torch.bfloat16, True, False), (None, True, True)]
)
def test_weights_load_exactly_from_one_file_or_shards_in_fp32_or_bf16(tmp_path, dtype, sharded, tied):
    source = perturbed_tiny(tie_word_embeddings=tied)
    folder = folder_of(source, tmp_path / "hf", dtype)
    if sharded:
        shard(folder)
    model = fresh_model(source.config)
    load_initial_weights(model, resolve_source(str(folder)))
    for name, tensor in source.state_dict().items():
        expected = tensor.to(dtype).float() if dtype else tensor  # the file's values, widened exactly
        assert model.state_dict()[name].dtype == torch.float32
        assert torch.equal(model.state_dict()[name], expected), name
    assert (model.lm_head.weight is model.embeddings.weight) == tied


def test_the_released_8b_config_is_the_nemotron_h_8b_preset():
    # nvidia/Nemotron-H-8B-Base-8K's config.json, its architecture fields (chunk 128: a speed setting here)
    released = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "hidden_size": 4096,
        "vocab_size": 131072,
        "tie_word_embeddings": False,
        "layer_norm_epsilon": 1e-5,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attention_head_dim": 128,
        "max_position_embeddings": 8192,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "expand": 2,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "use_conv_bias": True,
        "chunk_size": 128,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "mamba_proj_bias": False,
        "rescale_prenorm_residual": True,
        "initializer_range": 0.02,
    }
    config = from_hf_config(released)
    assert config_mismatches(config, get_model_config("nemotron_h_8b")) == []
    assert config_mismatches(config, get_model_config("nemotron_h_8b_paper")) == ["num_key_value_heads: 8 -> 4"]
    assert config.num_parameters() == get_model_config("nemotron_h_8b").num_parameters()


def test_weights_that_do_not_fit_are_refused_by_name(tmp_path):
    source = perturbed_tiny()
    folder = folder_of(source, tmp_path / "hf")
    with pytest.raises(
        ValueError,
        match=r"differs from the run's in 2 field\(s\).*hidden_size: 128 -> 256.*"
        r"mamba_num_heads: 8 -> 16",
    ):
        check_compatible(
            resolve_source(str(folder)), get_model_config("tiny", hidden_size=256, mamba_num_heads=16), DataConfig()
        )
    check_compatible(resolve_source(str(folder)), get_model_config("tiny", chunk_size=32), DataConfig())  # speed only

    tensors = load_file(str(folder / "model.safetensors"))
    extra = tmp_path / "extra"
    shutil.copytree(folder, extra)
    save_file({**tensors, "backbone.layers.9.mixer.D": torch.ones(8)}, str(extra / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected \['layers.9.mixer.D'\]"):
        load_initial_weights(fresh_model(source.config), resolve_source(str(extra)))
    integer = tmp_path / "integer"
    shutil.copytree(folder, integer)
    ints = {**tensors, "backbone.layers.0.mixer.D": torch.zeros(8, dtype=torch.int32)}
    save_file(ints, str(integer / "model.safetensors"))
    with pytest.raises(ValueError, match="backbone.layers.0.mixer.D: dtype I32"):
        load_initial_weights(fresh_model(source.config), resolve_source(str(integer)))
    wrong_shape = tmp_path / "shape"
    shutil.copytree(folder, wrong_shape)
    save_file({**tensors, "backbone.layers.0.mixer.D": torch.zeros(9)}, str(wrong_shape / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers.0.mixer.D: \(9,\) in the folder, \(8,\) in the model"):
        load_initial_weights(fresh_model(source.config), resolve_source(str(wrong_shape)))

    stray = shard(folder_of(source, tmp_path / "stray"))
    shutil.copyfile(stray / "model-00001-of-00002.safetensors", stray / "consolidated.safetensors")
    with pytest.raises(ValueError, match=r"holds \['consolidated.safetensors'\] besides"):
        resolve_source(str(stray))
    (stray / "consolidated.safetensors").unlink()
    (stray / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        resolve_source(str(stray))
    with pytest.raises(FileNotFoundError, match="a transformers NemotronH folder"):
        resolve_source(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="neither a transformers folder"):
        resolve_source(str(tmp_path))


def test_the_data_must_use_the_sources_tokenizer(tmp_path):
    folder = folder_of(perturbed_tiny(), tmp_path / "hf")
    source = resolve_source(str(folder))
    check_compatible(source, get_model_config("tiny"), DataConfig())  # the shipped tokenizer, copied
    check_compatible(source, get_model_config("tiny"), DataConfig(tokenizer=str(folder)))
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "the"}))  # another EOD: another hash
    with pytest.raises(
        ValueError,
        match=rf"trained with the tokenizer {other}.*EOD 'the'.*but data.tokenizer="
        rf"data/tokenizer is another one.*Pass data.tokenizer={other}",
    ):
        check_compatible(resolve_source(str(other)), get_model_config("tiny"), DataConfig())
    bare = folder_of(perturbed_tiny(), tmp_path / "bare", tokenizer=False)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        check_compatible(resolve_source(str(bare)), get_model_config("tiny"), DataConfig())


def test_a_folders_broken_json_is_one_error_naming_the_file_and_the_knob(tmp_path):
    """A truncated config.json, index or tokenizer file (an interrupted download) said only the decoder's
    'Expecting value: line 1 column 1' (an index without its map: a KeyError traceback)."""
    good = shard(folder_of(perturbed_tiny(), tmp_path / "good"))
    resolve_source(str(good))

    def broken(name: str, file: str, text: str):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        (folder / file).write_text(text)
        return folder, rf"train.init_from='?{folder}'?: {folder / file} "

    folder, named = broken("config", "config.json", (good / "config.json").read_text()[:-20])
    with pytest.raises(ValueError, match=named + r"is not valid JSON \(Unterminated string"):
        resolve_source(str(folder))
    folder, named = broken("config-list", "config.json", "[]")
    with pytest.raises(ValueError, match=named + "holds a JSON list, not an object"):
        resolve_source(str(folder))
    folder, named = broken("index", "model.safetensors.index.json", '{"weight_map": {')
    with pytest.raises(ValueError, match=named + "is not valid JSON"):
        resolve_source(str(folder))
    folder, named = broken("no-map", "model.safetensors.index.json", '{"metadata": {}}')
    with pytest.raises(ValueError, match=named + "has no 'weight_map' object"):
        resolve_source(str(folder))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        folder, named = broken(file, file, '{"version": "1.0", "trunc')
        with pytest.raises(ValueError, match=named + "is not"):
            check_compatible(resolve_source(str(folder)), get_model_config("tiny"), DataConfig())


def test_identity_hashes_the_files_and_a_run_dir_keeps_to_its_source(tmp_path):
    folder = shard(folder_of(perturbed_tiny(), tmp_path / "hf"))
    source = resolve_source(str(folder))
    record = source_identity(source, "hf")
    for name, digest in record["files"].items():
        assert digest == hashlib.sha256((folder / name).read_bytes()).hexdigest()
    assert record["path"] == str(folder.resolve()) and len(record["weights_sha256"]) == 64
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    check_recorded_source(run_dir, source, record)  # nothing recorded yet
    write_record(run_dir, record)
    check_recorded_source(run_dir, source, record)
    other = resolve_source(str(folder_of(perturbed_tiny(seed=5), tmp_path / "other")))
    with pytest.raises(ValueError, match=rf"started from {folder.resolve()}.*this start names {other.path}"):
        check_recorded_source(run_dir, other)
    changed = load_file(str(folder / "model-00001-of-00002.safetensors"))
    changed[next(iter(changed))] += 1
    save_file(changed, str(folder / "model-00001-of-00002.safetensors"))
    new = source_identity(source, "hf")
    with pytest.raises(ValueError, match=rf"sha256 {record['weights_sha256']}; they now have {new['weights_sha256']}"):
        check_recorded_source(run_dir, source, new)


def test_only_a_fresh_start_reads_the_source(tmp_path):
    assert starts_fresh("auto", tmp_path, used=False)
    assert starts_fresh("none", tmp_path, used=False) and not starts_fresh("none", tmp_path, used=True)
    step = tmp_path / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    assert starts_fresh("auto", tmp_path, used=True)  # an incomplete folder is no checkpoint
    (step / "COMPLETE.json").write_text("{}")
    assert not starts_fresh("auto", tmp_path, used=True)
    assert not starts_fresh(str(step), tmp_path, used=True)


def test_a_resume_with_another_source_is_refused_naming_both():
    base = ["model=tiny", "train.max_steps=4"]
    saved = compose_job_config([*base, "train.init_from=hf/released"])
    for current, shown in (("train.init_from=hf/other", "'hf/other'"), ("train.init_from=", "''")):
        with pytest.raises(ValueError, match=rf"train.init_from: 'hf/released' -> {shown}") as err:
            check_resume_config(
                saved, compose_job_config([*base, current]), step=2, saved_total=4, new_total=4, where="checkpoint c"
            )
        assert "started from train.init_from='hf/released'" in str(err.value)
    with pytest.raises(ValueError, match="defines what the run trains"):
        validate_accept_list(["train.init_from"], saved)
