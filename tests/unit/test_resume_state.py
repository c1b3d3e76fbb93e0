"""The resume as a set of stateful objects (``training/resume.py``): a checkpoint written from the set
loads back into a fresh one with every piece equal bit for bit (weights, held FP4 references, optimizer,
progress, loader position, generators); the refusal check sees the saved metadata before any tensor is
read and leaves every piece as it was; a rank new to the run keeps its generators."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from nemofp4.quant import (
    QuantTraining,
    QuantTrainingConfig,
    reference_state_dict,
    reset_references,
    without_quant_state,
)
from nemofp4.training.checkpoint import CheckpointConfig, CheckpointManager
from nemofp4.training.engine import TorchEngine
from nemofp4.training.parallel import DistributedConfig
from nemofp4.training.resume import ResumableState, Saved, load_resume_checkpoint
from tests.conftest import fresh_standin, train_standin

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*single process:UserWarning")]


class Counter:
    """A stateful piece with a dict state: the progress or the loader's position."""

    def __init__(self, **values):
        self.values = dict(values)

    def state_dict(self):
        return dict(self.values)

    def load_state_dict(self, state):
        self.values = {k: state[k] for k in self.values}


def _state(steps):
    model, optimizer = fresh_standin()
    train_standin(model, optimizer, steps)
    quant = QuantTraining(model, QuantTrainingConfig(kernels="eager"))
    engine = TorchEngine(model, optimizer, distributed=DistributedConfig(), grad_accum=1, world_size=1, grad_clip=1.0)
    return ResumableState(
        engine=engine,
        quant=quant,
        progress=Counter(step=len(steps), tokens_seen=7 * len(steps)),
        loader=Counter(position=3 * len(steps)),
    )


def _save(tmp_path, state):
    mgr = CheckpointManager(tmp_path / "checkpoints", CheckpointConfig())
    trainer_state = {**state.trainer_state(), "world_size": 1}
    return mgr, mgr.save(2, dcp_state=state.dcp_state(), trainer_state=trainer_state, rank_state=state.rank_state())


def _pieces(state):
    model, optimizer = state.engine.model, state.engine.optimizer
    return (
        without_quant_state(model.state_dict()),
        reference_state_dict(model),
        get_optimizer_state_dict(model, optimizer),
        state.progress.values,
        state.loader.values,
    )


def _assert_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal(x, y)
    else:
        assert a == b


def test_every_piece_of_the_set_resumes_bit_for_bit(tmp_path):
    saved = _state(range(1, 3))
    torch.manual_seed(11)
    random.seed(11)
    mgr, folder = _save(tmp_path, saved)
    expected_draw = (torch.rand(3), random.random())
    fresh = _state(range(1, 2))  # another point of the run: every piece differs
    reset_references(fresh.engine.model)  # step 1's references are step 2's: empty them to tell
    assert reference_state_dict(fresh.engine.model) == {} and reference_state_dict(saved.engine.model) != {}
    seen = []
    resumed = load_resume_checkpoint(
        mgr,
        "auto",
        run_dir=tmp_path,
        rank=0,
        state=fresh,
        refuse=lambda trainer_state, folder: seen.append(dict(trainer_state)),
    )
    assert resumed == folder
    assert seen[0]["step"] == 2 and seen[0]["quant_state"] == "module"
    _assert_equal(_pieces(fresh), _pieces(saved))
    _assert_equal((torch.rand(3), random.random()), expected_draw)  # the generators continue where they were


def test_a_refusal_reads_the_metadata_before_any_tensor_and_changes_nothing(tmp_path):
    mgr, _ = _save(tmp_path, _state(range(1, 3)))
    fresh = _state(range(1, 2))
    before = _pieces(fresh)

    def refuse(trainer_state, folder):
        raise ValueError(f"refused at step {trainer_state['step']}")

    with pytest.raises(ValueError, match="refused at step 2"):
        load_resume_checkpoint(mgr, "auto", run_dir=tmp_path, rank=0, state=fresh, refuse=refuse)
    _assert_equal(_pieces(fresh), before)


def test_a_rank_new_to_the_run_keeps_its_generators(tmp_path, caplog):
    mgr, folder = _save(tmp_path, _state(range(1, 3)))
    trainer_state, rank_state, _ = mgr.read_saved(folder)
    fresh = _state(range(1, 2))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with caplog.at_level(logging.WARNING, logger="nemofp4"):
        fresh.load(mgr, folder, Saved(trainer_state, rank_state, own=False))  # rank 0's file, read by a new rank
    assert "rank 0 is new to this run (checkpoint written by 1 ranks)" in caplog.text
    assert torch.equal(torch.rand(3), expected)
    assert fresh.progress.values == {"step": 2, "tokens_seen": 14}  # the rest of the set resumed
