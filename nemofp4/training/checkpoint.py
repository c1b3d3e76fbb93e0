"""Atomic, verifiable checkpoints on top of torch.distributed.checkpoint (DCP): the writer side.

The folder layout, finding and safe reading live in `nemofp4.checkpointing` (shared with evaluation).
Every rank writes into `.tmp-step-<N>/`; after a barrier rank 0 writes the marker and renames the
folder, so a crash at any point leaves either the previous checkpoint or the new one, never a
half-written folder that looks complete. An async save stages the state into host buffers that are
allocated at the first save and reused by every later one (pinned on CUDA: DCP's ``DefaultStager``),
writes it from a background thread over a gloo group of its own (never the training loop's group: two
threads' collectives on one group cross), and is published by `poll()` at the first step boundary at
which every rank's write has finished. Each rank checksums the files it wrote itself (it knows their
names from its writer: no rank walks the folder but rank 0, for the files no other rank owns), in the
background for an async save. Publication is then one small gather, rank 0's marker and renames and a
barrier; deleting pruned or replaced folders (rename first, then delete in a background thread on rank
0) holds nobody. Loading verifies sizes (and checksums unless disabled) before any tensor is touched,
so a damaged checkpoint is reported by name, and `resume=auto` falls back to the previous complete
one. Retention ranks checkpoints by save order, never by step number.

At start (`recover`), a same-step re-save that a kill interrupted between its two renames is completed
from whichever complete copy exists, and a step folder without a valid marker is set aside
(`step-<N>.incomplete`), never deleted or replaced. A resume from a checkpoint older than the run's
newest ones sets the newer ones aside (`abandon`: into `abandoned/<tag>/`, a record written first), so
`resume=auto` after a kill continues the branch that resumed.

Longer than 600 lines on purpose: it is one protocol (a step folder written, published, pruned and
read back, sync or async) whose steps share its invariants (the temporary and final names, who owns
which file, when a folder counts as complete), so the writer stays in one place; what needs none of
them, the layout and the safe reading, is already in ``nemofp4.checkpointing``.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from nemofp4.checkpointing import (
    LATEST,
    MARKER,
    STEP_PREFIX,
    TMP_PREFIX,
    TRAINER_STATE,
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    complete_checkpoints,
    crc32,
    is_complete,
    is_step_name,
    latest_checkpoint,
    load_tensors,
    read_marker,
    step_of,
    verify_files,
)

__all__ = [
    "ABANDONED",
    "LATEST",
    "MARKER",
    "STEP_PREFIX",
    "TMP_PREFIX",
    "TRAINER_STATE",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "complete_checkpoints",
    "is_complete",
    "latest_checkpoint",
    "step_of",
]

log = logging.getLogger(__name__)
_OLD_PREFIX = ".old-step-"
_DISCARD_PREFIX = ".deleting-"
"""A folder renamed for deletion (a pruned or replaced checkpoint, a leftover): gone from every listing
at once, deleted in the background; a process killed meanwhile leaves it for the next start."""
_DCP_METADATA = ".metadata"
_DEFAULT_GROUP_TIMEOUT_S = 1800.0
_DAMAGED = ".damaged"
"""Suffix of a damaged checkpoint set aside (`step-<N>.damaged`): kept for a human, never loaded."""
_INCOMPLETE = ".incomplete"
"""Suffix of a step folder found at start without a valid marker (`step-<N>.incomplete`): never loaded,
never replaced or deleted by a later save of that step; kept for a human."""
ABANDONED = "abandoned"
"""Folder of the checkpoints folder holding the branches a resume left behind, one `<tag>/` each."""
_ABANDON_RECORD = "ABANDONED.json"
"""In `abandoned/<tag>/`, committed before anything moves: the folders to set aside, each with its
marker's sha256, so a start after a kill finishes the move and never takes a later save for one."""
_STAGING_PREFIX = ".tmp-"


