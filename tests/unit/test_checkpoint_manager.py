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


def test_retention_keeps_this_runs_newest_saves_not_the_highest_steps(tmp_path):
    # a run that fell back to step-10 (its step-20 and step-30 damaged beyond use) saves step-11, step-12
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=2))
    for step in (10, 20):
        _save(mgr, step, step)
    for step in (11, 12):
        _save(mgr, step, step)
    assert [p.name for p in mgr.complete_checkpoints()] == ["step-11", "step-12"]
    assert latest_checkpoint(tmp_path).name == "step-12"
    assert [p.name for p in mgr.candidates("auto")] == ["step-12", "step-11"]


def test_a_damaged_checkpoint_set_aside_is_kept_but_neither_tried_nor_counted(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=2))
    for step in (10, 20):
        _save(mgr, step, step)
    shard = next((tmp_path / "step-20").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="damaged"):
        mgr.verify(tmp_path / "step-20")
    assert mgr.set_aside(tmp_path / "step-20") == tmp_path / "step-20.damaged"  # what resume=auto does
    assert [p.name for p in mgr.candidates("auto")] == ["step-10"]
    _save(mgr, 11, 11)  # the resumed run's next save: with the damaged one counted, step-10 would be pruned
    assert [p.name for p in mgr.complete_checkpoints()] == ["step-10", "step-11"]
    assert (tmp_path / "step-20.damaged" / shard.name).is_file() and not mgr.incomplete()
    _save(mgr, 20, 20)
    mgr.set_aside(tmp_path / "step-20")  # damaged again: nothing is overwritten
    assert sorted(p.name for p in tmp_path.glob("step-20.*")) == ["step-20.damaged", "step-20.damaged-1"]


def test_same_step_save_replaces_the_folder_only_once_the_new_one_is_complete(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=0))
    _save(mgr, 5, 1.0)
    _save(mgr, 5, 2.0)
    w, _, _ = _load(mgr, tmp_path / "step-5")
    assert torch.equal(w, torch.full((64,), 2.0))
    mgr.close()  # the replaced folder is deleted in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-5"]


@pytest.mark.parametrize("pointer", ["step-1\n", "../../other/step-15\n", b"\xff\xfe\x00binary"])
def test_stale_or_foreign_latest_pointer_never_hides_the_newest_complete_checkpoint(tmp_path, pointer):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=0))
    _save(mgr, 1, 1.0)
    _save(mgr, 2, 2.0)
    other = tmp_path.parent / "other" / "step-15"
    other.mkdir(parents=True, exist_ok=True)
    (other / MARKER).write_text("{}")
    # a kill between publishing step-2 and rewriting latest leaves it naming step-1; or it was tampered with
    (tmp_path / "latest").write_bytes(pointer.encode() if isinstance(pointer, str) else pointer)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    assert mgr.candidates("auto")[0] == tmp_path / "step-2"


@pytest.mark.parametrize("damage", ["no_files_table", "binary_marker", "garbage_trainer_state", "garbage_metadata"])
def test_every_kind_of_damage_is_a_named_checkpoint_error(tmp_path, damage):
    mgr = CheckpointManager(tmp_path, CheckpointConfig(verify_checksums=False))
    folder = _save(mgr, 1, 1.0)
    marker = json.loads((folder / MARKER).read_text())
    if damage == "no_files_table":
        (folder / MARKER).write_text(json.dumps({"step": 1}))
    elif damage == "binary_marker":
        (folder / MARKER).write_bytes(b"\x80\x04\x95garbage")
    else:
        name = "trainer_state.pt" if damage == "garbage_trainer_state" else ".metadata"
        size = (folder / name).stat().st_size
        (folder / name).write_bytes(b"\x00" * size)  # same size: only the load itself can notice
        assert marker["files"][name]["bytes"] == size
    with pytest.raises(CheckpointError, match=str(folder)):
        _load(mgr, folder)


def test_disk_full_names_enospc_and_the_path_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    _save(mgr, 1, 1.0)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "trainer_state" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"no space left on device \(ENOSPC\)") as err:
        _save(mgr, 2, 2.0)
    assert str(tmp_path) in str(err.value) and "step-1" in str(err.value)
    # what is needed: room for one more checkpoint, of the previous one's size (its marker's sum)
    size = sum(f["bytes"] for f in json.loads((tmp_path / "step-1" / MARKER).read_text())["files"].values())
    assert f"Free space for one more checkpoint: a checkpoint of this run takes {size / 1024:.1f} KiB" in str(err.value)
    assert "the 1 kept take" in str(err.value) and "lower checkpoint.keep_last_k" not in str(err.value)
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    with pytest.raises(CheckpointError, match="ENOSPC"):
        _save(mgr, 2, 2.0)
    monkeypatch.setattr(torch, "save", real_save)
    assert not (tmp_path / ".tmp-step-2").exists() and not (tmp_path / "step-2").exists()
    assert latest_checkpoint(tmp_path).name == "step-1"
    w, _, _ = _load(mgr, tmp_path / "step-1")
    assert torch.equal(w, torch.full((64,), 1.0))


def test_a_full_disk_before_any_checkpoint_says_what_was_written_and_not_keep_last_k(tmp_path, monkeypatch):
    import errno

    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "trainer_state" in str(getattr(f, "name", f)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError) as err:
        _save(mgr, 1, 1.0)
    message = str(err.value)
    assert "no earlier checkpoint exists" in message and "keep_last_k" not in message
    assert "a checkpoint of this run takes more than the " in message and "written before the disk filled" in message


def test_leftover_temporary_folders_are_removed_at_start(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    _save(mgr, 1, 1.0)
    (tmp_path / ".tmp-step-2" / "rank").mkdir(parents=True)
    (tmp_path / ".tmp-step-2" / "rank" / "rank-00000.pt").write_bytes(b"partial")
    (tmp_path / ".old-step-1").mkdir()
    restarted = CheckpointManager(tmp_path, CheckpointConfig())
    removed = restarted.recover()
    assert sorted(p.name for p in removed) == [".old-step-1", ".tmp-step-2"]
    # moved aside at once (deleted in the background): a save of step 2 may start at once
    assert not (tmp_path / ".tmp-step-2").exists() and not (tmp_path / ".old-step-1").exists()
    restarted.close()  # waits for the deletions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
