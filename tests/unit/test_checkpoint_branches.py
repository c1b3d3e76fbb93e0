"""Checkpoint repairs at start: a same-step re-save killed at any of its renames leaves a complete step,
and a step folder without a valid marker is set aside, never replaced or deleted. Kills are simulated by
raising a BaseException at the chosen rename, which no clean-up of the save catches (as after a SIGKILL)."""

import logging
import os
from pathlib import Path

import pytest
import torch

from nemofp4.training.checkpoint import (
    MARKER,
    CheckpointConfig,
    CheckpointManager,
    latest_checkpoint,
)


class Killed(BaseException):
    """The process dies here: nothing after it runs."""


def _save(mgr, step, value):
    state = {"model": {"w": torch.full((64,), float(value))}}
    return mgr.save(step, dcp_state=state, trainer_state={"step": step}, rank_state={"seed": step})


def _value(mgr, folder) -> float:
    state = {"model": {"w": torch.zeros(64)}}
    mgr.load(folder, dcp_state=state)
    return state["model"]["w"][0].item()


def _restart(root: Path, **cfg) -> CheckpointManager:
    """A fresh start on the folder: the manager the trainer builds, and its recovery."""
    mgr = CheckpointManager(root, CheckpointConfig(keep_last_k=0, **cfg))
    mgr.recover()
    return mgr


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def _kill_at_rename(monkeypatch, match):
    """Make the first ``os.replace(src, dst)`` for which ``match(src, dst)`` holds kill the process."""
    real = os.replace

    def replace(src, dst):
        if match(Path(src), Path(dst)):
            raise Killed(f"killed at rename {src} -> {dst}")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


# ------------------------------------------------------------------------------ same-step re-save
RESAVE_KILLS = {
    # the new copy is complete (its marker written), nothing renamed: the previous copy stays step-5
    "before_first_rename": (lambda src, dst: dst.name == ".old-step-5", 1.0),
    # step-5 renamed to .old-step-5, the new copy not yet in place: no step-5 on disk
    "between_renames": (lambda src, dst: src.name == ".tmp-step-5", 2.0),
    # the new copy in place, latest not yet rewritten and the old copy not yet discarded
    "after_second_rename": (lambda src, dst: dst.name == "latest", 2.0),
}


@pytest.mark.parametrize("when", list(RESAVE_KILLS))
def test_a_kill_at_any_rename_of_a_same_step_resave_leaves_a_complete_step(tmp_path, monkeypatch, when):
    match, expected = RESAVE_KILLS[when]
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=0))
    _save(mgr, 5, 1.0)
    with monkeypatch.context() as patch:
        _kill_at_rename(patch, match)
        with pytest.raises(Killed):
            _save(mgr, 5, 2.0)
    restarted = _restart(tmp_path)
    restarted.close()
    assert _names(tmp_path) == ["step-5"], "a leftover or a missing step-5"
    assert latest_checkpoint(tmp_path) == tmp_path / "step-5"
    assert _value(restarted, tmp_path / "step-5") == expected


def test_an_old_copy_alone_is_put_back_when_the_new_one_has_no_marker(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=0))
    _save(mgr, 5, 1.0)
    os.replace(tmp_path / "step-5", tmp_path / ".old-step-5")
    (tmp_path / ".tmp-step-5" / "rank").mkdir(parents=True)  # a new copy without marker: never complete
    restarted = _restart(tmp_path)
    restarted.close()
    assert _names(tmp_path) == ["step-5"]
    assert _value(restarted, tmp_path / "step-5") == 1.0


# ------------------------------------------------------------------------------ folders without a valid marker
@pytest.mark.parametrize("damage", ["missing", "unreadable", "no_files_table"])
def test_a_step_folder_without_a_valid_marker_is_set_aside_and_logged_never_replaced(tmp_path, caplog, damage):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=0))
    _save(mgr, 1, 1.0)
    folder = _save(mgr, 2, 2.0)
    if damage == "missing":
        (folder / MARKER).unlink()
    else:
        (folder / MARKER).write_bytes(b"\x80\x04garbage" if damage == "unreadable" else b'{"step": 2}')
    shard = next(folder.glob("*.distcp")).name
    with caplog.at_level(logging.WARNING, logger="nemofp4.training.checkpoint"):
        restarted = _restart(tmp_path)
    assert f"checkpoint {folder} has " in caplog.text and "moved it aside to step-2.incomplete" in caplog.text
    assert (tmp_path / "step-2.incomplete" / shard).is_file() and not folder.exists()
    assert restarted.incomplete() == [] and [p.name for p in restarted.candidates("auto")] == ["step-1"]
    # the run saves step 2 again, then more: nothing replaces or prunes the folder set aside
    restarted.cfg.keep_last_k = 1
    for step in (2, 3, 4):
        _save(restarted, step, step)
    restarted.close()
    assert _names(tmp_path) == ["step-2.incomplete", "step-4"]
    assert (tmp_path / "step-2.incomplete" / shard).is_file()


def test_a_step_folder_without_marker_met_by_a_save_is_set_aside_not_replaced(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=0))
    (tmp_path / "step-3").mkdir(parents=True)
    (tmp_path / "step-3" / "notes.txt").write_text("copied by hand")  # appeared while the run trained
    _save(mgr, 3, 3.0)
    mgr.close()
    assert _names(tmp_path) == ["step-3", "step-3.incomplete"]
    assert (tmp_path / "step-3.incomplete" / "notes.txt").read_text() == "copied by hand"


def test_retention_never_prunes_a_folder_whose_marker_became_unreadable(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=1))
    first = _save(mgr, 1, 1.0)
    (first / MARKER).write_bytes(b"\xff\xfe")
    _save(mgr, 2, 2.0)
    _save(mgr, 3, 3.0)
    mgr.close()
    assert _names(tmp_path) == ["step-1", "step-3"]  # step-1 is left for the start's check to set aside
