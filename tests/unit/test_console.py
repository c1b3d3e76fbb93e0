"""The trainer's step line (moving-average ETA, memory) and end-of-run summary."""

import math
from pathlib import Path

import torch

from nemofp4.training.console import StepLine, format_duration, memory_record, run_summary

_M = {"loss": 2.5, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 1000.0}


def test_the_eta_leaves_out_the_slow_first_step_and_follows_recent_steps():
    line = StepLine(total_steps=100, window=3)
    assert line.format(0, _M).endswith("eta ?")
    line.update(60.0)  # step 1: compile and warm-up
    assert line.eta_seconds(1) == 60.0 * 99  # nothing better known yet
    line.update(1.0)
    assert line.eta_seconds(2) == 1.0 * 98  # the first step no longer counts
    for t in (2.0, 2.0, 2.0):
        line.update(t)
    assert line.eta_seconds(5) == 2.0 * 95  # window of 3: the 1 s step has left the average
    assert line.format(5, _M).endswith("eta 0:03:10")
    assert line.eta_seconds(100) == 0.0


def test_the_step_line_shows_memory_rss_on_cpu_and_max_allocated_on_cuda():
    record = memory_record(torch.device("cpu"))
    assert set(record) == {"rss_gib"} and 0.01 < record["rss_gib"] < 1024  # this process holds torch
    line = StepLine(total_steps=10)
    assert "rss 1.50 GiB" in line.format(1, {**_M, "rss_gib": 1.5})
    assert "mem 3.25 GiB max alloc" in line.format(1, {**_M, "peak_memory_gib": 3.25})
    assert "SKIPPED" in line.format(1, {**_M, "skipped": True})
    assert format_duration(3725.4) == "1:02:05" and format_duration(math.nan) == "?"


def test_the_summary_counts_this_processes_steps_and_names_the_files(tmp_path: Path):
    records = [
        {"kind": "train", "step": s, "loss": 5.0 - s, "tokens_per_s": 100.0, "step_time_s": 2.0} for s in (1, 2, 3, 4)
    ]
    records += [{"kind": "eval", "step": 4, "val_loss": 1.25}]
    text = run_summary(
        run_dir=tmp_path,
        records=records,
        first_step=2,
        step=4,
        total_steps=4,
        tokens_seen=800,
        wall_s=65.0,
        stop_reason="budget",
        checkpoint=tmp_path / "checkpoints" / "step-4",
        plot=tmp_path / "plots" / "loss.png",
    )
    assert text.splitlines()[0] == "run finished: step 4/4 (resumed at step 2), 800 tokens seen, wall time 0:01:05"
    assert "this run: 2 steps, 400 tokens in 0:00:04 of training steps, 100 tokens/s" in text
    assert "final train loss 1.0000 (step 4), val loss 1.2500 (step 4)" in text
    for path in ("checkpoints/step-4", "metrics.jsonl", "plots/loss.png"):
        assert str(tmp_path / path) in text


def test_tensorboard_without_the_package_is_a_clear_error_at_start(monkeypatch):
    import importlib.util

    import pytest

    from nemofp4.training.metrics import LoggingConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(
        ValueError, match=r"logging.tensorboard=true needs the tensorboard package.*nemofp4\[tensorboard\]"
    ):
        LoggingConfig(tensorboard=True)
    LoggingConfig(tensorboard=False)
