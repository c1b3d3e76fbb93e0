"""Async checkpoints on 2 gloo processes: the background save runs beside training collectives without
crossing them, is published at the first step boundary after every rank's write finished, holds the
step's state although training changed it meanwhile, fails on every rank by name, and a kill while it
is in flight leaves only a folder resume ignores; resumed runs follow the uninterrupted trajectory."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemofp4.training.metrics import read_metrics
from tests.conftest import launch, losses

HOLD_S = 1.0


def _model_and_state():
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 16)).sum().backward()
    optimizer.step()

    def state():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    return model, state


def _full(state) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in state["model"].items()}


def _rank_main(rank: int, folder: str) -> None:
    import nemofp4.training.checkpoint as ckpt_mod
    from nemofp4.training.checkpoint import (
        MARKER,
        CheckpointConfig,
        CheckpointError,
        CheckpointManager,
        is_complete,
    )

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    out: dict = {}
    try:
        root = Path(folder) / "checkpoints"
        mgr = CheckpointManager(root, CheckpointConfig(async_save=True, keep_last_k=0))
        out["save_group"] = [dist.get_backend(mgr._save_group), mgr._save_group is not dist.group.WORLD]
        model, state = _model_and_state()
        saved = _full(state())

        # 1. a held save: training goes on (collectives on the default group, weights change in place)
        final = mgr.save(
            1,
            dcp_state=state(),
            trainer_state={"step": 1},
            rank_state={"rank": torch.tensor(rank)},
            hold_background_s=HOLD_S,
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        unpublished_polls, marker_early = 0, False
        while (published := mgr.poll()) is None:
            unpublished_polls += 1
            marker_early |= is_complete(final)
            value = torch.ones(1)
            dist.all_reduce(value)  # the training loop's collectives, concurrent with the save's
            gathered = [None, None]
            dist.all_gather_object(gathered, rank)
            assert value.item() == 2 and gathered == [0, 1]
        out["unpublished_polls"] = unpublished_polls
        out["marker_early"] = marker_early
        out["published"] = str(published)
        out["complete_at_publish"] = is_complete(final)
        out["latest"] = (root / "latest").read_text().strip()
        # the marker describes every file of the folder and nothing else, each once, though only rank 0
        # lists the folder (the others name what their writer wrote)
        on_disk = sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file() and p.name != MARKER)
        out["marker_exact"] = sorted(json.loads((final / MARKER).read_text())["files"]) == on_disk
        staging = mgr._stager._state_dict_stager._cached_storage_mapping
        buffers = {id(v) for v in staging.values()}

        # 2. publication is never later than the first boundary after every write finished
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        at_step_2 = _full(state())
        mgr.save(2, dcp_state=state(), trainer_state={"step": 2}, rank_state={"rank": torch.tensor(rank)})
        mgr._pending.future.exception()  # this rank's write is done
        dist.barrier()  # ... and every other rank's
        out["next_poll"] = str(mgr.poll())
        # the second save staged into the first one's host buffers: no new allocation
        out["buffers_reused"] = len(buffers) > 0 and {id(v) for v in staging.values()} == buffers
        _, fresh = _model_and_state()
        restored = fresh()
        mgr.load(root / "step-2", dcp_state=restored)
        out["step_2_exact"] = all(torch.equal(at_step_2[k], v) for k, v in _full(restored).items())

        # 3. the held save holds step 1's weights, not the ones changed while it was written
        _, fresh = _model_and_state()
        restored = fresh()
        for tensor in restored["model"].values():
            tensor.to_local().zero_()
        mgr.load(final, dcp_state=restored)
        out["staged_exact"] = all(torch.equal(saved[k], v) for k, v in _full(restored).items())

        # 4. a failed background write (rank 1's disk fills up) fails on every rank, naming the step
        class FullDisk(ckpt_mod._RecordingWriter):
            def write_data(self, plan, planner):
                if dist.get_rank() == 1:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return super().write_data(plan, planner)

        ckpt_mod._RecordingWriter = FullDisk
        mgr.save(3, dcp_state=state(), trainer_state={"step": 3}, rank_state={"rank": torch.tensor(rank)})
        try:
            mgr.wait()
            out["error"] = None
        except CheckpointError as err:
            out["error"] = str(err)
        mgr.close()  # rank 0's deletion of the failed folder (moved aside at once) has finished
        dist.barrier()
        out["after_failure"] = sorted(p.name for p in root.iterdir())
        out["pending_after_failure"] = mgr.pending
    finally:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("async")
    mp.spawn(_rank_main, args=(str(folder),), nprocs=2, join=True)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_async_save_runs_beside_training_collectives_and_publishes_when_written(two_ranks):
    for out in two_ranks:
        assert out["save_group"] == ["gloo", True], "the background save must have a gloo group of its own"
        assert out["unpublished_polls"] >= 1, "the held save was published before its write finished"
        assert not out["marker_early"], "the marker appeared before the save was published"
        assert out["published"].endswith("step-1") and out["complete_at_publish"]
        assert out["latest"] == "step-1"


def test_async_save_is_published_at_the_first_boundary_after_every_write_finished(two_ranks):
    for out in two_ranks:
        assert out["next_poll"].endswith("step-2")


def test_async_saves_reuse_their_host_buffers_and_describe_every_file(two_ranks):
    for out in two_ranks:
        assert out["buffers_reused"], "the second save allocated new host buffers"
        assert out["step_2_exact"], "the reused buffers did not hold the second save's state"
        assert out["marker_exact"], "the marker does not describe exactly the folder's files"


def test_async_save_holds_the_state_of_its_step(two_ranks):
    assert all(out["staged_exact"] for out in two_ranks)


def test_failed_async_save_raises_on_every_rank_naming_the_step(two_ranks):
    for out in two_ranks:
        assert out["error"] is not None
        assert ".tmp-step-3" in out["error"] and "ENOSPC" in out["error"]
        assert "step-2" in out["error"]  # names the previous checkpoint, which stays intact
        assert out["after_failure"] == ["latest", "step-1", "step-2"]
        assert not out["pending_after_failure"]


# ---------------------------------------------------------------------------------- the trainer
TRAIN = ["precision=ue5m3", "train.kernels=eager", "distributed=fsdp", "train.micro_batch=2"]
ASYNC = "checkpoint.async_save=true"


def _published(run_dir: Path) -> dict[int, int]:
    """checkpoint step -> the step after which it was published."""
    events = read_metrics(run_dir, "event")
    return {e["checkpoint_step"]: e["step"] for e in events if e.get("event") == "checkpoint"}


def test_kill_during_async_save_resumes_from_the_previous_checkpoint_on_the_same_trajectory(tmp_path):
    run = tmp_path / "run"
    common = [*TRAIN, ASYNC, "train.max_steps=10", "checkpoint.interval=4", "debug.hold_async_save_step=8"]
    # step 8's background write is held; training goes on and every rank is killed after step 9
    launch(2, run, *common, "debug.sigkill_at_step=9", expect_rc=1)
    uninterrupted = losses(run)
    assert sorted(uninterrupted) == list(range(1, 10))
    # step 4 is published at a boundary after its write finished (here within 3 steps), not by the next save
    assert _published(run)[4] < 8, "step 4 was published only when the next save began"
    root = run / "checkpoints"
    assert (root / "step-4" / "COMPLETE.json").is_file()
    assert (root / ".tmp-step-8").is_dir() and not (root / ".tmp-step-8" / "COMPLETE.json").exists()
    assert not (root / "step-8").exists() and (root / "latest").read_text().strip() == "step-4"

    launch(2, run, *common)  # a resumed run is not held
    assert not (root / ".tmp-step-8").exists()
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, 11))
    for step in range(5, 10):
        assert resumed[step] == uninterrupted[step], f"step {step}: {resumed[step]} != {uninterrupted[step]}"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-10", "step-4", "step-8"]


def _dcp_contents(folder: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=True)


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_sync_and_async_saves_give_identical_checkpoints_and_resumed_trajectories(tmp_path):
    sync, async_ = tmp_path / "sync", tmp_path / "async"
    common = [*TRAIN, "train.max_steps=6", "checkpoint.interval=2"]
    launch(2, sync, *common)
    # step 2's write is held for 3 s while steps 3 and 4 train (and change the weights in place)
    launch(
        2,
        async_,
        *common,
        ASYNC,
        "debug.hold_async_save_step=2",
        "debug.hold_async_save_s=3",
        "debug.sigkill_at_step=4",
        expect_rc=1,
    )
    assert _published(async_)[2] >= 3, "the held save did not run in the background"
    launch(2, async_, *common, ASYNC)
    assert losses(async_) == losses(sync)
    for step in (2, 6):
        name = f"step-{step}"
        a = _dcp_contents(sync / "checkpoints" / name, tmp_path / f"sync-{step}.pt")
        b = _dcp_contents(async_ / "checkpoints" / name, tmp_path / f"async-{step}.pt")
        _assert_same(a, b, name)
        for rank_file in sorted((sync / "checkpoints" / name / "rank").iterdir()):
            other = async_ / "checkpoints" / name / "rank" / rank_file.name
            _assert_same(
                torch.load(rank_file, weights_only=True),
                torch.load(other, weights_only=True),
                f"{name}/{rank_file.name}",
            )
