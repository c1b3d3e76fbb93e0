"""Checkpoint repairs at start and branches: a same-step re-save killed at any of its renames leaves a
complete step, a step folder without a valid marker is set aside, never replaced or deleted, and a
resume from an older checkpoint sets the newer ones aside (never deleted). Kills are simulated by
raising a BaseException at the chosen rename, which no clean-up of the save catches (as after a SIGKILL)."""

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from nemofp4.checkpointing import resolve_checkpoint
from nemofp4.training.checkpoint import (
    ABANDONED,
    MARKER,
    CheckpointConfig,
    CheckpointManager,
    latest_checkpoint,
)
from nemofp4.training.metrics import copy_rows_after, read_metrics, truncate_after


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


# ------------------------------------------------------------------------------ branches
def _run_3_6_9(root: Path) -> CheckpointManager:
    mgr = CheckpointManager(root, CheckpointConfig(keep_last_k=0))
    for step in (3, 6, 9):
        _save(mgr, step, step)
    return mgr


def test_a_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    root = tmp_path / "checkpoints"
    mgr = _run_3_6_9(root)
    assert mgr.abandon(root / "step-9") == (None, [])  # the newest: nothing saved later, nothing higher
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in range(1, 10)))
    aside, names = mgr.abandon(root / "step-3", keep=lambda into: copy_rows_after(metrics, 3, into / "metrics.jsonl"))
    assert names == ["step-6", "step-9"] and aside.parent == root / ABANDONED and aside.name.endswith("-from-step-3")
    assert [p.name for p in mgr.complete_checkpoints()] == ["step-3"]
    assert (root / "latest").read_text().strip() == "step-3"
    assert [p.name for p in mgr.candidates("auto")] == ["step-3"]  # what a requeued resume=auto takes
    # set aside, not deleted: still complete checkpoints that resume=<path>, evaluation and init_from can name
    assert resolve_checkpoint(aside / "step-9") == aside / "step-9" and _value(mgr, aside / "step-9") == 9.0
    assert [r["step"] for r in read_metrics(aside)] == [4, 5, 6, 7, 8, 9]
    record = json.loads((aside / "ABANDONED.json").read_text())
    assert record["resumed_from"] == "step-3" and sorted(record["checkpoints"]) == ["step-6", "step-9"]
    # the new branch saves and prunes; the set-aside folders are neither counted nor deleted
    mgr.cfg.keep_last_k = 2
    for step in (6, 9, 12):
        _save(mgr, step, 100 + step)
    mgr.close()
    assert _names(root) == [ABANDONED, "step-12", "step-9"]
    assert _names(aside) == ["step-6", "step-9"] and _value(mgr, aside / "step-6") == 6.0
    # a later start does not take the new branch's step-6 or step-9 for the abandoned ones
    restarted = _restart(root)
    assert _names(root) == [ABANDONED, "step-12", "step-9"] and _value(restarted, root / "step-9") == 109.0


def test_only_checkpoints_outside_the_resumed_ones_history_are_set_aside(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=0))
    for step in (10, 20, 11, 12):  # step-20 (an earlier branch) was saved before step-11, at a higher step
        _save(mgr, step, step)
    _, names = mgr.abandon(tmp_path / "step-11")
    assert names == ["step-12", "step-20"]  # saved after step-11, or at a higher step: another branch
    assert [p.name for p in mgr.complete_checkpoints()] == ["step-10", "step-11"]


def test_a_checkpoint_of_another_directory_sets_nothing_aside(tmp_path):
    mine = _run_3_6_9(tmp_path / "mine")
    other = _run_3_6_9(tmp_path / "other")
    assert mine.abandon(tmp_path / "other" / "step-3") == (None, [])
    assert [p.name for p in mine.complete_checkpoints()] == ["step-3", "step-6", "step-9"]
    assert [p.name for p in other.complete_checkpoints()] == ["step-3", "step-6", "step-9"]
    assert not mine.owns(tmp_path / "other" / "step-3") and mine.owns(tmp_path / "mine" / "step-3")


