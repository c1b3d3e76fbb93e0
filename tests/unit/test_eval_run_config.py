"""Evaluation's typed view of a run's config reads the same model, recipe and data as the trainer's schema."""

import pytest
from omegaconf import OmegaConf

from nemofp4.cli.train import compose_job_config
from nemofp4.evaluation import run_config_from_yaml
from nemofp4.evaluation.run_config import read_saved_config
from nemofp4.recipes import get_recipe
from nemofp4.training.config import job_config_from_yaml
from nemofp4.training.job_plan import recorded_policy
from nemofp4.training.run_identity import ResumeRefusedError, check_resume_config


def test_the_view_matches_the_full_schema_on_a_composed_run():
    job = compose_job_config(["experiment=tiny_nvfp4", "precision=nvfp4_delayed", "precision.reference_interval=7"])
    text = OmegaConf.to_yaml(OmegaConf.structured(job))
    view = run_config_from_yaml(text)
    assert job_config_from_yaml(text) == job
    assert (view.model, view.precision, view.data) == (job.model, job.precision, job.data)
    assert view.precision.build() == get_recipe("nvfp4_delayed", reference_interval=7, num_bf16_last_layers=1)
    assert (view.train.seq_len, view.train.seed, view.train.dtype) == (
        job.train.seq_len,
        job.train.seed,
        job.train.dtype,
    )
    assert (view.eval.num_sequences, view.eval.batch_size) == (job.eval.num_sequences, job.eval.batch_size)


def test_a_config_without_a_section_is_a_clear_error():
    with pytest.raises(ValueError, match="no 'model' section"):
        run_config_from_yaml("name: x\nrun_dir: runs/x\n")


def test_a_run_directorys_saved_config_is_read_by_one_reader_that_names_the_file(tmp_path):
    """read_saved_config gives the trainer's schema what the YAML text gives it, and a missing or
    corrupt config.yaml is an error naming the file (not a bare YAML traceback)."""
    job = compose_job_config(["experiment=tiny_ue5m3", "distributed.activation_checkpointing=mamba"])
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    assert job_config_from_yaml(read_saved_config(path)) == job
    assert recorded_policy(tmp_path) == "mamba"

    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'missing.yaml'}: no saved run config"):
        read_saved_config(tmp_path / "missing.yaml")
    for corrupt in ("model: [unclosed\n", "- a list\n- not a mapping\n", "name: ${missing.key}\n"):
        path.write_text(corrupt)
        with pytest.raises(ValueError, match=f"{path}: not a readable run config"):
            read_saved_config(path)
        with pytest.raises(ValueError, match=f"{path}: not a readable run config"):
            recorded_policy(tmp_path)


def test_the_resume_check_reads_the_mapping_as_it_reads_the_text(tmp_path):
    """The trainer checks a run directory's config.yaml (read_saved_config's mapping) as it checks a
    checkpoint's config text: the same accepted changes, the same refusal."""
    saved = compose_job_config(["experiment=tiny_ue5m3"])
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(saved)))
    common = dict(step=0, saved_total=None, new_total=300, where="run_dir x", log_notes=False)
    same = compose_job_config(["experiment=tiny_ue5m3"])
    assert check_resume_config(read_saved_config(path), same, **common) == []
    other = compose_job_config(["experiment=tiny_ue5m3", "optim.lr=1e-2"])
    for saved_form in (read_saved_config(path), path.read_text()):
        with pytest.raises(ResumeRefusedError, match="optim.lr"):
            check_resume_config(saved_form, other, **common)
