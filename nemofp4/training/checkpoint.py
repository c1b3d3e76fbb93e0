"""Atomic, verifiable checkpoints on top of torch.distributed.checkpoint (DCP).

Layout under `<run_dir>/checkpoints/`:

    step-<N>/                  one complete checkpoint
        .metadata, __<r>_0.distcp   DCP: model + optimizer, sharded as the run was (reshardable)
        trainer_state.pt       rank 0: step, tokens, loader, schedule, amax references, wandb id, config
        rank/rank-<r>.pt       per rank: generator states (Python, NumPy, torch, CUDA) and the
                               quantizers' held tensor references
        COMPLETE.json          written last: file sizes and CRC32s; its presence makes the folder valid
    latest                     text file naming the newest complete step folder

Every rank writes into `.tmp-step-<N>/`; after a barrier rank 0 writes the marker and renames the
folder, so a crash at any point leaves either the previous checkpoint or the new one, never a
half-written folder that looks complete. Loading verifies sizes (and checksums unless disabled)
before any tensor is touched, so a damaged checkpoint is reported by name, and `resume=auto` falls
back to the previous complete one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"


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
    """Write in the background with DCP's async_save (needs torch.distributed initialized)."""
    verify_checksums: bool = True
    """Record CRC32 of every file and check it on load (sizes are always checked)."""
    export_safetensors: bool = False
    """Also write the model weights alone as model.safetensors in the final checkpoint."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval must be >= 0, got {self.interval}")
        if self.keep_last_k < 0:
            raise ValueError(f"checkpoint.keep_last_k must be >= 0, got {self.keep_last_k}")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged."""


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


def _crc32(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


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


def step_of(path: Path) -> int:
    return int(path.name[len(STEP_PREFIX):])


def is_complete(path: Path) -> bool:
    return path.is_dir() and path.name.startswith(STEP_PREFIX) and (path / MARKER).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete step folders under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=step_of)


def latest_checkpoint(root: Path) -> Path | None:
    """The folder named by `root/latest` if complete, else the newest complete folder."""
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if is_complete(candidate):
            return candidate
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def _files_owned_by(folder: Path, rank: int, world: int) -> list[Path]:
    """Files this rank describes in the marker: its own DCP shard and RNG file; rank 0 the rest."""
    owned = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.name
        if name.startswith("__") and name.endswith(".distcp"):
            owner = int(name[2:].split("_")[0]) % world
        elif path.parent.name == "rank" and name.startswith("rank-"):
            owner = int(name[5:-3]) % world
        else:
            owner = 0
        if owner == rank:
            owned.append(path)
    return owned


