"""End to end on CPU: two `srun python -m nemofp4.train` tasks (simulated SLURM environment), one of
them sent SIGUSR1, agree to stop, checkpoint, requeue through a stand-in scontrol, exit 0; running
the same command again resumes at the next step."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

MAX_STEPS = 12
JOB_ID = "4242"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train_steps(metrics_path) -> list[int]:
    if not metrics_path.exists():
        return []
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [row["step"] for row in rows if row.get("kind") == "train"]


def _start_tasks(tmp_path, run_dir, bin_dir) -> list[subprocess.Popen]:
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "nemofp4.train",
        "experiment=tiny_bf16",
        "distributed=fsdp",
        f"train.max_steps={MAX_STEPS}",
        "train.seq_len=64",
        "train.global_batch=4",
        "train.micro_batch=2",
        "eval.at_start=false",
        "eval.interval=0",
        "eval.num_sequences=0",
        "checkpoint.interval=0",
        "logging.log_interval=1",
        "logging.wandb_mode=disabled",
        f"run_dir={run_dir}",
    ]
    tasks = []
    for rank in range(2):
        environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        environ.update(
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            SLURM_JOB_ID=JOB_ID,
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NTASKS="2",
            SLURM_NODEID="0",
            SLURM_TASKS_PER_NODE="2",
            SLURM_JOB_NODELIST="localhost",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        log = open(tmp_path / f"rank{rank}.log", "a")  # noqa: SIM115 - closed with the process
        tasks.append(subprocess.Popen(command, cwd=tmp_path, env=environ, stdout=log, stderr=subprocess.STDOUT))
    return tasks


def _wait_all(tasks, tmp_path, timeout_s=900) -> list[int]:
    deadline = time.monotonic() + timeout_s
    codes = []
    for rank, task in enumerate(tasks):
        try:
            codes.append(task.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in tasks:
                other.kill()
            pytest.fail(f"rank {rank} did not finish:\n{(tmp_path / f'rank{rank}.log').read_text()[-3000:]}")
    return codes


def test_sigusr1_on_one_rank_checkpoints_requeues_and_resumes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/scontrol.calls"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"

    tasks = _start_tasks(tmp_path, run_dir, bin_dir)
    deadline = time.monotonic() + 600
    while not _train_steps(metrics) or max(_train_steps(metrics)) < 2:
        assert all(task.poll() is None for task in tasks), (tmp_path / "rank0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "training never reached step 2"
        time.sleep(0.2)
    tasks[1].send_signal(signal.SIGUSR1)  # like a preemption notice that reached one node only
    codes = _wait_all(tasks, tmp_path)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2))
    assert codes == [0, 0], logs  # requeued: both ranks exit cleanly
    assert (tmp_path / "scontrol.calls").read_text() == f"requeue {JOB_ID}\n", logs  # rank 0 only
    stopped_at = max(_train_steps(metrics))
    assert stopped_at < MAX_STEPS
    assert (run_dir / "checkpoints" / f"step-{stopped_at}").is_dir(), logs
    events = [json.loads(line) for line in metrics.read_text().splitlines() if '"event"' in line]
    assert events[-1]["event"] == "preempted" and events[-1]["step"] == stopped_at

    # The requeued job runs the same command and continues at the next step.
    first_run_rows = len(metrics.read_text().splitlines())
    codes = _wait_all(_start_tasks(tmp_path, run_dir, bin_dir), tmp_path)
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    resumed = [
        json.loads(line)["step"] for line in metrics.read_text().splitlines()[first_run_rows:] if '"train"' in line
    ]
    assert resumed == list(range(stopped_at + 1, MAX_STEPS + 1))
    assert (tmp_path / "scontrol.calls").read_text() == f"requeue {JOB_ID}\n"  # no second requeue