@pytest.mark.parametrize("when", ["before_the_record_commits", "after_the_first_move"])
def test_a_kill_while_setting_a_branch_aside_is_finished_or_undone_at_the_next_start(tmp_path, monkeypatch, when):
    root = tmp_path / "checkpoints"
    mgr = _run_3_6_9(root)
    if when == "before_the_record_commits":
        match = lambda src, dst: src.name.startswith(".tmp-") and dst.parent.name == ABANDONED  # noqa: E731
    else:
        match = lambda src, dst: src.name == "step-9" and dst.parent.parent.name == ABANDONED  # noqa: E731
    with monkeypatch.context() as patch:
        _kill_at_rename(patch, match)
        with pytest.raises(Killed):
            mgr.abandon(root / "step-3")
    restarted = _restart(root)
    live = [p.name for p in restarted.complete_checkpoints()]
    asides = list((root / ABANDONED).iterdir())
    if when == "before_the_record_commits":  # nothing was set aside: the run never continued from step 3
        assert live == ["step-3", "step-6", "step-9"] and asides == []
    else:  # committed: the start finishes the move, so resume=auto takes step-3
        assert live == ["step-3"] and len(asides) == 1 and _names(asides[0]) == ["step-6", "step-9"]
        assert (root / "latest").read_text().strip() == "step-3"


def test_copy_rows_after_keeps_the_abandoned_rows_and_truncate_leaves_the_live_branch(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "loss": float(s)} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "st')  # a line cut by a kill
    assert copy_rows_after(path, 3, tmp_path / "aside.jsonl") == 2
    assert [json.loads(line) for line in (tmp_path / "aside.jsonl").read_text().splitlines()] == rows[3:]
    truncate_after(path, 3)
    assert read_metrics(tmp_path) == rows[:3]
    assert copy_rows_after(path, 3, tmp_path / "none.jsonl") == 0 and not (tmp_path / "none.jsonl").exists()


# ------------------------------------------------------------------------------ the resume's choice
def _resume(mgr: CheckpointManager, resume: str, run_dir: Path) -> Path | None:
    from nemofp4.training.resume import load_resume_checkpoint

    class Nothing:  # the choice of checkpoint alone: no state to load
        def load(self, ckpt, folder, saved):
            pass

    return load_resume_checkpoint(mgr, resume, run_dir=run_dir, rank=0, state=Nothing(), refuse=lambda *_: None)


def test_a_rollback_is_logged_and_the_metrics_follow_the_branch_that_resumed(tmp_path, caplog):
    mgr = _run_3_6_9(tmp_path / "checkpoints")
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in range(1, 11))
    )
    with caplog.at_level(logging.WARNING, logger="nemofp4"):
        assert _resume(mgr, str(tmp_path / "checkpoints" / "step-3"), tmp_path).name == "step-3"
    (aside,) = (tmp_path / "checkpoints" / ABANDONED).iterdir()
    assert (
        f"resumed from step-3, older than this run's newest checkpoints: set aside step-6, step-9 and 7 metrics "
        f"rows past step 3 in {aside}, so resume=auto continues from step-3 (nothing was deleted)"
    ) in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(aside)] == [4, 5, 6, 7, 8, 9, 10]
    assert _resume(mgr, "auto", tmp_path).name == "step-3"  # the requeued job, killed before a save
    assert len(list((tmp_path / "checkpoints" / ABANDONED).iterdir())) == 1  # nothing more to set aside


def test_a_checkpoint_of_another_directory_is_refused_where_the_run_has_its_own(tmp_path):
    _run_3_6_9(tmp_path / "other" / "checkpoints")
    elsewhere = tmp_path / "other" / "checkpoints" / "step-3"
    fresh = CheckpointManager(tmp_path / "fresh" / "checkpoints", CheckpointConfig())
    assert _resume(fresh, str(elsewhere), tmp_path / "fresh") == elsewhere  # a new run starts from it
    mine = _run_3_6_9(tmp_path / "mine" / "checkpoints")
    with pytest.raises(
        ValueError,
        match=r"resume=.*other/checkpoints/step-3' names a checkpoint outside run_dir .*mine, "
        r"which holds checkpoints of its own \(newest step-9\)",
    ):
        _resume(mine, str(elsewhere), tmp_path / "mine")
    assert [p.name for p in mine.complete_checkpoints()] == ["step-3", "step-6", "step-9"]