class CheckpointManager:
    """Saves and finds checkpoints of one run; every rank constructs one."""

    def __init__(self, root: Path, cfg: CheckpointConfig):
        self.root = Path(root)
        self.cfg = cfg
        self._pending: tuple[Any, Callable[[], None]] | None = None
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        _barrier()

    # ----------------------------------------------------------------------------- finding
    def complete_checkpoints(self) -> list[Path]:
        """Complete step folders, oldest first."""
        return complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def incomplete(self) -> list[Path]:
        """Folders left by interrupted saves (never loaded)."""
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for p in self.root.iterdir()
            if p.is_dir() and (p.name.startswith(TMP_PREFIX) or (p.name.startswith(STEP_PREFIX) and not is_complete(p)))
        )

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
    ) -> Path:
        """Write checkpoint `step`; returns the final folder (complete once this returns, or, with
        async_save, once `wait()` or the next save returns).

        `dcp_state` goes through DCP; `write_collective(folder)` is called on every rank for state
        with its own format (DeepSpeed); `extra_files(folder)` on rank 0 only."""
        self.wait()
        final = self.root / f"{STEP_PREFIX}{step}"
        tmp = self.root / f"{TMP_PREFIX}{step}"
        rank, world = _rank(), _world()
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            if final.exists():  # a complete checkpoint of this step already exists: replace it
                shutil.rmtree(final)
            (tmp / "rank").mkdir(parents=True)
        _barrier()
        torch.save(rank_state, tmp / "rank" / f"rank-{rank:05d}.pt")
        if rank == 0:
            torch.save(trainer_state, tmp / TRAINER_STATE)
            if extra_files is not None:
                extra_files(tmp)

        def finalize() -> None:
            self._finalize(step, tmp, final)

        if write_collective is not None:
            write_collective(tmp)
        if dcp_state is not None and self.cfg.async_save and world > 1:
            future = dcp.async_save(dcp_state, checkpoint_id=str(tmp))
            self._pending = (future, finalize)
            return final
        if dcp_state is not None:
            with _single_process_quiet():
                dcp.save(dcp_state, checkpoint_id=str(tmp))
        finalize()
        return final

    def wait(self) -> None:
        """Block until a pending async save is complete and published."""
        if self._pending is None:
            return
        future, finalize = self._pending
        self._pending = None
        future.result()
        finalize()

    def _finalize(self, step: int, tmp: Path, final: Path) -> None:
        rank, world = _rank(), _world()
        _barrier()
        files = {}
        for path in _files_owned_by(tmp, rank, world):
            entry = {"bytes": path.stat().st_size}
            if self.cfg.verify_checksums:
                entry["crc32"] = _crc32(path)
            files[str(path.relative_to(tmp))] = entry
        if world > 1:
            gathered: list[dict] = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(gathered, files)
            files = {k: v for part in gathered for k, v in part.items()}
        if rank == 0:
            marker = {"step": step, "world_size": world, "time": time.time(), "files": files}
            _atomic_write_text(tmp / MARKER, json.dumps(marker, indent=1, sort_keys=True))
            _fsync_dir(tmp)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _atomic_write_text(self.root / LATEST, final.name + "\n")
            self._prune()
            log.info("checkpoint saved: %s", final)
        _barrier()

    def _prune(self) -> None:
        if self.cfg.keep_last_k == 0:
            return
        complete = self.complete_checkpoints()
        for old in complete[: -self.cfg.keep_last_k]:
            shutil.rmtree(old, ignore_errors=True)

    # ----------------------------------------------------------------------------- loading
    def verify(self, folder: Path) -> None:
        """Raise CheckpointError naming the problem if `folder` is not a complete, intact checkpoint."""
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {folder} does not exist")
        if not is_complete(folder):
            raise CheckpointError(f"checkpoint {folder} is incomplete (no {MARKER}); it was never finished")
        try:
            marker = json.loads((folder / MARKER).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"checkpoint {folder}: unreadable {MARKER}: {err}") from err
        rank, world = _rank(), _world()
        problems = []
        for i, (name, entry) in enumerate(sorted(marker["files"].items())):
            if i % world != rank:
                continue
            path = folder / name
            if not path.is_file():
                problems.append(f"{name} is missing")
                continue
            size = path.stat().st_size
            if size != entry["bytes"]:
                problems.append(f"{name} has {size} bytes, expected {entry['bytes']}")
            elif "crc32" in entry and self.cfg.verify_checksums and _crc32(path) != entry["crc32"]:
                problems.append(f"{name} fails its CRC32 check")
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
    ) -> tuple[dict[str, Any], dict[str, Any], bool]:
        """Verify `folder` and load DCP state in place (resharding as needed). Returns (trainer_state,
        rank_state, own): this rank's saved rank state, or rank 0's when the checkpoint was written by
        fewer ranks (own=False)."""
        folder = Path(folder)
        self.verify(folder)
        try:
            if dcp_state is not None:
                with _single_process_quiet():
                    dcp.load(dcp_state, checkpoint_id=str(folder))
            if read_collective is not None:
                read_collective(folder)
            trainer_state = torch.load(folder / TRAINER_STATE, weights_only=False)
        except Exception as err:  # DCP raises several types for damaged data
            raise CheckpointError(f"checkpoint {folder} could not be loaded: {err}") from err
        own_path = folder / "rank" / f"rank-{_rank():05d}.pt"
        own = own_path.is_file()
        rank_state = torch.load(own_path if own else folder / "rank" / "rank-00000.pt", weights_only=False)
        return trainer_state, rank_state, own

    def candidates(self, resume: str) -> list[Path]:
        """Folders to try for a resume setting: 'none' -> [], 'auto' -> newest complete first,
        anything else -> that path (a step folder, a checkpoints folder or a run directory)."""
        if resume == "none":
            return []
        if resume == "auto":
            complete = self.complete_checkpoints()
            latest = self.latest()
            ordered = ([latest] if latest else []) + [p for p in reversed(complete) if p != latest]
            return ordered
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
