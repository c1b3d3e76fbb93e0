"""PreemptionHandler: signal flag, agreement across ranks, requeue through (a fake) scontrol."""

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from nemofp4.training.dist_env import destroy_distributed, detect_dist_env, init_distributed
from nemofp4.training.preemption import NOT_REQUEUED_EXIT_CODE, REQUEUED_EXIT_CODE, PreemptionHandler

REPO_ROOT = Path(__file__).resolve().parents[2]


def _fake_scontrol(directory, *, status: int = 0) -> str:
    """An `scontrol` that appends its arguments to calls.log and exits with `status`."""
    path = directory / "scontrol"
    log = directory / "calls.log"
    path.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\necho "requeue refused" >&2\nexit {status}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_signal_sets_the_flag_and_records_which():
    with PreemptionHandler() as handler:
        assert not handler.should_stop() and handler.received_signal is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.stop_requested
        assert handler.received_signal is signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal is recorded as a stop, not as the cause
        assert handler.received_signal is signal.SIGUSR1
        assert handler.should_stop() and handler.should_stop()


def test_close_restores_previous_handlers():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        handler = PreemptionHandler(["USR1"])
        assert signal.getsignal(signal.SIGUSR1) == handler._on_signal
        handler.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and not handler.stop_requested
    finally:
        signal.signal(signal.SIGUSR1, previous)
    term_before = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler(install=False) as handler:
        assert signal.getsignal(signal.SIGTERM) == handler._on_signal
    assert signal.getsignal(signal.SIGTERM) == term_before


def test_unhandled_signal_is_not_caught():
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with PreemptionHandler([signal.SIGTERM, "SIGUSR1"]) as handler:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert not handler.should_stop()
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("bad", [["SIGKILL"], ["NOPE"], [], [99999]])
def test_bad_signal_lists_are_rejected(bad):
    with pytest.raises(ValueError):
        PreemptionHandler(bad, install=False)


def test_requeue_runs_scontrol_with_the_job_id(tmp_path):
    scontrol = _fake_scontrol(tmp_path)
    handler = PreemptionHandler(install=False, scontrol=scontrol, environ={"SLURM_JOB_ID": "4242"})
    assert handler.requeue_and_exit_code() == REQUEUED_EXIT_CODE == 0
    assert (tmp_path / "calls.log").read_text() == "requeue 4242\n"


def test_requeue_found_on_path(tmp_path):
    _fake_scontrol(tmp_path)
    environ = {"SLURM_JOB_ID": "99", "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    assert PreemptionHandler(install=False, environ=environ).requeue_and_exit_code() == 0
    assert (tmp_path / "calls.log").read_text() == "requeue 99\n"


def test_failed_requeue_is_logged_not_raised(tmp_path, caplog):
    scontrol = _fake_scontrol(tmp_path, status=1)
    handler = PreemptionHandler(
        install=False, scontrol=scontrol, environ={"SLURM_JOB_ID": "7"}, not_requeued_exit_code=3
    )
    assert handler.requeue_and_exit_code() == 3
    assert "requeue refused" in caplog.text


def test_under_the_batch_script_the_requeue_is_a_request_file_not_scontrol(tmp_path, caplog):
    """With NEMOFP4_REQUEUE_REQUEST set (the launcher's script) rank 0 leaves the request there, and the
    script requeues after srun returns: scontrol is not run from inside the step."""
    scontrol = _fake_scontrol(tmp_path)
    request = tmp_path / "run" / ".requeue-request"
    request.parent.mkdir()
    environ = {"SLURM_JOB_ID": "4242", "NEMOFP4_REQUEUE_REQUEST": str(request)}
    handler = PreemptionHandler(install=False, scontrol=scontrol, environ=environ)
    with caplog.at_level("INFO"):
        assert handler.requeue_and_exit_code(checkpoint="/ckpt/step-7", step=7) == REQUEUED_EXIT_CODE
    assert request.read_text() == "job 4242; it resumes from /ckpt/step-7\n"
    assert not (tmp_path / "calls.log").exists()
    assert "asked the batch script to requeue SLURM job 4242" in caplog.text
    unwritable = PreemptionHandler(
        install=False, scontrol=scontrol, environ={**environ, "NEMOFP4_REQUEUE_REQUEST": str(tmp_path / "no" / "dir")}
    )
    assert unwritable.requeue_and_exit_code() == NOT_REQUEUED_EXIT_CODE  # the request could not be left


def test_missing_scontrol_and_no_slurm(tmp_path):
    missing = PreemptionHandler(install=False, scontrol=str(tmp_path / "absent"), environ={"SLURM_JOB_ID": "7"})
    assert missing.requeue_and_exit_code() == NOT_REQUEUED_EXIT_CODE
    scontrol = _fake_scontrol(tmp_path)
    outside = PreemptionHandler(install=False, scontrol=scontrol, environ={})
    assert outside.requeue_and_exit_code() == NOT_REQUEUED_EXIT_CODE
    assert not (tmp_path / "calls.log").exists()  # nothing to requeue outside SLURM


# ---------------------------------------------------------------------------------------------- 2 ranks

SIGNAL_AT_STEP = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, port: int, scontrol: str, results) -> None:
    environ = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    init_distributed(detect_dist_env(environ), backend="gloo", timeout_s=60)
    stopped_at = None
    with PreemptionHandler(scontrol=scontrol, environ={"SLURM_JOB_ID": "31337"}) as handler:
        for step in range(1, 10):
            if rank == 1 and step == SIGNAL_AT_STEP:
                os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is signalled
            if handler.should_stop():
                stopped_at = step
                break
        exit_code = handler.requeue_and_exit_code()
        own = handler.received_signal.name if handler.received_signal else None
    results.put((rank, stopped_at, own, exit_code))
    destroy_distributed()


