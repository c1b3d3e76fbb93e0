"""Reading checkpoints of ours, safely: the folder layout, finding the newest complete one, verifying
files against the marker, and loading without running code from the files.

It sits below both `training` (which writes checkpoints) and `evaluation` (which reads them), so
neither imports the other. Layout under `<run_dir>/checkpoints/`:

    step-<N>/                  one complete checkpoint
        .metadata, __<r>_0.distcp   DCP: model + optimizer, sharded as the run was (reshardable); the
                               model state holds the FP4 linears' held references (extra state)
        trainer_state.pt       rank 0: step, tokens, loader, schedule, wandb id, config (plain types only)
        rank/rank-<r>.pt       per rank: generator states (and held references where ranks differ)
        COMPLETE.json          written last: save order, health, file sizes and CRC32s
    latest                     text file naming the newest complete step folder (a hint only)
    step-<N>.damaged           set aside: a damaged checkpoint `resume=auto` fell back from
    step-<N>.incomplete        set aside: a step folder found at start without a valid marker
    abandoned/<tag>/           set aside: the checkpoints (and metrics rows) of a branch a resume from
                               an older checkpoint left, with ABANDONED.json naming them

Only `step-<N>` folders directly in `checkpoints/` are ever loaded by `resume=auto` or counted by
retention; a set-aside `abandoned/<tag>/step-<N>` is still a complete checkpoint that `resume=<path>`,
evaluation and `train.init_from` can name.

Safety: every `torch.load` here uses `weights_only=True`; DCP's `.metadata` (a pickle) is read by an
unpickler that only admits DCP's own metadata classes, and DCP's non-tensor entries are loaded with
`weights_only=True`, so a planted pickle fails with a named error instead of running.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import logging
import pathlib
import pickle
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element

__all__ = [
    "LATEST",
    "MARKER",
    "STEP_PREFIX",
    "TMP_PREFIX",
    "TRAINER_STATE",
    "CheckpointError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "complete_checkpoints",
    "crc32",
    "is_complete",
    "is_step_name",
    "latest_checkpoint",
    "load_tensors",
    "read_marker",
    "resolve_checkpoint",
    "step_of",
    "verify_files",
]

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
_STEP_NAME = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or unsafe to load."""


