"""Where the shipped files live, and resolving user paths against the working directory first.

The shipped files are ``configs/``, ``slurm/`` and ``data/`` (tokenizer, tokens, tasks). In a
checkout (editable install included) they sit at the repository root; an installed wheel
carries them as package data under ``nemofp4/share/`` (setup.py maps the folders there without
moving them). ``REPO_ROOT`` is whichever of the two holds them. The shipped defaults
(``data/...``) are relative paths; resolving them against that root as well lets every command
run from any working directory (Hydra may change it).
"""

from __future__ import annotations

import os
from pathlib import Path


def _shipped_root() -> Path:
    installed = Path(__file__).resolve().parents[1] / "share"
    return installed if (installed / "configs").is_dir() else Path(__file__).resolve().parents[2]


REPO_ROOT = _shipped_root()
"""The folder holding configs/, slurm/ and data/: the checkout, or the installed package's share/."""
CONFIG_DIR = REPO_ROOT / "configs"


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
