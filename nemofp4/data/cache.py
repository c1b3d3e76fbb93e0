"""On-disk cache of index arrays, keyed by a hash of what they describe.

``<cache_dir>/<kind>-<hash>/`` holds one ``.npy`` per array and ``description.json``. A build
writes into a private temporary folder that is renamed into place when complete, so a reader
never sees a partial cache. Under ``torch.distributed`` rank 0 builds while the others wait on
a barrier and then load (memory-mapped); a rank that still finds nothing (a cache folder that
is not shared between nodes) builds the same bytes itself. Whatever is expensive to work out
before the cache key is known (checksums, document splits, token counts) rank 0 computes once
and broadcasts (:func:`rank_zero_value`); every rank checks that its own description of a cache
equals rank 0's, so ranks that see different data fail instead of mixing two sample orders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

log = logging.getLogger(__name__)
T = TypeVar("T")


def _process_group():
    """torch.distributed when a group of more than one process is initialized, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def is_rank_zero() -> bool:
    dist = _process_group()
    return dist is None or dist.get_rank() == 0


def rank_zero_value(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, broadcast to the other ranks, which never call it (outside a
    process group: just ``compute()``). A failure on rank 0 is raised on every rank."""
    dist = _process_group()
    if dist is None:
        return compute()
    box: list = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", compute())
        except Exception as exc:  # tell the others, then raise here
            error, box[0] = exc, ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    status, value = box[0]
    if status == "error":
        raise RuntimeError(f"rank 0 failed while preparing the data: {value}")
    return value


def check_same_as_rank_zero(value, *, what: str) -> None:
    """Raise on any rank whose ``value`` (a small JSON-like description) differs from rank 0's."""
    dist = _process_group()
    if dist is None:
        return
    reference = rank_zero_value(lambda: value)
    agree: list = [None] * dist.get_world_size()
    dist.all_gather_object(agree, reference == value)  # every rank raises together: none is left waiting
    if not all(agree):
        differing = [rank for rank, same in enumerate(agree) if not same]
        detail = (
            f"this rank's {json.dumps(value, sort_keys=True)[:400]} vs rank 0's "
            f"{json.dumps(reference, sort_keys=True)[:400]}"
            if reference != value
            else ""
        )
        raise ValueError(
            f"rank(s) {differing} see different data than rank 0 for {what}{': ' + detail if detail else ''}; "
            "every rank must read the same data files (a shared file system, or identical copies)"
        )


def description_hash(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:20]


def _load(folder: Path, names: list[str]) -> dict[str, np.ndarray]:
    return {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in names}


def _build(folder: Path, description: dict, build: Callable[[], dict[str, np.ndarray]]) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    start = time.perf_counter()
    arrays = build()
    for name, array in arrays.items():
        np.save(tmp / f"{name}.npy", array)
    (tmp / "description.json").write_text(json.dumps(description, indent=2, sort_keys=True) + "\n")
    try:
        os.rename(tmp, folder)
    except OSError:  # another process finished the same build first: same bytes, keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built %s in %.1f s", folder, time.perf_counter() - start)


def cached_arrays(
    cache_dir: str | os.PathLike,
    kind: str,
    description: dict,
    names: list[str],
    build: Callable[[], dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], Path]:
    """Load the arrays ``names`` for ``description`` from the cache, building them if needed."""
    folder = Path(cache_dir) / f"{kind}-{description_hash(description)}"
    complete = folder / "description.json"

    dist = _process_group()
    if dist is not None:
        check_same_as_rank_zero(description, what=f"the {kind} cache")
        if dist.get_rank() == 0 and not complete.is_file():
            _build(folder, description, build)
        dist.barrier()
    if not complete.is_file():
        _build(folder, description, build)
    return _load(folder, names), folder
