"""Checks at start: the model's vocabulary covers the tokenizer's, and the data's tokenizer is the configured one."""

import json
import shutil
from pathlib import Path

import pytest

from nemofp4.data import DataConfig, build_validation_batches, check_model_vocab
from nemofp4.data.config import DataSourceConfig

REPO = Path(__file__).resolve().parents[2]


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused_naming_both():
    check_model_vocab(DataConfig(), 8192)  # the shipped tokenizer has 8,192 tokens
    with pytest.raises(ValueError, match=r"model.vocab_size=8191 is smaller than .* \(8192 tokens\).* >= 8192"):
        check_model_vocab(DataConfig(), 8191)


def test_the_trainer_refuses_it_before_training(tmp_path):
    from nemofp4.cli.train import compose_job_config
    from nemofp4.training.trainer import train

    cfg = compose_job_config(
        ["model.vocab_size=100", "train.max_steps=1", f"run_dir={tmp_path / 'run'}", "logging.wandb=false"]
    )
    with pytest.raises(ValueError, match="model.vocab_size=100"):
        train(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _data_with_tokenizer_hash(tmp_path: Path, fake_hash: str) -> DataConfig:
    for suffix in (".bin", ".idx", ".manifest.json"):
        shutil.copy(REPO / "data" / "tokens" / f"austen_validation{suffix}", tmp_path)
    manifest_path = tmp_path / "austen_validation.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"]["hash"] = fake_hash
    manifest_path.write_text(json.dumps(manifest))
    prefix = str(tmp_path / "austen_validation")
    return DataConfig(
        sources=[DataSourceConfig(prefix=prefix, validation_prefix=prefix)], cache_dir=str(tmp_path / "cache")
    )


def test_data_made_with_another_tokenizer_is_an_error_naming_both_hashes(tmp_path):
    cfg = _data_with_tokenizer_hash(tmp_path, "ab" * 32)
    with pytest.raises(ValueError, match=r"tokenizer hash abababababab, data.tokenizer=.* has hash 029db995be0b"):
        build_validation_batches(cfg, seq_len=32, num_sequences=2, batch_size=2)
    cfg.tokenizer_mismatch = "warn"
    with pytest.warns(UserWarning, match="another tokenizer"):
        build_validation_batches(cfg, seq_len=32, num_sequences=2, batch_size=2)
    cfg.tokenizer_mismatch = "ignore"
    with pytest.raises(ValueError, match="data.tokenizer_mismatch must be 'error' or 'warn', got 'ignore'"):
        build_validation_batches(cfg, seq_len=32, num_sequences=2, batch_size=2)
