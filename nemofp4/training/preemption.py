"""Graceful stop on preemption or time limit: agree, checkpoint, requeue, exit.

Slurm warns a job before killing it: ``--signal=B:USR1@120`` (forwarded to the tasks by our sbatch
template) before the time limit, SIGTERM on ``scancel``, preemption or the limit itself (then SIGKILL
after ``KillWait``, 30 s by default), and the submitit launcher used for Hydra sweeps sends SIGUSR2.
SIGINT (Ctrl-C) is handled like SIGTERM, except that it never requeues: the run checkpoints at the
step boundary and exits with 130.
The handler installed here only records the signal: the training loop asks ``should_stop()`` once per
step, and because the signal may reach only some ranks (or reach them a step apart), the answer is an
all-reduce MAX of the flag, so every rank stops after the same step and enters the checkpoint
collectives together (Megatron's ``--exit-signal-handler`` and ``--exit-duration-in-mins`` agree the
same way). After the checkpoint is complete, ``requeue_and_exit_code()`` puts the job back in the
queue and tells the trainer which status to exit with; the requeued job keeps its SLURM_JOB_ID, hence
its run directory, and resumes from the latest checkpoint with the same wandb run.

Under the launcher's batch script (``NEMOFP4_REQUEUE_REQUEST`` names a file) rank 0 only leaves that
request file, and the batch script calls ``scontrol requeue`` after ``srun`` has returned: the requeue
then signals no process of the step, so no torchrun agent is killed in its exit barrier (where it dies
with a ``DistNetworkError`` traceback). Elsewhere (the submitit launcher of Hydra sweeps, a hand-written
script) rank 0 calls ``scontrol requeue`` itself; everything that talks to other processes (wandb, the
metrics files) must then be finished before it, since Slurm sends SIGTERM to every process of the step,
and after a successful requeue ``close()`` leaves a handler that ignores further stop signals, so the run
ends with status 0 whatever Slurm sends next.

A rank blocked in a collective (a peer died or never arrives) cannot run a Python signal handler: the
interpreter runs handlers only between bytecodes of the main thread. A watchdog thread therefore
watches the signal wakeup fd, which the C-level handler writes even then; ``exit_grace_s`` after
SIGTERM or SIGINT it dumps every thread's stack and hard-exits (128 + signal, or the chosen status
after a requeue), so a stuck rank ends on its own, with a record of where, before Slurm's SIGKILL.

Usage in a training loop::

    with PreemptionHandler() as preemption:
        for step in ...:
            train_step(...)
            if preemption.should_stop():
                save_checkpoint(...)          # collective; complete before requeueing
                close_loggers()               # wandb & co. before Slurm signals the step again
                code = preemption.requeue_and_exit_code()
                break
    sys.exit(code)
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# Signals that mean "end now": they arm the exit watchdog. SIGUSR1/SIGUSR2 are early warnings (time
# left for a step and a checkpoint); the SIGTERM that follows them arms it.
TERMINATING_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
# A user's Ctrl-C stops the run; it is not a reason to requeue it.
NO_REQUEUE_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT,)
# Exit status when the job could not be requeued (not under SLURM, or scontrol failed): 128 + SIGTERM,
# what a process killed by SIGTERM reports, so elastic agents, Kubernetes and wrappers treat the run as
# interrupted (and may restart it) rather than finished.
NOT_REQUEUED_EXIT_CODE = 143
# Exit status after a successful requeue: the job ends cleanly (no failure mail, no FAILED state; the
# requeued copy is already pending).
REQUEUED_EXIT_CODE = 0
# Below Slurm's default KillWait (30 s), so a stuck rank exits on its own and says where it was.
DEFAULT_EXIT_GRACE_S = 25.0
# Set by the launcher's batch script: where rank 0 asks for the requeue, which the script performs
# after srun returns (slurm/nemofp4.sbatch.tmpl).
REQUEUE_REQUEST_ENV = "NEMOFP4_REQUEUE_REQUEST"


@dataclass(kw_only=True)
class PreemptionConfig:
    """How a run ends when it is told to stop (``preemption.*`` in the trainer's config)."""

    exit_grace_s: float = DEFAULT_EXIT_GRACE_S
    """After SIGTERM or SIGINT, a process still running this many seconds later (e.g. blocked in a
    collective whose peer is gone) dumps its threads' stacks and exits. Keep it below Slurm's
    ``KillWait``; 0 disables the watchdog."""

    def __post_init__(self) -> None:
        if self.exit_grace_s < 0:
            raise ValueError(f"preemption.exit_grace_s must be >= 0 (0: no watchdog), got {self.exit_grace_s}")


def _as_signal(sig: signal.Signals | int | str) -> signal.Signals:
    if isinstance(sig, str):
        name = sig.upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"unknown signal {sig!r}; use a name such as 'SIGTERM', 'USR1' or a number") from None
    try:
        return signal.Signals(sig)
    except ValueError:
        raise ValueError(f"unknown signal number {sig!r}") from None


