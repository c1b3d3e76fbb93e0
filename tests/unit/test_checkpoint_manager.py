"""The checkpoint folder protocol: atomic publish, markers, pruning, damage detection."""

import json

import pytest
import torch

from nemofp4.training.checkpoint import (
    MARKER,
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    latest_checkpoint,
)


def _save(mgr, step, value):
    state = {"model": {"w": torch.full((64,), float(value))}}
    return mgr.save(step, dcp_state=state, trainer_state={"step": step}, rank_state={"seed": step})


def _load(mgr, folder):
    state = {"model": {"w": torch.zeros(64)}}
    trainer_state, rank_state, own = mgr.load(folder, dcp_state=state)
    assert own
    return state["model"]["w"], trainer_state, rank_state


def test_save_publishes_complete_folder_and_latest_pointer(tmp_path):
    mgr = CheckpointManager(tmp_path / "checkpoints", CheckpointConfig())
    folder = _save(mgr, 5, 1.5)
    assert folder.name == "step-5" and (folder / MARKER).is_file()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-5"
    w, trainer_state, rng = _load(mgr, folder)
    assert torch.equal(w, torch.full((64,), 1.5))
    assert trainer_state == {"step": 5} and rng == {"seed": 5}
    marker = json.loads((folder / MARKER).read_text())
    assert {"trainer_state.pt", "rank/rank-00000.pt", ".metadata"} <= set(marker["files"])


def test_keep_last_k_prunes_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=2))
    for step in (1, 2, 3):
        _save(mgr, step, step)
    assert [p.name for p in mgr.complete_checkpoints()] == ["step-2", "step-3"]


def test_unfinished_folder_is_never_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    _save(mgr, 1, 1.0)
    # a save killed mid-write leaves only a temporary folder, and a step folder without marker is ignored too
    (tmp_path / ".tmp-step-2").mkdir()
    (tmp_path / "step-3").mkdir()
    (tmp_path / "latest").write_text("step-3\n")
    assert latest_checkpoint(tmp_path).name == "step-1"
    assert [p.name for p in mgr.incomplete()] == [".tmp-step-2", "step-3"]
    assert [p.name for p in mgr.candidates("auto")] == ["step-1"]
    with pytest.raises(CheckpointError, match="incomplete"):
        mgr.verify(tmp_path / "step-3")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_file_is_named(tmp_path, damage):
    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    folder = _save(mgr, 1, 2.0)
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
    with pytest.raises(CheckpointError, match=shard.name):
        _load(mgr, folder)


def test_auto_candidates_fall_back_newest_first(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=0))
    for step in (10, 20, 30):
        _save(mgr, step, step)
    assert [p.name for p in mgr.candidates("auto")] == ["step-30", "step-20", "step-10"]
    assert mgr.candidates("none") == []
    assert [p.name for p in mgr.candidates(str(tmp_path / "step-20"))] == ["step-20"]
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        mgr.candidates(str(tmp_path / "missing"))
