"""Runs you can trust, end to end: a run directory holds one run (identity, overwrite, lock, sweeps),
checkpoints are only ever good ones, and the metrics are one clean history after reruns.

Most runs here train in this process (fast); the interface checks run the command itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from nemofp4.training.metrics import read_metrics
from nemofp4.training.nonfinite import NonFiniteError
from nemofp4.training.run_dir import LOCK_FILE, RunLockedError
from tests.conftest import FAST_IN_PROCESS as FAST
from tests.conftest import ROOT, curve, held_references, train_here


def run_cli(*args: str, multirun: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nemofp4.train", *(["-m"] if multirun else []), *FAST, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_resume_with_changed_recipe_model_or_seed_exits_nonzero_naming_the_keys(tmp_path):
    train_here(tmp_path, "train.max_steps=2")
    proc = run_cli(f"run_dir={tmp_path}", "train.max_steps=2", "precision=ue5m3", "train.seed=7", "resume=auto")
    assert proc.returncode != 0
    assert "precision.name: 'bf16' -> 'ue5m3'" in proc.stderr and "train.seed: 42 -> 7" in proc.stderr
    with pytest.raises(ValueError, match="model.ffn_hidden_size: 512 -> 256"):  # before any DCP traceback
        train_here(tmp_path, "train.max_steps=2", "model.ffn_hidden_size=256")
    with pytest.raises(ValueError, match=r"optim.lr: 0.003 -> 0.01(.|\n)*resume_accept=\[optim.lr\]"):
        train_here(tmp_path, "train.max_steps=2", "optim.lr=1e-2")
    assert train_here(tmp_path, "train.max_steps=3", "optim.lr=1e-2", "resume_accept=[optim.lr]")["step"] == 3
    assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2, 3]


def test_each_multirun_job_trains_in_its_own_run_directory(tmp_path):
    proc = run_cli(f"run_dir={tmp_path}", "optim.lr=1e-3,1e-2", "train.max_steps=2", multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # named by the job's overrides (sorted; cut to 96 characters with a hash of the whole when longer)
    jobs = sorted(
        (p for p in tmp_path.iterdir() if p.is_dir()), key=lambda p: "lr: 0.01" in (p / "config.yaml").read_text()
    )
    assert len(jobs) == 2 and all(p.name.startswith("data=tiny,eval.") and len(p.name) <= 96 for p in jobs)
    for job, lr in zip(jobs, (0.001, 0.01), strict=True):
        assert [r["step"] for r in read_metrics(job, "train")] == [1, 2]  # trained, not "resumed" from the other
        assert f"lr: {lr}\n" in (job / "config.yaml").read_text()
        assert (job / "checkpoints" / "step-2").is_dir()
    assert curve(jobs[0]) != curve(jobs[1])


def test_a_fresh_start_in_a_used_directory_refuses_and_overwrite_moves_the_old_run_aside(tmp_path):
    run = tmp_path / "run"
    train_here(run, "train.max_steps=3", "checkpoint.interval=1", "optim.lr=1e-2")
    with pytest.raises(ValueError, match="already holds a run .*3 checkpoint"):
        train_here(run, "train.max_steps=2", "resume=none")
    train_here(run, "train.max_steps=2", "overwrite=true")
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and sorted(p.name for p in (aside[0] / "checkpoints").glob("step-*")) == [
        "step-1",
        "step-2",
        "step-3",
    ]
    assert [r["step"] for r in read_metrics(run, "train")] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-2"]
    train_here(tmp_path / "clean", "train.max_steps=2")
    assert curve(run) == curve(tmp_path / "clean")  # bitwise a fresh start


def test_all_checkpoints_damaged_refuses_to_start_over_silently(tmp_path):
    train_here(tmp_path, "train.max_steps=2", "checkpoint.interval=1")
    for shard in (tmp_path / "checkpoints").glob("step-*/*.distcp"):
        shard.write_bytes(b"\x00" * 10)
    with pytest.raises(Exception, match="no checkpoint in .* could be loaded .*overwrite=true"):
        train_here(tmp_path, "train.max_steps=2", "checkpoint.interval=1")


def test_a_second_trainer_refuses_while_the_first_holds_the_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        tmp_path.mkdir(exist_ok=True)
        (tmp_path / LOCK_FILE).write_text(
            json.dumps({"host": socket.gethostname(), "pid": holder.pid, "slurm_job_id": "31337", "started": "now"})
        )
        with pytest.raises(RunLockedError, match=f"in use by pid {holder.pid} .*SLURM job 31337"):
            train_here(tmp_path, "train.max_steps=2")
        assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    train_here(tmp_path, "train.max_steps=1")  # the holder is gone: its lock is stale, taken over
    assert not (tmp_path / LOCK_FILE).exists()  # and released at the end


def test_a_start_that_fails_leaves_no_run_directory_behind(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        train_here(tmp_path / "new", "train.max_steps=1", f"resume={tmp_path / 'missing'}")
    assert not (tmp_path / "new").exists()


def test_a_nan_at_a_refresh_step_is_never_held_and_the_run_continues(tmp_path):
    # ue5m3 with references refreshed every 3 steps (1, 4, 7): the loss of refresh step 4 is NaN, so every
    # dy sampled there is NaN. The previous references must stay; steps 5 and 6 train normally.
    common = [
        "precision=ue5m3",
        "precision.reference_interval=3",
        "train.max_steps=6",
        "checkpoint.interval=3",
        "train.nonfinite=skip",
        "checkpoint.keep_last_k=0",
    ]
    train_here(tmp_path, *common, "debug.nan_loss_at_step=4")
    rows = {r["step"]: r for r in read_metrics(tmp_path, "train")}
    assert [s for s, r in rows.items() if r.get("skipped")] == [4]
    assert all(torch.isfinite(torch.tensor([rows[s]["loss"], rows[s]["grad_norm"]])).all() for s in (5, 6))
    before, after = (held_references(tmp_path / "checkpoints" / f"step-{s}") for s in (3, 6))
    dy = [k for k in after if k.endswith(".dy.amax")]
    assert dy and all(torch.isfinite(after[k]) and torch.equal(after[k], before[k]) for k in dy)


def test_skip_never_checkpoints_nan_weights_and_resumes_from_the_last_healthy_checkpoint(tmp_path):
    common = [
        "train.max_steps=6",
        "checkpoint.interval=1",
        "checkpoint.keep_last_k=1",
        "train.nonfinite=skip",
        "train.max_skipped_steps=2",
    ]
    with pytest.raises(NonFiniteError, match="step 5: .*parameter layers.0.mixer.in_proj.weight"):
        train_here(tmp_path / "nan", *common, "debug.nan_at_step=3", "debug.nan_param=layers.0.mixer.in_proj.weight")
    assert sorted(p.name for p in (tmp_path / "nan" / "checkpoints").glob("step-*")) == ["step-2"]
    train_here(tmp_path / "nan", *common)  # the same run without the fault: resumes from step-2
    train_here(tmp_path / "straight", *common)
    again, straight = curve(tmp_path / "nan"), curve(tmp_path / "straight")
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    assert all(again[s] == straight[s] for s in range(3, 7))


def test_reruns_and_a_stale_latest_keep_one_record_per_step_and_resume_from_the_newest(tmp_path, caplog):
    common = ["schedule.name=constant", "checkpoint.interval=2", "eval.interval=2", "eval.at_start=true"]
    train_here(tmp_path, *common, "train.max_steps=4")
    marker = (tmp_path / "checkpoints" / "step-4" / "COMPLETE.json").read_text()
    train_here(tmp_path, *common, "train.max_steps=4")  # rerun of a finished run: nothing new
    assert (tmp_path / "checkpoints" / "step-4" / "COMPLETE.json").read_text() == marker
    (tmp_path / "checkpoints" / "latest").write_text("step-2\n")  # as if killed before the pointer was rewritten
    with caplog.at_level("WARNING", logger="nemofp4"):
        summary = train_here(tmp_path, *common, "train.max_steps=6")
    assert summary["step"] == 6 and "the budget changed from 4 to 6 steps" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_metrics(tmp_path, "eval")] == [0, 2, 4, 6]
    train_here(tmp_path / "straight", *common, "train.max_steps=6")
    assert curve(tmp_path) == curve(tmp_path / "straight")