def crc32(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def step_of(path: Path) -> int:
    return int(Path(path).name[len(STEP_PREFIX) :])


def is_step_name(name: str) -> bool:
    """Whether `name` is a step folder's name (`step-<N>`), not a set-aside or temporary one."""
    return _STEP_NAME.fullmatch(name) is not None


def is_complete(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and _STEP_NAME.fullmatch(path.name) is not None and (path / MARKER).is_file()


def read_marker(folder: Path) -> dict[str, Any]:
    """The marker of a step folder; CheckpointError naming the folder if it is unreadable or malformed."""
    path = Path(folder) / MARKER
    try:
        marker = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {folder}: unreadable {MARKER}: {err}") from err
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"checkpoint {folder}: {MARKER} has no 'files' table; it was not written by nemofp4")
    return marker


def _save_order(folder: Path) -> tuple[int, float, int]:
    """Sort key: the marker's save index (newer saves higher), then its time, then the step."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        return int(marker.get("save_index", -1)), float(marker.get("time", 0.0)), step_of(folder)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError):
        return -2, 0.0, step_of(folder)  # unreadable markers rank oldest; loading them fails by name


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete step folders under `root`, oldest first in save order (not step order: a run that
    fell back to an older checkpoint saves lower steps later)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=_save_order)


def _pointer_target(root: Path) -> Path | None:
    """The folder `root/latest` names, if it names a step folder directly inside `root`."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        log.warning("%s is not a text file; ignoring it and taking the newest complete checkpoint", pointer)
        return None
    if _STEP_NAME.fullmatch(name) is None:
        log.warning("%s names %r, which is not a step-<N> folder of this directory; ignoring it", pointer, name[:80])
        return None
    return root / name


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint in save order; `latest` only breaks ties. The pointer can be stale
    (a kill between publishing a folder and rewriting it), so it never hides a newer complete folder."""
    complete = complete_checkpoints(root)
    if not complete:
        return None
    target = _pointer_target(Path(root))
    if target is not None and target != complete[-1] and is_complete(target):
        log.info(
            "%s names %s but %s is newer; taking the newer one", Path(root) / LATEST, target.name, complete[-1].name
        )
    return complete[-1]


def resolve_checkpoint(path: str | Path) -> Path:
    """The complete step folder meant by a step folder, a checkpoints folder or a run directory (its
    newest complete checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint={str(path)!r}: no such step folder or run directory")
    if path.name.startswith(STEP_PREFIX):
        if not is_complete(path):
            raise FileNotFoundError(f"checkpoint {path} is incomplete (no {MARKER}): it was never finished")
        return path
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise FileNotFoundError(
        f"checkpoint={str(path)!r}: no complete checkpoint found; pass a step-<N> folder (with {MARKER}), "
        "a checkpoints folder or a run directory that contains one"
    )


def verify_files(folder: Path, names: list[str], marker: dict[str, Any], *, checksums: bool) -> list[str]:
    """Problems with `names` (paths relative to `folder`) against the marker: missing, wrong size, bad CRC32."""
    problems = []
    root = Path(folder).resolve()
    for name in names:
        entry = marker["files"][name]
        path = (root / name).resolve()
        if root not in path.parents:
            problems.append(f"{name} lies outside the checkpoint folder")
            continue
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        try:
            expected = int(entry["bytes"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name} has no valid size in {MARKER}")
            continue
        size = path.stat().st_size
        if size != expected:
            problems.append(f"{name} has {size} bytes, expected {expected}")
        elif checksums and "crc32" in entry and crc32(path) != entry["crc32"]:
            problems.append(f"{name} fails its CRC32 check")
    return problems


def _numpy_array_globals() -> list[Any]:
    """What a pickled NumPy array needs (generator states of checkpoints written before those became
    tensors): array reconstruction and dtypes, nothing that calls arbitrary code."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [
        core.multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        *(getattr(np.dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType") if hasattr(np, "dtypes")),
    ]


def load_tensors(path: Path) -> Any:
    """`torch.load(weights_only=True)` on CPU: tensors, plain containers and NumPy arrays only; anything
    else fails by name."""
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain values; refusing to unpickle it "
            f"(weights_only=True): {str(err).splitlines()[0]}"
        ) from err


# --------------------------------------------------------------------------------------- DCP, safely
def _allowed_global(module: str, name: str) -> Any | None:
    """The few globals a DCP `.metadata` pickle refers to: DCP's own dataclasses and enums, torch.Size,
    dtypes and layouts, paths. Anything else (os.system, builtins.eval, ...) is refused."""
    import importlib

    if module.startswith("torch.distributed.checkpoint."):
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
        return None
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout
    if module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        return getattr(pathlib, name)
    if (module, name) == ("builtins", "getattr"):
        return _enum_member
    if (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    return None


def _enum_member(cls: Any, name: str) -> Any:
    """`getattr` as some Python 3.11 releases (3.11.2) pickle an enum member, `getattr(cls, name)`: only a
    member of an enum the metadata may hold, never another attribute."""
    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and cls.__module__.startswith("torch.distributed.checkpoint.")
        and isinstance(name, str)
        and name in cls.__members__
    ):
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not allowed in DCP metadata (only enum members)")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed_global(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")
        return obj


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, with `.metadata` read by an unpickler restricted to DCP's metadata types."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: not loadable as DCP metadata ({err})") from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor entries (optimizer hyper-parameters) unpickled by
    `torch.load(weights_only=True)` instead of a full unpickle."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"DCP entry {read_item.dest_index.fqn!r} holds objects other than plain values; refusing to "
                f"unpickle it: {str(err).splitlines()[0]}"
            ) from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
