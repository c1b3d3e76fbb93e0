"""Resolving user paths: relative to the working directory first, then to the repository root.

The shipped defaults (``data/...``) are relative paths; resolving them against the repository
root as well lets the main command run from any working directory (Hydra may change it).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str | os.PathLike) -> Path:
    candidate = Path(os.path.expanduser(os.fspath(path)))
    if candidate.is_absolute() or candidate.exists():
        return candidate
    in_repo = REPO_ROOT / candidate
    if in_repo.exists() or Path(f"{in_repo}.idx").exists() or Path(f"{in_repo}.manifest.json").exists():
        return in_repo
    return candidate


def resolve_prefix(prefix: str | os.PathLike) -> str:
    """A token-file prefix (no extension): resolved like :func:`resolve_path` via its files."""
    raw = os.path.expanduser(os.fspath(prefix))
    if os.path.isabs(raw):
        return raw
    for suffix in (".idx", ".manifest.json"):
        if Path(raw + suffix).exists():
            return raw
    for suffix in (".idx", ".manifest.json"):
        if (REPO_ROOT / (raw + suffix)).exists():
            return str(REPO_ROOT / raw)
    return raw