@dataclass(kw_only=True)
class CheckpointConfig:
    """When and how checkpoints are written."""

    interval: int = 0
    """Save every this many steps (0: only at the end of training)."""
    keep_last_k: int = 3
    """Keep this many complete checkpoints, deleting older ones (0: keep all)."""
    save_final: bool = True
    """Save when training ends (budget reached or preempted)."""
    async_save: bool = False
    """Write model and optimizer in the background (DCP's async_save over a dedicated gloo group); the
    checkpoint is published at the first step boundary after every rank's write finished."""
    verify_checksums: bool = True
    """Record CRC32 of every file and check it on load (sizes are always checked)."""
    export_safetensors: bool = False
    """Also write the model weights alone as model.safetensors in the final checkpoint."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval must be >= 0, got {self.interval}")
        if self.keep_last_k < 0:
            raise ValueError(f"checkpoint.keep_last_k must be >= 0, got {self.keep_last_k}")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every save/load without a process group; one process is a supported layout here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _marker_problem(folder: Path) -> str | None:
    """Why `folder` has no valid marker (missing, unreadable, no file table), or None when it has one."""
    if not (folder / MARKER).is_file():
        return f"no {MARKER}"
    try:
        read_marker(folder)
    except CheckpointError as err:
        return str(err).removeprefix(f"checkpoint {folder}: ")
    return None


def _marker_digest(folder: Path) -> str:
    return hashlib.sha256((folder / MARKER).read_bytes()).hexdigest()


def _free_name(path: Path) -> Path:
    """`path`, or `path-<k>` with the first k not taken: a set-aside folder never replaces another."""
    free, k = path, 1
    while free.exists():
        free, k = path.with_name(f"{path.name}-{k}"), k + 1
    return free


def _on_rank_0(action: Callable[[], None], what: str) -> None:
    """Run `action` on rank 0 alone; if it fails, every rank raises one CheckpointError (none waits in
    a barrier for a rank 0 that failed)."""
    error = None
    if _rank() == 0:
        try:
            action()
        except OSError as err:
            error = f"{what} failed: {err}"
    if _world() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


def _owner_of(relative: str, world: int) -> int:
    """The rank that describes a file in the marker: its writer for DCP shards and rank files, else 0."""
    name = relative.rsplit("/", 1)[-1]
    if name.startswith("__") and name.endswith(".distcp"):
        return int(name[2:].split("_")[0]) % world
    if relative.startswith("rank/rank-") and name.endswith(".pt"):
        return int(name[5:-3]) % world
    return 0


def _files_owned_by(folder: Path, rank: int, world: int, written: list[str]) -> list[Path]:
    """Files this rank describes in the marker: the ones it wrote itself (its rank file and its DCP
    shards, named by its writer); rank 0 also every file no other rank owns (trainer state, DCP
    metadata, extra files, DeepSpeed's), the only rank that lists the folder."""
    own = {f"rank/rank-{rank:05d}.pt", *written}
    if rank == 0:
        own |= {
            str(p.relative_to(folder))
            for p in folder.rglob("*")
            if p.is_file() and _owner_of(str(p.relative_to(folder)), world) == 0
        }
    return [folder / name for name in sorted(own) if (folder / name).is_file()]


def _file_entries(folder: Path, rank: int, world: int, written: list[str], checksums: bool) -> dict[str, dict]:
    """This rank's part of the marker's file table: size, and CRC32 when checksums are on."""
    files = {}
    for path in _files_owned_by(folder, rank, world, written):
        entry: dict[str, int] = {"bytes": path.stat().st_size}
        if checksums:
            entry["crc32"] = crc32(path)
        files[str(path.relative_to(folder))] = entry
    return files


def _save_durable(obj: Any, path: Path) -> None:
    """torch.save, flushed to disk before returning: the marker vouches only for durable files."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _flag_device() -> torch.device:
    """Where the training group reduces a flag: CPU unless the default group is NCCL alone."""
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _any_rank(*flags: bool) -> list[bool]:
    """Each flag OR-ed over all ranks, in one small all-reduce on the training group."""
    if _world() == 1:
        return list(flags)
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=_flag_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


@dataclass(kw_only=True)
class _PendingSave:
    """An async save in flight: every rank's file state is in `tmp`; DCP writes the rest, then this
    rank checksums its files (``future``'s result: its part of the marker's file table)."""

    step: int
    future: Future
    tmp: Path
    final: Path


class _RecordingWriter(FileSystemWriter):
    """DCP's file-system writer that remembers the files it wrote (relative names), so the rank can
    describe them in the marker without listing the folder; ``hold_s`` stalls before writing (fault
    injection: a test kills the job or keeps training while an async save is in flight)."""

    def __init__(self, path: Path, hold_s: float = 0.0):
        super().__init__(str(path))
        self._hold_s = hold_s
        self.written: list[str] = []

    def write_data(self, plan, planner):
        if self._hold_s > 0:
            time.sleep(self._hold_s)
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.wait()})
        return future


def _is_disk_full(err: BaseException) -> bool:
    """ENOSPC/EDQUOT, raised directly or as torch's serializer error ('unexpected pos', 'file write failed')."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        if "unexpected pos" in text or "file write failed" in text or "No space left" in text:
            return True
        err = err.__cause__ or err.__context__
    return False


class CheckpointManager:
    """Saves and finds checkpoints of one run; every rank constructs one."""

    def __init__(self, root: Path, cfg: CheckpointConfig, *, group_timeout_s: float = _DEFAULT_GROUP_TIMEOUT_S):
        self.root = Path(root)
        self.cfg = cfg
        self._pending: _PendingSave | None = None
        self._save_group: dist.ProcessGroup | None = None
        """Async saves' own group, always gloo: DCP's collectives run in the save's thread while the
        training loop uses the default group (NCCL on GPUs, where DCP needs a CPU-capable group). Its
        timeout (``group_timeout_s``, the start-up one) covers one rank's write finishing long after
        another's without failing the save; the training thread never waits in it."""
        if cfg.async_save and dist.is_available() and dist.is_initialized():
            # collective: every rank constructs a manager
            self._save_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=group_timeout_s))
        self._stager: DefaultStager | None = None  # async saves' host buffers, made at the first one
        self._checksummer: ThreadPoolExecutor | None = None  # async saves' checksums, after DCP's write
        self._janitor: ThreadPoolExecutor | None = None  # rank 0's deletions
        self._discarded = itertools.count()
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        _barrier()

    @property
    def save_group(self) -> dist.ProcessGroup | None:
        """The gloo group of async saves' background writes (None without async saves or a process group)."""
        return self._save_group

    def close(self) -> None:
        """Release the staging buffers and let rank 0's background deletions finish."""
        for executor in (self._checksummer, self._janitor):
            if executor is not None:
                executor.shutdown(wait=True)
        self._checksummer = self._janitor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _discard(self, path: Path) -> None:
        """Rank 0: take ``path`` out of every listing at once (rename) and delete it in the background."""
        if not path.exists():
            return
        hidden = self.root / f"{_DISCARD_PREFIX}{path.name.lstrip('.')}-{os.getpid()}-{next(self._discarded)}"
        try:
            os.replace(path, hidden)
        except OSError as err:
            log.warning("could not move %s aside for deletion (%s); deleting it in place", path, err)
            hidden = path
        if self._janitor is None:
            self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nemofp4-checkpoint-delete")
        self._janitor.submit(shutil.rmtree, hidden, ignore_errors=True)

    def _staging(self) -> DefaultStager:
        """Host buffers for async saves, allocated at the first save and reused (DCP caches one per
        source storage); pinned, and filled with non-blocking copies, on CUDA."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
                )
            )
        return self._stager

    @property
    def pending(self) -> bool:
        """An async save is in flight (written, or being written, but not yet published)."""
        return self._pending is not None

    # ----------------------------------------------------------------------------- finding
    def complete_checkpoints(self) -> list[Path]:
        """Complete step folders, oldest first in save order."""
        return complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def owns(self, folder: Path) -> bool:
        """Whether `folder` is one of this run's step folders (directly in its checkpoints folder)."""
        folder = Path(folder)
        return is_step_name(folder.name) and folder.parent.resolve() == self.root.resolve()

    def incomplete(self) -> list[Path]:
        """What interrupted saves and deletions left (never loaded), and step folders without a valid
        marker; folders set aside (`.damaged`, `.incomplete`, `abandoned/`) are not listed."""
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for p in self.root.iterdir()
            if p.is_dir()
            and (
                p.name.startswith((TMP_PREFIX, _OLD_PREFIX, _DISCARD_PREFIX))
                or (is_step_name(p.name) and _marker_problem(p) is not None)
            )
        )

    def recover(self) -> list[Path]:
        """Put the checkpoints folder in order at start (rank 0 acts, under the run lock; collective): a
        same-step re-save a kill interrupted is completed from whichever complete copy exists, a set-aside
        of abandoned checkpoints a kill interrupted is finished, step folders without a valid marker are
        set aside (logged, never deleted), and what interrupted saves and deletions left is deleted (moved
        aside at once, deleted in the background). Returns those leftovers (rank 0)."""
        removed: list[Path] = []

        def act() -> None:
            if not self.root.is_dir():
                return
            self._repair_resaves()
            self._finish_abandoning()
            self._set_aside_unmarked()
            removed.extend(self._remove_leftovers())

        _on_rank_0(act, f"putting {self.root} in order at start")
        return removed

    def _repair_resaves(self) -> None:
        """A same-step re-save renames `step-N` to `.old-step-N`, then `.tmp-step-N` (complete, its
        marker written first) to `step-N`. A kill between the two leaves no `step-N`: put back the new
        copy if its marker is valid, else the old one (which the marker check after this sets aside if
        its own marker is not)."""
        for old in sorted(self.root.glob(f"{_OLD_PREFIX}*")):
            suffix = old.name[len(_OLD_PREFIX) :]
            final, new = self.root / f"{STEP_PREFIX}{suffix}", self.root / f"{TMP_PREFIX}{suffix}"
            if not old.is_dir() or not is_step_name(final.name) or final.exists():
                continue  # the replacement is in place: the old copy is a leftover
            source = new if new.is_dir() and _marker_problem(new) is None else old
            os.replace(source, final)
            _fsync_dir(self.root)
            log.warning(
                "a kill interrupted the re-save of %s between its two renames: restored it from %s (the %s copy)",
                final.name,
                source.name,
                "new" if source is new else "previous",
            )

    def _set_aside_unmarked(self) -> None:
        """Move each `step-N` folder without a valid marker to `step-N.incomplete`, saying so: it is never
        loaded, counted by retention, replaced by a save of step N, or deleted."""
        for folder in sorted(self.root.iterdir()):
            if not folder.is_dir() or not is_step_name(folder.name):
                continue
            problem = _marker_problem(folder)
            if problem is not None:
                aside = self._move_aside(folder, _INCOMPLETE)
                log.warning(
                    "checkpoint %s has %s: moved it aside to %s; it is never loaded, and nothing was "
                    "deleted (look at it, then remove it)",
                    folder,
                    problem,
                    aside.name,
                )

    def _remove_leftovers(self) -> list[Path]:
        """Delete what interrupted saves and deletions left: `.tmp-step-*` (never published),
        `.old-step-*` whose replacement is in place, `.deleting-*`."""
        removed = []
        for path in sorted(
            p
            for p in self.root.iterdir()
            if p.is_dir() and p.name.startswith((TMP_PREFIX, _OLD_PREFIX, _DISCARD_PREFIX))
        ):
            if path.name.startswith(_DISCARD_PREFIX):
                if self._janitor is None:
                    self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nemofp4-checkpoint-delete")
                self._janitor.submit(shutil.rmtree, path, ignore_errors=True)
            else:
                self._discard(path)
            removed.append(path)
        if removed:
            log.info("removed %d unfinished checkpoint folder(s): %s", len(removed), ", ".join(p.name for p in removed))
        return removed

    def _move_aside(self, folder: Path, suffix: str) -> Path:
        """Rank 0: rename `folder` to `<name><suffix>` (or `-<k>` after it if taken), durably."""
        aside = _free_name(folder.with_name(f"{folder.name}{suffix}"))
        os.replace(folder, aside)
        _fsync_dir(folder.parent)
        return aside

    # ----------------------------------------------------------------------------- branches
    def abandon(self, resumed: Path, *, keep: Callable[[Path], None] | None = None) -> tuple[Path | None, list[str]]:
        """After a resume from `resumed`, set aside this run's complete checkpoints outside its history:
        those saved after it, or at a higher step (another branch). Then `resume=auto` after a kill
        continues the branch that resumed, and retention neither counts nor deletes them. They move into
        `abandoned/<UTC time>-from-<resumed name>/`, whose record is committed first (with what
        `keep(folder)` adds: the metrics rows), so a start after a kill finishes the move. Nothing is set
        aside for a checkpoint of another directory. Rank 0 acts, durably, before this returns
        (collective); returns the folder and the names set aside on rank 0, else (None, [])."""
        result: list = [None, []]

        def act() -> None:
            if not self.owns(resumed):
                return
            complete = [p for p in self.complete_checkpoints() if _marker_problem(p) is None]
            names = [p.name for p in complete]
            if resumed.name not in names:
                return
            i, step = names.index(resumed.name), step_of(resumed)
            others = sorted((p for j, p in enumerate(complete) if j > i or step_of(p) > step), key=step_of)
            if others:
                result[:] = self._set_aside_branch(resumed, others, keep)

        _on_rank_0(act, f"setting aside the checkpoints newer than {resumed}")
        return result[0], result[1]

    def _set_aside_branch(
        self, resumed: Path, others: list[Path], keep: Callable[[Path], None] | None
    ) -> tuple[Path, list[str]]:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        aside = _free_name(self.root / ABANDONED / f"{stamp}-from-{resumed.name}")
        staging = aside.with_name(f"{_STAGING_PREFIX}{aside.name}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        if keep is not None:
            keep(staging)
        record = {
            "resumed_from": resumed.name,
            "time": time.time(),
            "checkpoints": {p.name: _marker_digest(p) for p in others},
        }
        _atomic_write_text(staging / _ABANDON_RECORD, json.dumps(record, indent=1, sort_keys=True))
        _fsync_dir(staging)
        os.replace(staging, aside)  # the commit: from here on a start finishes the move
        _fsync_dir(aside.parent)
        _fsync_dir(self.root)
        for folder in others:
            os.replace(folder, aside / folder.name)
        _fsync_dir(aside)
        _fsync_dir(self.root)
        _atomic_write_text(self.root / LATEST, resumed.name + "\n")
        return aside, [p.name for p in others]

    def _finish_abandoning(self) -> None:
        """Finish a set-aside of abandoned checkpoints a kill interrupted (its record is committed: move
        the folders it names that are still here with the same marker); drop an uncommitted one (it
        holds copies only)."""
        base = self.root / ABANDONED
        if not base.is_dir():
            return
        for staging in base.glob(f"{_STAGING_PREFIX}*"):
            shutil.rmtree(staging, ignore_errors=True)
        for record in sorted(base.glob(f"*/{_ABANDON_RECORD}")):
            try:
                entries = json.loads(record.read_text())["checkpoints"]
                entries = {str(name): str(digest) for name, digest in entries.items()}
            except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as err:
                log.warning("%s is unreadable (%s); not finishing what it records", record, err)
                continue
            moved = []
            for name, digest in sorted(entries.items()):
                source, target = self.root / name, record.parent / name
                if (
                    is_step_name(name)
                    and not target.exists()
                    and is_complete(source)
                    and _marker_problem(source) is None
                    and _marker_digest(source) == digest
                ):
                    os.replace(source, target)
                    moved.append(name)
            if moved:
                _fsync_dir(record.parent)
                _fsync_dir(self.root)
                log.warning(
                    "finished setting aside %s into %s (a kill had interrupted it)", ", ".join(moved), record.parent
                )
                newest = self.complete_checkpoints()
                if newest:
                    _atomic_write_text(self.root / LATEST, newest[-1].name + "\n")

    # ----------------------------------------------------------------------------- saving
    def save(
        self,
        step: int,
        *,
        dcp_state: dict[str, Any] | None,
        trainer_state: dict[str, Any],
        rank_state: dict[str, Any],
        write_collective: Callable[[Path], None] | None = None,
        extra_files: Callable[[Path], None] | None = None,
        hold_background_s: float = 0.0,
    ) -> Path:
        """Write checkpoint `step`; returns the final folder, complete when this returns, or with
        async_save once `poll()` (at a later step boundary) or `wait()` publishes it.

        `dcp_state` goes through DCP; `write_collective(folder)` is called on every rank for state
        with its own format (DeepSpeed); `extra_files(folder)` on rank 0 only. Rank and trainer state
        are written here, before this returns, into the same folder as the DCP files (one atomic
        unit); an async save stages `dcp_state` to CPU memory before returning, so training may
        change the tensors at once. `hold_background_s` stalls the background write (fault
        injection). A previous async save is published first: one save is in flight at most. A full
        disk raises one CheckpointError naming ENOSPC and the folder; the previous checkpoint is left
        as it was."""
        self.wait()
        final = self.root / f"{STEP_PREFIX}{step}"
        tmp = self.root / f"{TMP_PREFIX}{step}"
        rank = _rank()
        try:
            if rank == 0:
                self._discard(tmp)  # a leftover of an earlier failure
                (tmp / "rank").mkdir(parents=True)
            _barrier()
            _save_durable(rank_state, tmp / "rank" / f"rank-{rank:05d}.pt")
            if rank == 0:
                _save_durable(trainer_state, tmp / TRAINER_STATE)
                if extra_files is not None:
                    extra_files(tmp)
            if write_collective is not None:
                write_collective(tmp)
            if dcp_state is not None and self.cfg.async_save:
                writer = _RecordingWriter(tmp, hold_s=hold_background_s)
                if self._save_group is None:  # one process: DCP warns from the save's thread, out of a context's reach
                    warnings.filterwarnings(
                        "ignore",
                        message="torch.distributed is disabled",
                        category=UserWarning,
                        module=r"torch\.distributed\.checkpoint",
                    )
                with _single_process_quiet():
                    written = dcp.async_save(
                        dcp_state,
                        storage_writer=writer,
                        process_group=self._save_group,
                        async_stager=self._staging(),
                        no_dist=self._save_group is None,
                    )
                if self._checksummer is None:
                    self._checksummer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nemofp4-checkpoint-crc")
                future = self._checksummer.submit(self._entries_after, written, tmp, writer)
                self._pending = _PendingSave(step=step, future=future, tmp=tmp, final=final)
                return final
            writer = _RecordingWriter(tmp)
            if dcp_state is not None:
                with _single_process_quiet():
                    dcp.save(dcp_state, storage_writer=writer)
            if write_collective is not None:
                _barrier()  # every rank's DeepSpeed files are complete before rank 0 lists and checksums them
            self._finalize(step, tmp, final, self._entries(tmp, writer.written))
        except (Exception, CheckpointException) as err:
            raise self._write_failed(tmp, err) from err
        return final

    def _entries(self, tmp: Path, written: list[str]) -> dict[str, dict]:
        return _file_entries(tmp, _rank(), _world(), written, self.cfg.verify_checksums)

    def _entries_after(self, written: Future, tmp: Path, writer: _RecordingWriter) -> dict[str, dict]:
        """In the background: once DCP's write is done (its error, if any, is this future's), this rank's
        part of the marker's file table."""
        written.result()
        return self._entries(tmp, writer.written)

    def _write_failed(self, tmp: Path, err: BaseException) -> CheckpointError:
        written = _folder_bytes(tmp) if _is_disk_full(err) else 0
        if _rank() == 0:
            self._discard(tmp)
        previous = self.latest()
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        if _is_disk_full(err):
            return CheckpointError(
                f"checkpoint {tmp.name} could not be written: no space left on device (ENOSPC) "
                f"under {self.root}; {kept}. {self._space_needed(previous, written)}"
            )
        return CheckpointError(f"checkpoint {tmp.name} could not be written under {self.root}: {err}; {kept}")

    def _space_needed(self, previous: Path | None, written: int) -> str:
        """What a full disk needs: room for one more checkpoint (its size from the previous one's marker,
        else at least what was written before the disk filled), and what the kept ones take."""
        complete = self.complete_checkpoints()
        size = _checkpoint_bytes(previous) if previous is not None else 0
        need = (
            f"a checkpoint of this run takes {_format_bytes(size)}"
            if size
            else f"a checkpoint of this run takes more than the {_format_bytes(written)} written before the disk filled"
        )
        text = f"Free space for one more checkpoint: {need}"
        if complete:
            held = sum(_checkpoint_bytes(p) for p in complete)
            text += (
                f" (the {len(complete)} kept take {_format_bytes(held)}; checkpoint.keep_last_k="
                f"{self.cfg.keep_last_k} prunes only after a save, so a lower value makes room for later "
                "saves, not for this one)"
            )
        return text

    def poll(self) -> Path | None:
        """At a step boundary, on every rank: publish the async save in flight if every rank's write
        has finished (marker, rename, `latest`, retention), and return its folder; else None. Costs
        one small all-reduce on the training group per call while a save is in flight, none otherwise."""
        if self._pending is None:
            return None
        (busy,) = _any_rank(not self._pending.future.done())
        return None if busy else self._publish()

    def wait(self) -> Path | None:
        """Block until the async save in flight (if any) is written, then publish it; its folder or None."""
        if self._pending is None:
            return None
        self._pending.future.exception()  # blocks until done; never raises the save's error
        return self._publish()

    def _publish(self) -> Path:
        """Every rank's write has finished: finalize, or raise one CheckpointError on every rank if any
        rank's write failed (the folder is removed; the previous checkpoint stays the newest)."""
        pending, self._pending = self._pending, None
        error = pending.future.exception()
        (failed,) = _any_rank(error is not None)
        if failed:
            reasons: list[str | None] = [None] * _world()
            mine = None if error is None else _first_line(error)
            if _world() > 1:
                dist.all_gather_object(reasons, mine)
            else:
                reasons = [mine]
            summary = "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons) if why)
            cause = CheckpointError(f"the background write of step {pending.step} failed: {summary}")
            raise self._write_failed(pending.tmp, cause) from (error or cause)
        try:
            self._finalize(pending.step, pending.tmp, pending.final, pending.future.result())
        except (Exception, CheckpointException) as err:
            raise self._write_failed(pending.tmp, err) from err
        return pending.final

    def _finalize(self, step: int, tmp: Path, final: Path, files: dict[str, dict]) -> None:
        """Every rank's files are written and described (``files``: this rank's part of the table):
        gather the table, rank 0 writes the marker and publishes, and retention discards the oldest."""
        rank, world = _rank(), _world()
        if world > 1:
            gathered: list[dict] = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(gathered, files)
            files = {k: v for part in gathered for k, v in part.items()}
        if rank == 0:
            previous = self.complete_checkpoints()
            save_index = 1 + max((_marker_int(p, "save_index") for p in previous), default=0)
            marker = {"step": step, "save_index": save_index, "world_size": world, "time": time.time(), "files": files}
            _atomic_write_text(tmp / MARKER, json.dumps(marker, indent=1, sort_keys=True))
            _fsync_dir(tmp)
            old = None
            problem = _marker_problem(final) if final.exists() else None
            if problem is not None:  # not a checkpoint of ours: set aside, never replaced or deleted
                aside = self._move_aside(final, _INCOMPLETE)
                log.warning(
                    "checkpoint %s has %s: moved it aside to %s before saving step %d there (nothing was deleted)",
                    final,
                    problem,
                    aside.name,
                    step,
                )
            elif final.exists():  # the same step saved again: keep the old folder until the new one is in place
                old = self.root / f"{_OLD_PREFIX}{step}"
                self._discard(old)  # a leftover of an earlier failure: moved aside, deleted in the background
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _atomic_write_text(self.root / LATEST, final.name + "\n")
            if old is not None:
                self._discard(old)
            self._prune(final)
            log.info("checkpoint saved: %s", final)
        _barrier()

    def _prune(self, newest: Path) -> None:
        """Keep the newest keep_last_k checkpoints by save order; the one just written always stays.
        The others leave every listing now and are deleted in the background."""
        if self.cfg.keep_last_k == 0:
            return
        complete = [p for p in self.complete_checkpoints() if p != newest and _marker_problem(p) is None] + [newest]
        for old in complete[: -self.cfg.keep_last_k]:
            self._discard(old)

    # ----------------------------------------------------------------------------- loading
    def verify(self, folder: Path) -> None:
        """Raise CheckpointError naming the problem if `folder` is not a complete, intact checkpoint."""
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {folder} does not exist")
        if not is_complete(folder):
            raise CheckpointError(f"checkpoint {folder} is incomplete (no {MARKER}); it was never finished")
        marker = read_marker(folder)
        rank, world = _rank(), _world()
        names = [name for i, name in enumerate(sorted(marker["files"])) if i % world == rank]
        problems = verify_files(folder, names, marker, checksums=self.cfg.verify_checksums)
        if world > 1:
            gathered: list[list[str]] = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(gathered, problems)
            problems = [p for part in gathered for p in part]
        if problems:
            raise CheckpointError(f"checkpoint {folder} is damaged: " + "; ".join(problems))

    def load(
        self,
        folder: Path,
        *,
        dcp_state: dict[str, Any] | None,
        read_collective: Callable[[Path], None] | None = None,
        check: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any], bool]:
        """Verify `folder` and load DCP state in place (resharding as needed): :meth:`read_saved`, then
        `check(trainer_state)` (its errors propagate as they are), then :meth:`read_tensors`. Returns
        (trainer_state, rank_state, own)."""
        trainer_state, rank_state, own = self.read_saved(folder)
        if check is not None:
            check(trainer_state)
        self.read_tensors(folder, dcp_state, read_collective=read_collective)
        return trainer_state, rank_state, own

    def read_saved(self, folder: Path) -> tuple[dict[str, Any], dict[str, Any], bool]:
        """Verify `folder` and read its small files, before any DCP tensor: (trainer_state, rank_state,
        own), this rank's saved rank state, or rank 0's when the checkpoint was written by fewer ranks
        (own=False). Nothing is unpickled beyond tensors and plain values."""
        folder = Path(folder)
        self.verify(folder)
        try:
            trainer_state = load_tensors(folder / TRAINER_STATE)
            own_path = folder / "rank" / f"rank-{_rank():05d}.pt"
            own = own_path.is_file()
            rank_state = load_tensors(own_path if own else folder / "rank" / "rank-00000.pt")
            if not isinstance(trainer_state, dict) or not isinstance(rank_state, dict):
                raise CheckpointError(f"checkpoint {folder}: trainer or rank state is not a dict")
        except CheckpointError as err:
            raise CheckpointError(f"checkpoint {folder} could not be loaded: {err}") from err
        except (Exception, CheckpointException) as err:
            raise CheckpointError(f"checkpoint {folder} could not be loaded: {_first_line(err)}") from err
        return trainer_state, rank_state, own

    def read_tensors(
        self, folder: Path, dcp_state: dict[str, Any] | None, *, read_collective: Callable[[Path], None] | None = None
    ) -> None:
        """Load `folder`'s DCP state into `dcp_state` in place (resharding as needed; None: none), then
        `read_collective(folder)` on every rank; a failure of either is one CheckpointError."""
        folder = Path(folder)
        try:
            if dcp_state is not None:
                reader = SafeFileSystemReader(str(folder))
                reader.read_metadata()  # refuse a planted metadata pickle by name, before DCP wraps the error
                with _single_process_quiet():
                    dcp.load(dcp_state, storage_reader=reader, planner=SafeLoadPlanner())
            if read_collective is not None:
                read_collective(folder)
        except CheckpointError as err:
            raise CheckpointError(f"checkpoint {folder} could not be loaded: {err}") from err
        except (Exception, CheckpointException) as err:  # DCP raises several types for damaged data
            raise CheckpointError(f"checkpoint {folder} could not be loaded: {_first_line(err)}") from err

    def set_aside(self, folder: Path) -> Path | None:
        """Move a damaged checkpoint that `resume=auto` fell back from to `step-<N>.damaged` (rank 0; the
        name gains `-<k>` if taken): it is never tried again nor counted by keep_last_k, and nothing is
        deleted. Returns the new path on rank 0 (None on the others); collective."""
        folder, aside = Path(folder), None
        if _rank() == 0:
            aside = self._move_aside(folder, _DAMAGED)
        _barrier()
        return aside

    def candidates(self, resume: str) -> list[Path]:
        """Folders to try for a resume setting: 'none' -> [], 'auto' -> complete ones newest first (save
        order), anything else -> that path (a step folder, a checkpoints folder or a run directory)."""
        if resume == "none":
            return []
        if resume == "auto":
            return list(reversed(self.complete_checkpoints()))
        path = Path(resume)
        if not path.exists():
            raise FileNotFoundError(f"resume={resume!r}: no such checkpoint or run directory")
        if path.name.startswith(STEP_PREFIX):
            return [path]
        for root in (path, path / "checkpoints"):
            latest = latest_checkpoint(root)
            if latest is not None:
                return [latest]
        raise FileNotFoundError(
            f"resume={resume!r}: no complete checkpoint found (expected a step-<N> folder with {MARKER}, "
            "or a run directory / checkpoints folder containing one)"
        )


def _folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (0 if it is gone)."""
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0


def _checkpoint_bytes(folder: Path) -> int:
    """A complete checkpoint's size as its marker records it (every rank's files), else as found on disk."""
    try:
        return sum(int(entry["bytes"]) for entry in json.loads((folder / MARKER).read_text())["files"].values())
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError):
        return _folder_bytes(folder)


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _marker_int(folder: Path, key: str) -> int:
    try:
        return int(json.loads((folder / MARKER).read_text()).get(key, 0))
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError):
        return 0


def _first_line(err: BaseException) -> str:
    """One line for an error; for DCP's CheckpointException, the first rank's underlying error."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(failures.items()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"rank {rank}: {_first_line(inner) if isinstance(inner, BaseException) else inner}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]
