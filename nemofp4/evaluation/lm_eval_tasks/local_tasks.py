"""Datasets of the shipped local lm-eval tasks, read from the repository's data/tasks/ (offline)."""

from __future__ import annotations

import json

from nemofp4.data.paths import REPO_ROOT

TASKS_DIR = REPO_ROOT / "data" / "tasks"


def _jsonl_split(name: str) -> dict:
    import datasets

    path = TASKS_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the local tasks ship with the nemofp4 repository (data/tasks/)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list([{k: r[k] for k in ("context", "choices", "label")} for r in rows])}


def austen_cloze(**kwargs) -> dict:
    """data/tasks/austen_cloze.jsonl as a {"test": Dataset} mapping (extra metadata kwargs are ignored)."""
    return _jsonl_split("austen_cloze")