def flush_and_exit(code: int) -> None:
    """Exit at once with ``code`` (``os._exit``: no clean-up, which may wait in a broken process group),
    after flushing what was logged and printed so the reason reaches the job's log."""
    for name in (None, "nemofp4", __name__):  # the root's handlers and the project's own
        for handler in logging.getLogger(name).handlers:
            with contextlib.suppress(OSError, ValueError):
                handler.flush()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class PreemptionHandler:
    """Signal-driven stop flag that all ranks agree on, plus the SLURM requeue at the end.

    Args:
        signals: signals that request a stop (names, numbers or ``signal.Signals``). SIGKILL and
            SIGSTOP cannot be caught and are rejected.
        not_requeued_exit_code: status ``requeue_and_exit_code`` returns when no requeue happened.
        scontrol: the ``scontrol`` executable (a name looked up on PATH, or a path).
        environ: where SLURM_JOB_ID and ``NEMOFP4_REQUEUE_REQUEST`` are read from (the process
            environment by default). With the latter set, a requeue writes that request file for the
            batch script instead of calling ``scontrol``.
        exit_grace_s: seconds between SIGTERM/SIGINT and the watchdog's hard exit; 0: no watchdog.
        install: install the handlers now; otherwise call ``install()`` or use ``with``.

    Handlers must be installed from the main thread (a Python rule for ``signal.signal``).
    """

    def __init__(
        self,
        signals: Sequence[signal.Signals | int | str] = DEFAULT_SIGNALS,
        *,
        not_requeued_exit_code: int = NOT_REQUEUED_EXIT_CODE,
        scontrol: str = "scontrol",
        environ: Mapping[str, str] = os.environ,
        exit_grace_s: float = DEFAULT_EXIT_GRACE_S,
        install: bool = True,
    ) -> None:
        self.signals = tuple(dict.fromkeys(_as_signal(s) for s in signals))
        if not self.signals:
            raise ValueError("signals must name at least one signal")
        uncatchable = [s.name for s in self.signals if s in (signal.SIGKILL, signal.SIGSTOP)]
        if uncatchable:
            raise ValueError(f"{', '.join(uncatchable)} cannot be caught; choose e.g. SIGTERM or SIGUSR1")
        if not 0 <= not_requeued_exit_code <= 255:
            raise ValueError(f"not_requeued_exit_code must be in [0, 255], got {not_requeued_exit_code}")
        if exit_grace_s < 0:
            raise ValueError(f"exit_grace_s must be >= 0 (0: no watchdog), got {exit_grace_s}")
        self.not_requeued_exit_code = not_requeued_exit_code
        self.scontrol = scontrol
        self.environ = environ
        self.exit_grace_s = exit_grace_s
        self.received_signal: signal.Signals | None = None
        self.exit_code: int | None = None
        """The status chosen by ``requeue_and_exit_code`` (None before)."""
        self._stop_requested = False
        self._agreed_stop = False
        self._previous_handlers: dict[signal.Signals, Any] = {}
        self._previous_wakeup_fd: int | None = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._watchdog: threading.Thread | None = None
        if install:
            self.install()

    # ---------------------------------------------------------------- handlers

    def install(self) -> PreemptionHandler:
        if self._previous_handlers:
            return self
        for sig in self.signals:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        if self.exit_grace_s > 0 and any(s in TERMINATING_SIGNALS for s in self.signals):
            self._start_watchdog()
        return self

    def close(self) -> None:
        """Restore the handlers that were in place before ``install``; after a successful requeue keep
        ignoring the stop signals instead (the run is saved, its next job queued, and Slurm's SIGTERMs
        to the step must not turn its clean exit into a kill; the watchdog stays armed so a hang on
        the way out still ends)."""
        if self.exit_code == REQUEUED_EXIT_CODE and self._previous_handlers:
            for sig in self._previous_handlers:
                signal.signal(sig, self._on_signal_while_exiting)
            self._previous_handlers.clear()
            return
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers.clear()
        self._stop_watchdog()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only set flags: anything heavier (I/O, collectives) is unsafe inside a signal handler.
        if self.received_signal is None:
            self.received_signal = signal.Signals(signum)
        self._stop_requested = True

    def _on_signal_while_exiting(self, signum: int, frame: FrameType | None) -> None:
        """After the requeue: Slurm's SIGTERM to the step must not turn a clean exit into a kill."""

    # ---------------------------------------------------------------- watchdog

    def _start_watchdog(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # set_wakeup_fd is main-thread only, like signal.signal (which would have raised)
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)
        self._watchdog = threading.Thread(target=self._watch, args=(reader,), name="nemofp4-exit-watchdog", daemon=True)
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        if self._wakeup is None:
            return
        reader, writer = self._wakeup
        signal.set_wakeup_fd(self._previous_wakeup_fd if self._previous_wakeup_fd is not None else -1)
        self._wakeup = None
        with contextlib.suppress(OSError, ValueError):
            writer.send(b"\0")  # wakes the watchdog, which sees it was stopped
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        reader.close()
        writer.close()

    def _watch(self, reader: socket.socket) -> None:
        """Wait for a terminating signal's byte on the wakeup fd, then for the grace period."""
        terminating = {int(s) for s in TERMINATING_SIGNALS if s in self.signals}
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data or self._wakeup is None:
                return  # closed or stopped
            hit = next((b for b in data if b in terminating), None)
            if hit is not None:
                break
        sig = signal.Signals(hit)
        code = 128 + int(sig)
        if self.exit_code is not None:
            logger.info("received %s after the run ended (status %d): ignored", sig.name, self.exit_code)
        else:
            logger.info(
                "received %s: this process exits within %g s, after its checkpoint if one is under way",
                sig.name,
                self.exit_grace_s,
            )
        deadline = time.monotonic() + self.exit_grace_s
        while time.monotonic() < deadline:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            if self._wakeup is None:
                return  # the handler was closed normally: the process is on its way out
        code = self.exit_code if self.exit_code is not None else code
        logger.error(
            "still running %g s after %s (a collective whose peer is gone?); stacks follow; exiting with status %d",
            self.exit_grace_s,
            sig.name,
            code,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        flush_and_exit(code)

    # ---------------------------------------------------------------- agreement

    def request_stop(self) -> None:
        """Ask for a stop without a signal (e.g. a wall-clock budget); agreed like a signal."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        """This rank's own flag, without asking the others."""
        return self._stop_requested

    def should_stop(self, group: dist.ProcessGroup | None = None) -> bool:
        """True on every rank of ``group`` once any rank has been signalled. Collective: call it on all
        ranks at the same point of each step (one scalar all-reduce)."""
        if self._agreed_stop:
            return True  # every rank latched at the same call, so skipping the collective stays in step
        if not (dist.is_available() and dist.is_initialized()):
            self._agreed_stop = self._stop_requested
            if self._agreed_stop:
                logger.info("received %s: stopping after this step", self._cause_name())
            return self._agreed_stop
        flag = torch.tensor([1 if self._stop_requested else 0], dtype=torch.int32, device=_device_for(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self._agreed_stop = bool(flag.item())
        if self._agreed_stop and not self._stop_requested:
            logger.info("stopping after this step: another rank received a preemption signal")
        elif self._agreed_stop:
            logger.info("received %s: stopping after this step", self._cause_name())
        return self._agreed_stop

    def _cause_name(self) -> str:
        return self.received_signal.name if self.received_signal else "a stop request"

    # ---------------------------------------------------------------- requeue

    def requeue_and_exit_code(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        checkpoint: str | os.PathLike | None = None,
        step: int | None = None,
    ) -> int:
        """Requeue the SLURM job (rank 0 only) and return the status every rank should exit with.

        Call it after the checkpoint is complete: ``scontrol requeue`` ends the running job, so the
        other ranks may be signalled shortly afterwards. Returns ``REQUEUED_EXIT_CODE`` (0) when the
        requeue succeeded, else ``not_requeued_exit_code``. A failed requeue is logged, not raised: the
        checkpoint is already safe and the user can resubmit. Collective when a process group exists,
        so all ranks return the same status.
        """
        distributed = dist.is_available() and dist.is_initialized()
        is_rank0 = not distributed or dist.get_rank(group) == 0
        cause = self.received_signal
        if distributed:  # which signal stopped the run, as seen by any rank (the largest number wins)
            seen = torch.tensor([int(cause) if cause else 0], dtype=torch.int32, device=_device_for(group))
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
            cause = signal.Signals(int(seen.item())) if int(seen.item()) else None
        no_requeue = cause in NO_REQUEUE_SIGNALS
        if is_rank0 and no_requeue:
            logger.info("stopped by %s: checkpointed, not requeued", cause.name)
        requeued = self._requeue(checkpoint) if is_rank0 and not no_requeue else False
        if distributed:
            flag = torch.tensor([1 if requeued else 0], dtype=torch.int32, device=_device_for(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # only rank 0 contributes a 1
            requeued = bool(flag.item())
        if requeued:
            code = REQUEUED_EXIT_CODE
        elif cause in TERMINATING_SIGNALS:
            code = 128 + int(cause)
        else:
            code = self.not_requeued_exit_code
        self.exit_code = code
        if is_rank0:
            logger.info(
                "preempted%s by %s; %s; exiting with status %d",
                f" at step {step}" if step is not None else "",
                cause.name if cause else "a stop request",
                f"checkpoint {checkpoint}" if checkpoint else "no checkpoint written",
                code,
            )
        return code

    def _requeue(self, checkpoint: str | os.PathLike | None = None) -> bool:
        job_id = self.environ.get("SLURM_JOB_ID")
        if not job_id:
            logger.info("not under SLURM (SLURM_JOB_ID unset): nothing to requeue")
            return False
        resumes_from = checkpoint or "the latest checkpoint in its run dir"
        request = self.environ.get(REQUEUE_REQUEST_ENV)
        if request:
            return self._request_requeue(Path(request), job_id, resumes_from)
        executable = shutil.which(self.scontrol, path=self.environ.get("PATH"))
        if executable is None:
            logger.warning("cannot requeue job %s: %r not found on PATH", job_id, self.scontrol)
            return False
        # Slurm signals every process of the step as it requeues the job, scontrol included: under a
        # shell that ignores SIGTERM (inherited through exec) it lives to report its own success.
        command = ["sh", "-c", 'trap "" TERM; exec "$0" "$@"', executable, "requeue", job_id]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            logger.warning("cannot requeue job %s: %s", job_id, error)
            return False
        if result.returncode != 0:
            logger.warning(
                "scontrol requeue %s failed (status %d): %s", job_id, result.returncode, result.stderr.strip()
            )
            return False
        logger.info("requeued SLURM job %s; it resumes from %s", job_id, resumes_from)
        return True

    @staticmethod
    def _request_requeue(path: Path, job_id: str, resumes_from: object) -> bool:
        """Leave the request for the batch script (atomically: it reads a complete file or none)."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(f"job {job_id}; it resumes from {resumes_from}\n")
            os.replace(tmp, path)
        except OSError as error:
            logger.warning("cannot leave the requeue request %s for the batch script: %s", path, error)
            return False
        logger.info(
            "asked the batch script to requeue SLURM job %s once the step has ended (%s); it resumes from %s",
            job_id,
            path,
            resumes_from,
        )
        return True


def _device_for(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL reduces CUDA tensors only; every other backend takes CPU tensors."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
