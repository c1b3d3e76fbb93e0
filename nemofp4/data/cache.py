"""On-disk cache of index arrays, keyed by a hash of what they describe.

``<cache_dir>/<kind>-<hash>/`` holds one ``.npy`` per array and ``description.json``. A build
writes into a private temporary folder that is renamed into place when complete, so a reader
never sees a partial cache. Under ``torch.distributed`` rank 0 builds while the others wait on
a barrier and then load (memory-mapped); a rank that still finds nothing (a cache folder that
is not shared between nodes) builds the same bytes itself.
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

import numpy as np

log = logging.getLogger(__name__)


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

    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        if dist.get_rank() == 0 and not complete.is_file():
            _build(folder, description, build)
        dist.barrier()
    if not complete.is_file():
        _build(folder, description, build)
    return _load(folder, names), folder
