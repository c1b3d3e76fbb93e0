"""Two timeouts: start-up runs under distributed.startup_timeout_s, then every collective waits at most
distributed.collective_timeout_s. A rank that hangs after step 2 ends the job on both ranks within that
timeout plus preemption.exit_grace_s (not after the hang, nor after 30 minutes), and the rank that waited
says which rank it is and which operation timed out (2 gloo ranks under torchrun, the tiny model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

from tests.conftest import ROOT, SMALL
from tests.conftest import free_port as _free_port

TIMEOUT_S = 5.0
GRACE_S = 3.0
STALL_S = 120.0


def test_a_hung_rank_ends_the_job_within_the_collective_timeout_plus_the_exit_grace(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        "-m",
        "nemofp4.train",
        *SMALL,
        f"run_dir={tmp_path / 'run'}",
        "precision=bf16",
        "train.kernels=eager",
        "distributed=fsdp",
        "train.micro_batch=2",
        "train.max_steps=8",
        "eval.at_start=false",
        "eval.num_sequences=0",
        "checkpoint.interval=0",
        "checkpoint.save_final=false",
        f"distributed.collective_timeout_s={TIMEOUT_S}",
        f"preemption.exit_grace_s={GRACE_S}",
        "debug.stall_after_step=2",
        "debug.stall_rank=1",
        f"debug.stall_s={STALL_S}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stdout))
    reader.start()
    try:
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    reader.join(timeout=10)
    text = "".join(line for _, line in lines)

    def seen(pattern: str) -> float:
        hits = [t for t, line in lines if re.search(pattern, line)]
        assert hits, f"no line matches {pattern!r}:\n{text[-6000:]}"
        return hits[0]

    assert proc.returncode != 0, text[-4000:]
    assert "collective timeout: 5 s from now on" in text  # switched after the first step
    stalled = seen(r"debug.stall_after_step=2: rank 1 stalls")
    # rank 0 names itself and the operation it waited in: the stop-flag all-reduce after step 2
    error = seen(
        r"rank 0 of 2: all_reduce \(nemofp4/training/preemption.py:should_stop\) timed out after 5 s "
        r"\(distributed.collective_timeout_s\) at step 2"
    )
    assert TIMEOUT_S - 1 <= error - stalled <= TIMEOUT_S + 4, text[-4000:]
    # rank 1, still asleep, is stopped by the launcher and ends itself after the exit grace
    assert "still running 3 s after SIGTERM" in text
    assert ended - stalled <= TIMEOUT_S + GRACE_S + 10, f"ended {ended - stalled:.1f} s after the stall"
    print(f"timed out {error - stalled:.1f} s and ended {ended - stalled:.1f} s after the stall")
