"""Multi-process training on CPU with gloo: FSDP2 vs one process, DCP resharding between world sizes,
DeepSpeed ZeRO checkpoints that resume exactly, and workers that end with a killed launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemofp4.checkpointing import load_tensors
from nemofp4.training.metrics import read_metrics
from tests.conftest import ROOT, SMALL, free_port, held_references, launch, losses, process_gone, relative_gap


# One process takes the whole global batch of 4 in one micro-batch; two FSDP2 ranks take 2 each. The
# gradient is then the same mean over the same 4 sequences, summed in a different order, so BF16-recipe
# (FP32 on CPU) losses agree to float32 rounding amplified by Adam over a few steps. UE5M3 additionally
# draws its stochastic-rounding bits per rank, so the two runs round dY differently: the gap is the size of
# the SR noise (measured 7e-4 relative over 6 steps; bf16 measured 2e-7), bounded here at 1e-2.
@pytest.mark.parametrize("precision, rtol", [pytest.param("bf16", 1e-5, marks=pytest.mark.slow), ("ue5m3", 1e-2)])
def test_fsdp_two_ranks_match_one_process_and_agree_on_references(tmp_path, precision, rtol):
    # the eager quantizer (bitwise the compiled one): three processes would each compile every operand kind
    common = [f"precision={precision}", "train.max_steps=6", "checkpoint.interval=6", "train.kernels=eager"]
    launch(1, tmp_path / "one", *common, "train.micro_batch=4")
    launch(2, tmp_path / "two", *common, "distributed=fsdp", "train.micro_batch=2")
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(two) == list(range(1, 7))
    assert one[1] == pytest.approx(two[1], rel=1e-5)  # identical weights at step 1 (same init on every rank)
    # the gradient of the same global mean loss: each rank backpropagates its share and FSDP2 sums
    grad_norms = [{r["step"]: r["grad_norm"] for r in read_metrics(tmp_path / run, "train")} for run in ("one", "two")]
    assert grad_norms[1][1] == pytest.approx(grad_norms[0][1], rel=rtol)
    assert relative_gap(two, one, range(1, 7)) < rtol
    rank_files = sorted((tmp_path / "two" / "checkpoints" / "step-6" / "rank").glob("rank-*.pt"))
    assert len(rank_files) == 2
    # the ranks hold one set of references (reduced at sampling): saved once, in the DCP state
    assert all("references" not in load_tensors(f) for f in rank_files)
    refs = held_references(tmp_path / "two" / "checkpoints" / "step-6")
    assert bool(refs) == (precision == "ue5m3"), "ue5m3 holds references, bf16 none"


@pytest.mark.parametrize("first, second", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])  # one direction in CI
def test_checkpoint_reshards_between_world_sizes(tmp_path, first, second):
    common = ["precision=bf16", "train.max_steps=6", "checkpoint.interval=3", "train.micro_batch=2"]
    fsdp = lambda n: ["distributed=fsdp"] if n > 1 else []
    launch(first, tmp_path / "straight", *common, *fsdp(first))
    launch(
        first, tmp_path / "moved", *common, *fsdp(first), "debug.sigkill_at_step=3", expect_rc=1 if first > 1 else -9
    )
    launch(second, tmp_path / "moved", *common, *fsdp(second))
    straight, moved = losses(tmp_path / "straight"), losses(tmp_path / "moved")
    assert sorted(moved) == list(range(1, 7))
    # after the move the gradient sums run in another order (accumulation vs all-reduce): float32 rounding
    assert relative_gap(moved, straight, range(4, 7)) < 1e-4


# slow (three two-rank DeepSpeed launches each, about 70 s): the DeepSpeed configs are checked in
# tests/unit/test_parallel_config.py; FSDP2 carries the distributed resume properties in CI
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_trains_checkpoints_and_resumes_exactly(tmp_path, stage):
    pytest.importorskip("deepspeed")
    common = [
        "precision=bf16",
        "train.max_steps=4",
        "checkpoint.interval=2",
        "train.micro_batch=2",
        f"distributed=deepspeed_zero{stage}",
    ]
    launch(2, tmp_path / "straight", *common)
    launch(2, tmp_path / "resumed", *common, "debug.sigkill_at_step=2", expect_rc=1)
    assert (tmp_path / "resumed" / "checkpoints" / "step-2" / "deepspeed").is_dir()
    launch(2, tmp_path / "resumed", *common)
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == straight[step]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_workers_of_a_launcher_killed_with_sigkill_stop_at_once(tmp_path):
    """torchrun starts each worker in a session of its own: a SIGKILL to the launcher alone (or to its
    process group) never reaches them, and they trained on and kept saving checkpoints. Each worker asks
    the kernel for a SIGKILL when its launcher dies (nemofp4.training.dist_env.stop_with_launcher)."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            "-m",
            "nemofp4.train",
            *SMALL,
            "distributed=fsdp",
            "train.micro_batch=2",
            "train.max_steps=100000",
            "checkpoint.interval=2",
            "train.kernels=eager",
            f"run_dir={run_dir}",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.is_file() and '"checkpoint"' in metrics.read_text()):  # training, and saving
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        workers = [
            int(pid)
            for task in Path(f"/proc/{launcher.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()
        ]
        assert len(workers) == 2 and all(os.getsid(w) == w for w in workers)  # each its own session
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone
        launcher.wait()
        killed = time.monotonic()
        while not all(process_gone(w) for w in workers) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        assert all(process_gone(w) for w in workers), "a worker outlived its launcher by 10 s"
        saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        time.sleep(2)
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == saved  # nothing writes any more
    finally:
        for pid in [launcher.pid, *workers]:
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
