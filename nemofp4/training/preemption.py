"""Graceful stop on preemption or time limit: agree, checkpoint, requeue, exit.

Slurm warns a job before killing it: ``--signal=B:USR1@120`` (forwarded to the tasks by our sbatch
template) before the time limit, SIGTERM on ``scancel``, preemption or the limit itself (then SIGKILL
after ``KillWait``, 30 s by default), and the submitit launcher used for Hydra sweeps sends SIGUSR2.
The handler installed here only records the signal: the training loop asks ``should_stop()`` once per
step, and because the signal may reach only some ranks (or reach them a step apart), the answer is an
all-reduce MAX of the flag, so every rank stops after the same step and enters the checkpoint
collectives together (Megatron's ``--exit-signal-handler`` and ``--exit-duration-in-mins`` agree the
same way). After the checkpoint is complete, ``requeue_and_exit_code()`` puts the job back in the
queue and tells the trainer which status to exit with; the requeued job keeps its SLURM_JOB_ID, hence
its run directory, and resumes from the latest checkpoint with the same wandb run.

Usage in a training loop::

    with PreemptionHandler() as preemption:
        for step in ...:
            train_step(...)
            if preemption.should_stop():
                save_checkpoint(...)          # collective; complete before requeueing
                sys.exit(preemption.requeue_and_exit_code())
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# Exit status when the job could not be requeued (not under SLURM, or scontrol failed): 128 + SIGTERM,
# what a process killed by SIGTERM reports, so elastic agents, Kubernetes and wrappers treat the run as
# interrupted (and may restart it) rather than finished.
NOT_REQUEUED_EXIT_CODE = 143
# Exit status after a successful requeue: the job ends cleanly (no failure mail, no FAILED state; the
# requeued copy is already pending).
REQUEUED_EXIT_CODE = 0


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


class PreemptionHandler:
    """Signal-driven stop flag that all ranks agree on, plus the SLURM requeue at the end.

    Args:
        signals: signals that request a stop (names, numbers or ``signal.Signals``). SIGKILL and
            SIGSTOP cannot be caught and are rejected.
        not_requeued_exit_code: status ``requeue_and_exit_code`` returns when no requeue happened.
        scontrol: the ``scontrol`` executable (a name looked up on PATH, or a path).
        environ: where SLURM_JOB_ID is read from (the process environment by default).
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
        self.not_requeued_exit_code = not_requeued_exit_code
        self.scontrol = scontrol
        self.environ = environ
        self.received_signal: signal.Signals | None = None
        self._stop_requested = False
        self._agreed_stop = False
        self._previous_handlers: dict[signal.Signals, Any] = {}
        if install:
            self.install()

    # ---------------------------------------------------------------- handlers

    def install(self) -> PreemptionHandler:
        if self._previous_handlers:
            return self
        for sig in self.signals:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def close(self) -> None:
        """Restore the handlers that were in place before ``install``."""
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only set flags: anything heavier (I/O, collectives) is unsafe inside a signal handler.
        if self.received_signal is None:
            self.received_signal = signal.Signals(signum)
        self._stop_requested = True

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
            return self._agreed_stop
        flag = torch.tensor([1 if self._stop_requested else 0], dtype=torch.int32, device=_device_for(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self._agreed_stop = bool(flag.item())
        if self._agreed_stop and not self._stop_requested:
            logger.info("stopping after this step: another rank received a preemption signal")
        return self._agreed_stop

    # ---------------------------------------------------------------- requeue

    def requeue_and_exit_code(self, group: dist.ProcessGroup | None = None) -> int:
        """Requeue the SLURM job (rank 0 only) and return the status every rank should exit with.

        Call it after the checkpoint is complete: ``scontrol requeue`` ends the running job, so the
        other ranks may be signalled shortly afterwards. Returns ``REQUEUED_EXIT_CODE`` (0) when the
        requeue succeeded, else ``not_requeued_exit_code``. A failed requeue is logged, not raised: the
        checkpoint is already safe and the user can resubmit. Collective when a process group exists,
        so all ranks return the same status.
        """
        distributed = dist.is_available() and dist.is_initialized()
        is_rank0 = not distributed or dist.get_rank(group) == 0
        requeued = self._requeue() if is_rank0 else False
        if distributed:
            flag = torch.tensor([1 if requeued else 0], dtype=torch.int32, device=_device_for(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # only rank 0 contributes a 1
            requeued = bool(flag.item())
        return REQUEUED_EXIT_CODE if requeued else self.not_requeued_exit_code

    def _requeue(self) -> bool:
        job_id = self.environ.get("SLURM_JOB_ID")
        if not job_id:
            logger.info("not under SLURM (SLURM_JOB_ID unset): nothing to requeue")
            return False
        executable = shutil.which(self.scontrol, path=self.environ.get("PATH"))
        if executable is None:
            logger.warning("cannot requeue job %s: %r not found on PATH", job_id, self.scontrol)
            return False
        command = [executable, "requeue", job_id]
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
        logger.info("requeued SLURM job %s; the next run resumes from the latest checkpoint", job_id)
        return True


def _device_for(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL reduces CUDA tensors only; every other backend takes CPU tensors."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
