"""Nothing loaded from a checkpoint folder can run code: a planted pickle in each file the trainer or the
evaluator reads fails with a named error, and its payload (creating a file) never runs."""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from nemofp4.checkpointing import MARKER, CheckpointError, SafeFileSystemReader, SafeLoadPlanner, crc32
from nemofp4.training.checkpoint import CheckpointConfig, CheckpointManager

ROOT = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickling this calls open(path, 'w'): proof that code ran is the file existing afterwards."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _checkpoint(tmp_path: Path) -> tuple[CheckpointManager, Path]:
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    mgr = CheckpointManager(tmp_path / "checkpoints", CheckpointConfig())
    folder = mgr.save(
        1,
        dcp_state={"model": model_sd, "optim": optim_sd},
        trainer_state={"step": 1, "config": "name: x\n"},
        rank_state={"rng": torch.zeros(3)},
    )
    return mgr, folder


def _reseal(folder: Path) -> None:
    """Rewrite the marker's sizes and checksums, as an attacker who controls the folder would."""
    marker = json.loads((folder / MARKER).read_text())
    for name in marker["files"]:
        marker["files"][name] = {"bytes": (folder / name).stat().st_size, "crc32": crc32(folder / name)}
    (folder / MARKER).write_text(json.dumps(marker))


def _load(mgr: CheckpointManager, folder: Path) -> None:
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    mgr.load(folder, dcp_state={"model": model_sd, "optim": optim_sd})


@pytest.mark.parametrize("planted", ["trainer_state.pt", "rank/rank-00000.pt", ".metadata"])
def test_planted_pickle_in_a_checkpoint_file_never_runs(tmp_path, planted):
    mgr, folder = _checkpoint(tmp_path)
    _load(mgr, folder)  # intact, it loads
    proof = tmp_path / "pwned"
    if planted == ".metadata":
        (folder / planted).write_bytes(pickle.dumps(Payload(proof)))
    else:
        torch.save({"step": 1, "evil": Payload(proof)}, folder / planted)
    _reseal(folder)
    with pytest.raises(CheckpointError, match=re.escape(str(folder))) as err:
        _load(mgr, folder)
    assert not proof.exists()
    assert "not allowed" in str(err.value) or "weights_only" in str(err.value) or "refusing" in str(err.value)


def test_planted_pickle_in_a_dcp_non_tensor_entry_never_runs(tmp_path):
    proof = tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3), "lr": Payload(proof)}, checkpoint_id=str(tmp_path / "c"))
        state = {"w": torch.zeros(3), "lr": 0.0}
        with pytest.raises((CheckpointError, CheckpointException), match="'lr' holds objects other than plain"):
            dcp.load(state, storage_reader=SafeFileSystemReader(str(tmp_path / "c")), planner=SafeLoadPlanner())
    assert not proof.exists()


def test_planted_pickle_in_trainer_state_never_runs_in_evaluation(tmp_path):
    from nemofp4.evaluation.checkpoint import load_checkpoint_model

    _, folder = _checkpoint(tmp_path)
    proof = tmp_path / "pwned"
    torch.save({"step": 1, "config": Payload(proof)}, folder / "trainer_state.pt")
    _reseal(folder)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint_model(folder)
    assert not proof.exists()


def test_no_full_unpickling_anywhere_in_the_package():
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in (ROOT / "nemofp4").rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"weights_only\s*=\s*False|pickle\.loads?\(", line)
    ]
    assert not offenders, offenders


def test_numpy_generator_state_of_older_checkpoints_loads_but_an_object_array_payload_never_runs(tmp_path):
    import numpy as np

    from nemofp4.checkpointing import load_tensors
    from nemofp4.training.rng import set_rng_state

    np.random.seed(5)
    state, expected = np.random.get_state(), np.random.rand()
    torch.save(
        {"rng": {"numpy": state, "python": __import__("random").getstate(), "torch": torch.get_rng_state()}},
        tmp_path / "old.pt",
    )
    set_rng_state(load_tensors(tmp_path / "old.pt")["rng"])
    assert np.random.rand() == expected
    proof = tmp_path / "pwned"
    torch.save({"a": np.array([Payload(proof)], dtype=object)}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_tensors(tmp_path / "evil.pt")
    assert not proof.exists()


class _GetattrReduce:
    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return (getattr, (self.cls, self.name))


def test_dcp_metadata_enum_members_pickled_by_getattr_load_and_no_other_getattr_does():
    # Python 3.11.2 pickles an enum member as getattr(cls, name): the metadata it writes must load, but getattr
    # must not reach anything else (a method of an allowed class, an enum's other attributes).
    import io

    from torch.distributed.checkpoint.planner import WriteItemType

    from nemofp4.checkpointing import _MetadataUnpickler

    def load(obj):
        return _MetadataUnpickler(io.BytesIO(pickle.dumps(obj))).load()

    assert load({"kind": _GetattrReduce(WriteItemType, "TENSOR")}) == {"kind": WriteItemType.TENSOR}
    for cls, name in [(Path, "write_text"), (WriteItemType, "__class__"), (WriteItemType, "_member_map_")]:
        with pytest.raises(pickle.UnpicklingError, match="not allowed in DCP metadata"):
            load(_GetattrReduce(cls, name))
