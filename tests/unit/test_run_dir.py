"""Run directories: the lock, the identity check on resume, sweep job names, moving a run aside."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from nemofp4.cli.train import MAX_JOB_DIRNAME, compose_job_config, job_dirname
from nemofp4.training.run_dir import LOCK_FILE, RunDirectory, RunLock, RunLockedError, move_aside
from nemofp4.training.run_identity import (
    changes_the_run,
    check_resume_config,
    config_changes,
    validate_accept_list,
)


def _write_lock(run_dir, **holder):
    run_dir.mkdir(parents=True, exist_ok=True)
    base = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": "",
        "slurm_restart_count": 0,
        "started": "2026-01-01T00:00:00+00:00",
    }
    (run_dir / LOCK_FILE).write_text(json.dumps({**base, **holder}))


def test_a_live_holder_refuses_naming_host_pid_and_job(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, pid=sleeper.pid, slurm_job_id="4242")
        with pytest.raises(RunLockedError, match=rf"pid {sleeper.pid} on host {socket.gethostname()}, SLURM job 4242"):
            RunDirectory(tmp_path, rank=0, world=1, overwrite=False)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == sleeper.pid  # left alone
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_dead_holder_on_this_host_is_reported_and_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path, pid=dead.pid)
    with caplog.at_level(logging.WARNING, logger="nemofp4"):
        run = RunDirectory(tmp_path, rank=0, world=1, overwrite=False)
    assert f"process {dead.pid} on this host has exited" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    run.close()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_requeued_slurm_job_takes_over_its_own_earlier_lock_from_another_node(tmp_path, monkeypatch, caplog):
    _write_lock(tmp_path, host="node-017", pid=1234, slurm_job_id="777", slurm_restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "888")
    with pytest.raises(RunLockedError, match="node-017"):  # another job: refused
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with caplog.at_level(logging.WARNING, logger="nemofp4"):
        lock = RunLock(tmp_path)
        lock.acquire()
    assert "SLURM job 777 was requeued" in caplog.text
    lock.release()


def test_release_never_deletes_a_lock_taken_over_by_another_trainer(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    _write_lock(tmp_path, pid=os.getpid() + 1, host="elsewhere")
    lock.release()
    assert (tmp_path / LOCK_FILE).exists()


def test_a_failed_start_leaves_no_directory_it_created(tmp_path):
    run = RunDirectory(tmp_path / "new", rank=0, world=1, overwrite=False)
    (tmp_path / "new" / "checkpoints").mkdir()
    run.abandon()
    assert not (tmp_path / "new").exists()
    run = RunDirectory(tmp_path, rank=0, world=1, overwrite=False)  # existed before: stays
    run.abandon()
    assert tmp_path.is_dir() and not (tmp_path / LOCK_FILE).exists()


def test_move_aside_keeps_everything_but_the_lock(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-3").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / LOCK_FILE).write_text("{}")
    aside = move_aside(run)
    assert aside.name.startswith("run.replaced-") and aside.parent == tmp_path
    assert (aside / "checkpoints" / "step-3").is_dir() and (aside / "metrics.jsonl").is_file()
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]


SMALL = ["model=tiny", "data=tiny", "train.max_steps=10", "run_dir=runs/small"]  # run_dir: the default names overrides


def test_identity_refuses_recipe_model_seed_and_unnamed_changes_by_key():
    saved = compose_job_config(SMALL)
    for override, key in [
        ("precision=ue5m3", "precision.name"),
        ("train.seed=1", "train.seed"),
        ("model.ffn_hidden_size=256", "model.ffn_hidden_size"),
        ("train.global_batch=32", "train.global_batch"),
        ("optim.lr=0.5", "optim.lr"),
        ("distributed=deepspeed_zero1", "distributed.backend"),
    ]:
        current = compose_job_config([*SMALL, override])
        with pytest.raises(ValueError, match=rf"{key}: .* -> ") as err:
            check_resume_config(saved, current, step=5, saved_total=10, new_total=10, where="checkpoint x")
        assert ("resume_accept=[optim.lr]" in str(err.value)) == (key == "optim.lr")


def test_a_refused_resume_lists_one_changed_key_a_line():
    saved = compose_job_config(SMALL)
    current = compose_job_config([*SMALL, "precision=ue5m3", "optim.lr=0.5", "train.seed=3"])
    with pytest.raises(ValueError) as err:
        check_resume_config(saved, current, step=5, saved_total=10, new_total=10, where="checkpoint x")
    lines = str(err.value).splitlines()
    changed = [line for line in lines if " -> " in line]
    assert len(changed) == len([c for c in config_changes(saved, current) if c.key != "name"]) > 5  # name: safe
    assert all(line.startswith("  ") and line.count(" -> ") == 1 for line in changed)
    assert "  optim.lr: 0.0008 -> 0.5" in lines and "  train.seed: 42 -> 3" in lines


def test_identity_accepts_safe_keys_named_keys_and_a_longer_budget(caplog):
    saved = compose_job_config(SMALL)
    safe = compose_job_config(
        [
            *SMALL,
            "logging.log_interval=7",
            "eval.interval=3",
            "checkpoint.keep_last_k=1",
            "train.micro_batch=4",
            "run_dir=elsewhere",
            "distributed=fsdp",
        ]
    )
    assert check_resume_config(saved, safe, step=5, saved_total=10, new_total=10, where="c") == []
    accepted = compose_job_config([*SMALL, "optim.lr=0.5", "resume_accept=[optim]"])
    assert [c.key for c in check_resume_config(saved, accepted, step=5, saved_total=10, new_total=10, where="c")] == [
        "optim.lr"
    ]
    longer = compose_job_config([*SMALL[:2], "train.max_steps=20"])
    with caplog.at_level(logging.WARNING, logger="nemofp4"):
        check_resume_config(saved, longer, step=10, saved_total=10, new_total=20, where="c")
    assert "from 10 to 20 steps" in caplog.text and "decay now starts after step" in caplog.text
    shorter = compose_job_config([*SMALL[:2], "train.max_steps=8"])
    with pytest.raises(ValueError, match="train.max_steps: 10 -> 8"):
        check_resume_config(saved, shorter, step=5, saved_total=10, new_total=8, where="c")
    with pytest.raises(ValueError, match="at step 9, but the budget now ends at step 8"):
        check_resume_config(saved, shorter, step=9, saved_total=10, new_total=8, where="c")


def test_accept_list_must_name_real_and_changeable_keys():
    cfg = compose_job_config(SMALL)
    validate_accept_list(["optim.lr", "schedule"], cfg)
    with pytest.raises(ValueError, match="'optim.lrr', which is no key"):
        validate_accept_list(["optim.lrr"], cfg)
    for fixed in ("precision", "train.seed", "model.hidden_size", "train"):
        with pytest.raises(ValueError, match="defines what the run trains"):
            validate_accept_list([fixed], cfg)


def test_changes_list_every_differing_key():
    a = compose_job_config(SMALL)
    b = compose_job_config([*SMALL, "optim.lr=0.25", "train.seed=3"])
    assert [(c.key, c.current) for c in config_changes(a, b)] == [("optim.lr", 0.25), ("train.seed", 3)]


def test_the_default_run_dir_tells_differently_configured_runs_apart():
    def run_dir(*overrides):
        return compose_job_config(list(overrides)).run_dir

    assert run_dir("experiment=tiny_ue5m3") == "runs/tiny-ue5m3"  # what `make train` prints
    # the two nvfp4 runs of docs/training.md and docs/recipes.md, followed in order
    assert run_dir("experiment=tiny_ue5m3", "precision=nvfp4") == "runs/tiny-nvfp4"
    assert run_dir("experiment=tiny_ue5m3", "precision=nvfp4", "precision.num_bf16_last_layers=2") == (
        "runs/tiny-nvfp4-precision.num_bf16_last_layers=2"
    )
    # keys a resume refuses to change name the run, sorted; '/' cannot split the name
    assert run_dir("train.seed=3", "optim.lr=1e-2", "data.tokenizer=a/b") == (
        "runs/tiny-bf16-data.tokenizer=a_b,optim.lr=1e-2,train.seed=3"
    )
    # the same run observed, saved, laid out or budgeted otherwise finds its directory again
    same = (
        "train.max_steps=600",
        "train.kernels=eager",
        "distributed=fsdp",
        "train.micro_batch=4",
        "logging.wandb=false",
        "eval.num_sequences=8",
        "checkpoint.interval=2",
        "resume=auto",
    )
    assert run_dir("experiment=tiny_ue5m3", *same) == "runs/tiny-ue5m3"
    # a change accepted into the run (resume_accept) resumes it; a fixed key cannot be accepted, so it names the run
    assert run_dir("experiment=tiny_ue5m3", "optim.lr=1e-2", "resume_accept=[optim]") == "runs/tiny-ue5m3"
    assert run_dir("experiment=tiny_ue5m3", "optim.lr=1e-2", "schedule.warmup_steps=5", "resume_accept=[optim.lr]") == (
        "runs/tiny-ue5m3-schedule.warmup_steps=5"
    )
    assert changes_the_run("train.seed", ["train"]) and not changes_the_run("train.grad_clip", ["train"])
    assert (
        run_dir("experiment=tiny_ue5m3", "precision.reference_interval=10", "run_dir=runs/mine") == "runs/mine"
    )  # given: used as given
    assert run_dir("hydra.mode=MULTIRUN", "optim.lr=1e-3") == "runs/tiny-bf16"  # a sweep's jobs add their own


def test_sweep_job_dirnames_are_safe_bounded_and_distinct():
    assert job_dirname("optim.lr=1e-3,train.max_steps=2") == "optim.lr=1e-3,train.max_steps=2"
    assert "/" not in job_dirname("data.path=/x/y,optim.lr=1") and job_dirname("") == "defaults"
    long_a, long_b = "a=" + "x" * 300 + ",b=1", "a=" + "x" * 300 + ",b=2"
    assert len(job_dirname(long_a)) == MAX_JOB_DIRNAME and job_dirname(long_a) != job_dirname(long_b)


def test_a_field_added_after_the_checkpoint_compares_as_its_default():
    from omegaconf import OmegaConf

    cfg = compose_job_config(SMALL)
    older = OmegaConf.to_yaml(OmegaConf.structured(cfg)).replace("  max_skipped_steps: 10\n", "")
    older = older.replace("  grad_clip: 1.0\n", "")
    assert config_changes(older, cfg) == []
    assert [c.key for c in config_changes(older, compose_job_config([*SMALL, "train.grad_clip=0.5"]))] == [
        "train.grad_clip"
    ]


def _two_ranks(rank: int, port: int, run_dir: str, results: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        run = RunDirectory(run_dir, rank=rank, world=2, overwrite=False)
        outcome = "ok"
        run.close()
    except RunLockedError as err:
        outcome = f"locked: {err}"
    with open(f"{results}/rank-{rank}", "w") as f:
        f.write(outcome)
    dist.destroy_process_group()


def test_only_rank_0_takes_the_lock_and_every_rank_learns_a_refusal(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path / "run", pid=holder.pid)
        mp.spawn(_two_ranks, args=(port, str(tmp_path / "run"), str(tmp_path)), nprocs=2)
    finally:
        holder.kill()
        holder.wait()
    for rank in (0, 1):
        assert (
            (tmp_path / f"rank-{rank}")
            .read_text()
            .startswith(f"locked: run_dir {tmp_path / 'run'} is in use by pid {holder.pid}")
        )
