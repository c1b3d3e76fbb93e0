"""A run directory holds one run: a lock against a second trainer, and starting over without destroying.

The lock is a JSON file, ``<run_dir>/run.lock``, naming the holder's host, pid and SLURM job id (and
restart count). Only rank 0 takes it; the other ranks learn the outcome by broadcast, so they never race
for it. A lock is stale when its holder is gone: a dead pid on this host, or an earlier incarnation of
this SLURM job (``scontrol requeue`` keeps the job id and raises ``SLURM_RESTART_COUNT``). A stale lock
is reported and taken over; a live one refuses the start, naming its holder. The lock is released on
every exit the process survives (return, exception, sys.exit); after a SIGKILL it is stale by the rules
above.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nemofp4.checkpointing import complete_checkpoints

log = logging.getLogger("nemofp4")

LOCK_FILE = "run.lock"
RUN_CONFIG = "config.yaml"
METRICS_FILE = "metrics.jsonl"

__all__ = ["LOCK_FILE", "RUN_CONFIG", "RunDirectory", "RunLockedError", "describe_used", "move_aside"]


class RunLockedError(RuntimeError):
    """Another live trainer holds the run directory."""


def _holder_identity() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict[str, Any]) -> str:
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, since {holder.get('started')}"


def stale_reason(holder: dict[str, Any], me: dict[str, Any]) -> str | None:
    """Why the lock of `holder` is stale from the point of view of `me`, or None if it may be live."""
    same_host = holder.get("host") == me["host"]
    if same_host and holder.get("pid") == me["pid"]:
        return "it was taken by this process"
    if same_host and isinstance(holder.get("pid"), int) and not _pid_alive(holder["pid"]):
        return f"process {holder['pid']} on this host has exited"
    job = holder.get("slurm_job_id")
    if job and job == me["slurm_job_id"] and int(holder.get("slurm_restart_count", 0)) < me["slurm_restart_count"]:
        return f"SLURM job {job} was requeued (restart {holder.get('slurm_restart_count', 0)} -> {me['slurm_restart_count']})"
    return None


class RunLock:
    """The lock file of one run directory, held by this process (rank 0)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.me = _holder_identity()
        self.held = False

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            atexit.register(self.release)
            return
        raise RunLockedError(f"could not take the lock {self.path}: it keeps changing hands")

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            holder = json.loads(path.read_text())
            return holder if isinstance(holder, dict) else None
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None

    def _take_over_if_stale(self) -> None:
        holder = self._read(self.path)
        if holder == {}:
            return  # released meanwhile: try again
        if holder is None:  # unreadable: a holder mid-write, or garbage; only old garbage is stale
            age = time.time() - self.path.stat().st_mtime
            if age < 30:
                raise RunLockedError(f"{self.path} is being written by another trainer; try again")
            reason, holder = f"the lock file is unreadable and {age:.0f} s old", {}
        else:
            reason = stale_reason(holder, self.me)
        if reason is None:
            raise RunLockedError(
                f"run_dir {self.path.parent} is in use by {_describe(holder)} (lock {self.path}). Wait for it to "
                f"finish, or use another run_dir; if that process is gone, delete {self.path}"
            )
        log.warning("taking over the stale lock %s (%s): %s", self.path, _describe(holder) if holder else "?", reason)
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return  # another starter took it over first: try again
        if holder and self._read(aside) != holder:  # we moved a fresh lock taken meanwhile: put it back
            os.replace(aside, self.path)
            return
        aside.unlink(missing_ok=True)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self._read(self.path) == self.me:  # never delete a lock that another trainer took over
            self.path.unlink(missing_ok=True)


def describe_used(run_dir: Path) -> str | None:
    """What a run directory already holds (checkpoints, metrics, a config), or None when it holds no run."""
    run_dir = Path(run_dir)
    parts = []
    ckpts = complete_checkpoints(run_dir / "checkpoints")
    if ckpts:
        parts.append(f"{len(ckpts)} checkpoint(s), newest {ckpts[-1].name}")
    metrics = run_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size:
        parts.append(METRICS_FILE)
    if (run_dir / RUN_CONFIG).is_file():
        parts.append(RUN_CONFIG)
    return ", ".join(parts) or None


def move_aside(run_dir: Path) -> Path:
    """Move everything in `run_dir` but the lock into a sibling `<run_dir>.replaced-<UTC time>`."""
    run_dir = Path(run_dir)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    n = 1
    while aside.exists():
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}")
        n += 1
    aside.mkdir(parents=True)
    for entry in run_dir.iterdir():
        if entry.name != LOCK_FILE:
            shutil.move(str(entry), str(aside / entry.name))
    return aside


def _broadcast_error(error: tuple[str, str] | None, world: int) -> tuple[str, str] | None:
    """Rank 0's outcome (None, or the error's type name and message) on every rank."""
    if world > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return error


class RunDirectory:
    """Opens a run directory for one trainer: creates it, takes the lock (rank 0) and, with
    overwrite=true, moves a previous run aside. `close()` releases the lock; `abandon()` also removes
    the directory again when this start created it and left nothing in it."""

    def __init__(self, path: Path, *, rank: int, world: int, overwrite: bool):
        self.path = Path(path)
        self.rank = rank
        self.created = False
        self.lock: RunLock | None = None
        self.moved_to: Path | None = None
        error = None
        if rank == 0:
            try:
                self.created = not self.path.exists()
                self.path.mkdir(parents=True, exist_ok=True)
                self.lock = RunLock(self.path)
                self.lock.acquire()
                if overwrite and describe_used(self.path) is not None:
                    self.moved_to = move_aside(self.path)
                    log.warning("overwrite=true: the previous run in %s was moved to %s", self.path, self.moved_to)
            except Exception as err:  # every rank must learn of it, or the others wait forever
                error = (type(err).__name__, str(err))
                self._cleanup_created()
        error = _broadcast_error(error, world)
        if error is not None:
            kind, message = error
            raise RunLockedError(message) if kind == "RunLockedError" else OSError(f"{kind}: {message}")

    def _cleanup_created(self) -> None:
        if self.lock is not None and self.lock.held:
            self.lock.release()
        if self.created and self.path.is_dir():
            leftovers = [p for p in self.path.rglob("*") if not p.is_dir()]
            if not leftovers:
                shutil.rmtree(self.path, ignore_errors=True)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def abandon(self) -> None:
        """The start failed: release the lock, and leave no empty directory behind."""
        if self.rank == 0:
            self._cleanup_created()