def test_two_ranks_agree_to_stop_and_rank0_requeues(tmp_path):
    assert not dist.is_initialized()
    scontrol = _fake_scontrol(tmp_path)
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(_free_port(), scontrol, results), nprocs=2, start_method="spawn")
    rows = sorted(results.get() for _ in range(2))
    assert rows == [(0, SIGNAL_AT_STEP, None, 0), (1, SIGNAL_AT_STEP, "SIGUSR1", 0)]
    assert (tmp_path / "calls.log").read_text() == "requeue 31337\n"  # once, from rank 0


# ---------------------------------------------------------------------------------------------- SIGINT, exit


def test_sigint_stops_like_sigterm_but_never_requeues(tmp_path):
    scontrol = _fake_scontrol(tmp_path)
    previous = signal.getsignal(signal.SIGINT)
    with PreemptionHandler(scontrol=scontrol, environ={"SLURM_JOB_ID": "5"}, exit_grace_s=0) as handler:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the step finishes and checkpoints
        assert handler.should_stop() and handler.received_signal is signal.SIGINT
        assert handler.requeue_and_exit_code() == 130
    assert not (tmp_path / "calls.log").exists()
    assert signal.getsignal(signal.SIGINT) == previous


def test_sigterm_without_a_requeue_exits_143():
    with PreemptionHandler(environ={}, exit_grace_s=0) as handler:
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.should_stop()
        assert handler.requeue_and_exit_code() == 143 == NOT_REQUEUED_EXIT_CODE


def test_negative_grace_is_rejected():
    from nemofp4.training.preemption import PreemptionConfig

    with pytest.raises(ValueError, match="exit_grace_s"):
        PreemptionConfig(exit_grace_s=-1)
    with pytest.raises(ValueError, match="exit_grace_s"):
        PreemptionHandler(exit_grace_s=-1, install=False)


AFTER_REQUEUE = """
import os, signal, sys, time
from nemofp4.training.preemption import PreemptionHandler
with PreemptionHandler(scontrol=sys.argv[1], environ={"SLURM_JOB_ID": "77"}, exit_grace_s=30) as handler:
    os.kill(os.getpid(), signal.SIGUSR1)
    assert handler.should_stop()
    code = handler.requeue_and_exit_code()
# what Slurm does after `scontrol requeue`: SIGTERM to every process of the step, more than once
for _ in range(3):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
print("still here", code, flush=True)
sys.exit(code)
"""


def test_signals_after_the_requeue_do_not_change_the_exit_status(tmp_path):
    scontrol = _fake_scontrol(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", AFTER_REQUEUE, scontrol],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "still here 0\n" and "Traceback" not in result.stderr
    assert (tmp_path / "calls.log").read_text() == "requeue 77\n"


STUCK_RANK = """
import logging, os, sys, time
logging.basicConfig(level=logging.INFO)
import torch, torch.distributed as dist
from nemofp4.training.dist_env import detect_dist_env, init_distributed
from nemofp4.training.preemption import PreemptionHandler
init_distributed(detect_dist_env(), backend="gloo", timeout_s=120)
rank = dist.get_rank()
with PreemptionHandler(environ={}, exit_grace_s=float(sys.argv[1])):
    if rank == 1:
        time.sleep(120)  # the peer that never arrives
    print("entering the collective", flush=True)
    dist.all_reduce(torch.ones(1))  # blocks in C++: no Python signal handler can run here
    print("collective returned", flush=True)
"""


def test_a_rank_stuck_in_a_collective_exits_soon_after_sigterm(tmp_path):
    port = _free_port()
    environ = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "LOCAL_WORLD_SIZE": "2",
    }
    procs = []
    for rank in range(2):
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", STUCK_RANK, "2"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**environ, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            )
        )
    try:
        deadline = time.monotonic() + 120
        while "entering the collective" not in (tmp_path / "rank0.log").read_text():
            assert procs[0].poll() is None and time.monotonic() < deadline, (tmp_path / "rank0.log").read_text()
            time.sleep(0.1)
        time.sleep(0.5)  # inside all_reduce by now
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        code = procs[0].wait(timeout=60)
        waited = time.monotonic() - sent
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    log = (tmp_path / "rank0.log").read_text()
    assert code == 143, log
    assert 2.0 <= waited < 20.0, log  # the grace period, not the 120 s collective timeout
    assert "received SIGTERM: this process exits within 2 s" in log
    assert "still running 2 s after SIGTERM" in log and "collective returned" not in log
    assert "all_reduce" in log  # the stack dump shows where it was stuck


def test_requeue_survives_the_sigterm_slurm_sends_while_requeueing(tmp_path):
    """`scontrol requeue` runs inside the job step, which Slurm signals as it requeues: the requeue still
    reports success (a stand-in scontrol that receives SIGTERM before it answers)."""
    path = tmp_path / "scontrol"
    path.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/calls.log"\nkill -TERM $$\nsleep 0.2\nexit 0\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    handler = PreemptionHandler(install=False, scontrol=str(path), environ={"SLURM_JOB_ID": "12"})
    assert handler.requeue_and_exit_code() == REQUEUED_EXIT_CODE
    assert (tmp_path / "calls.log").read_text() == "requeue 12\n"
