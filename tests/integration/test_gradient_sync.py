"""FSDP2 gradient accumulation reduces gradients once per optimizer step, and HSDP (2 x 2 on 4
gloo processes) trains the same losses as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SMALL, losses, relative_gap
from tests.conftest import free_port as _free_port

COMMON = [
    *SMALL,
    "precision=bf16",
    "train.max_steps=3",
    "train.global_batch=8",
    "checkpoint.interval=0",
    "checkpoint.save_final=false",
    "eval.num_sequences=0",
    "eval.at_start=false",
]


def _run(nproc: int, run_dir: Path, *overrides: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={_free_port()}",
        "-m",
        "tests.integration.count_collectives",
        *COMMON,
        f"run_dir={run_dir}",
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((run_dir / f"collectives-rank{r}.json").read_text()) for r in range(nproc)]


def test_hsdp_2x2_reduces_once_per_step_and_matches_one_process(tmp_path):
    one = _run(1, tmp_path / "one", "train.micro_batch=2")  # 4 micro-batches a step on one process
    hsdp = _run(4, tmp_path / "hsdp", "distributed=fsdp", "distributed.replicate_degree=2", "train.micro_batch=1")
    assert one[0]["grad_accum"] == 4 and hsdp[0]["grad_accum"] == 2
    for counts in hsdp:
        assert counts["steps"] == 3 and counts["fsdp_groups"] > 1
        assert counts["reduce_scatters"] == counts["steps"] * counts["fsdp_groups"]  # not x grad_accum
    a, b = losses(tmp_path / "one"), losses(tmp_path / "hsdp")
    assert sorted(b) == [1, 2, 3]
    assert relative_gap(b, a, range(1, 4)) < 1e-5


def test_per_micro_batch_sync_reduces_every_micro_batch_to_the_same_losses(tmp_path):
    """The counter sees every reduce-scatter: syncing each micro-batch multiplies them by grad_accum."""
    per_step = _run(2, tmp_path / "step", "distributed=fsdp", "train.micro_batch=2")
    per_micro = _run(
        2, tmp_path / "micro", "distributed=fsdp", "train.micro_batch=2", "distributed.gradient_sync=per_micro_batch"
    )
    for a, b in zip(per_step, per_micro):
        assert a["grad_accum"] == 2
        assert a["reduce_scatters"] == a["steps"] * a["fsdp_groups"]
        assert b["reduce_scatters"] == 2 * a["reduce_scatters"]
    assert relative_gap(losses(tmp_path / "micro"), losses(tmp_path / "step"), range(1, 4)) < 1e-5


def test_replicate_degree_must_divide_the_world_size(tmp_path):
    with pytest.raises(AssertionError, match=r"replicate_degree=3 does not divide the world size 2"):
        _run(2, tmp_path / "bad", "distributed=fsdp", "distributed.replicate_degree=3", "train.micro_batch=2")
