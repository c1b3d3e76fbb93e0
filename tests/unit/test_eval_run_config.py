"""Evaluation's typed view of a run's config reads the same model, recipe and data as the trainer's schema."""

import pytest
from omegaconf import OmegaConf

from nemofp4.cli.train import compose_job_config
from nemofp4.evaluation import run_config_from_yaml
from nemofp4.recipes import get_recipe
from nemofp4.training.config import job_config_from_yaml


def test_the_view_matches_the_full_schema_on_a_composed_run():
    job = compose_job_config(["experiment=tiny_nvfp4", "precision=nvfp4_delayed", "precision.reference_interval=7"])
    text = OmegaConf.to_yaml(OmegaConf.structured(job))
    view = run_config_from_yaml(text)
    assert job_config_from_yaml(text) == job
    assert (view.model, view.precision, view.data) == (job.model, job.precision, job.data)
    assert view.precision.build() == get_recipe("nvfp4_delayed", reference_interval=7, num_bf16_last_layers=1)
    assert (view.train.seq_len, view.train.seed, view.train.dtype) == (job.train.seq_len, job.train.seed, job.train.dtype)
    assert (view.eval.num_sequences, view.eval.batch_size) == (job.eval.num_sequences, job.eval.batch_size)


def test_a_config_without_a_section_is_a_clear_error():
    with pytest.raises(ValueError, match="no 'model' section"):
        run_config_from_yaml("name: x\nrun_dir: runs/x\n")
