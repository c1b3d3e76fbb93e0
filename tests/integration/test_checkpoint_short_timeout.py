"""Checkpoint publication and pruning never hold the other ranks for longer than the short collective
timeout (distributed.collective_timeout_s). Two gloo processes whose training groups wait at most
TIMEOUT_S, as after the trainer's first step: rank 0's deletion of every pruned or replaced checkpoint
takes SLOW_S > TIMEOUT_S, and in the async saves rank 1's checksums take SLOW_S too. Every save, poll and
publication on the training thread stays well under the timeout and none times out; the slow work ends
in the background (the deleted folders are gone once the manager is closed). Where rank 0 deleted before
the closing barrier, or the ranks checksummed on the training thread before the gather, the other rank
waited SLOW_S in a collective and timed out."""

from __future__ import annotations

import json
import shutil
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.integration.test_async_checkpoint import _model_and_state

TIMEOUT_S = 2.0
SLOW_S = 3.0


def _rank_main(rank: int, folder: str) -> None:
    import nemofp4.training.checkpoint as ckpt_mod
    from nemofp4.training.checkpoint import CheckpointConfig, CheckpointManager
    from nemofp4.training.dist_env import set_collective_timeout

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    out: dict = {"calls": {}, "error": None}
    slow_deletions = []
    if rank == 0:
        rmtree = shutil.rmtree

        def slow_rmtree(path, *args, **kwargs):
            slow_deletions.append(str(path))
            time.sleep(SLOW_S)
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = slow_rmtree  # what rank 0's background deletions call

    def timed(name, fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        out["calls"].setdefault(name, []).append(time.perf_counter() - start)
        return result

    try:
        _, state = _model_and_state()
        rank_state = {"rank": torch.tensor(rank)}
        sync = CheckpointManager(f"{folder}/sync", CheckpointConfig(keep_last_k=1))
        async_ = CheckpointManager(
            f"{folder}/async", CheckpointConfig(keep_last_k=1, async_save=True), group_timeout_s=120
        )
        set_collective_timeout(TIMEOUT_S, keep=[async_.save_group])  # the trainer's switch after step 1
        try:
            # sync: step 2 prunes step 1 (its deletion takes SLOW_S on rank 0), step 2 again replaces a
            # complete folder (the replaced one is deleted likewise)
            for step in (1, 2, 2):
                timed(
                    "sync save", sync.save, step, dcp_state=state(), trainer_state={"step": step}, rank_state=rank_state
                )
            # async: rank 1's checksums take SLOW_S (in the background); boundaries every 0.25 s meanwhile
            if rank == 1:
                crc32 = ckpt_mod.crc32
                ckpt_mod.crc32 = lambda path: (time.sleep(SLOW_S if path.name.startswith("rank-") else 0), crc32(path))[
                    1
                ]
            for step in (1, 2):
                timed(
                    "async save",
                    async_.save,
                    step,
                    dcp_state=state(),
                    trainer_state={"step": step},
                    rank_state=rank_state,
                )
                published, waited = None, time.perf_counter()
                while published is None:
                    time.sleep(0.25)  # a training step
                    published = timed("poll", async_.poll)
                out.setdefault("published_after", []).append(time.perf_counter() - waited)
            dist.barrier()
        except Exception as err:  # a collective that timed out
            out["error"] = f"{type(err).__name__}: {err}"
        finally:
            sync.close()  # waits for rank 0's background deletions
            async_.close()
        if rank == 0:  # the folders as rank 0 leaves them once its deletions are done
            for name in ("sync", "async"):
                out[name] = sorted(p.name for p in (ckpt_mod.Path(folder) / name).iterdir())
        out["slow_deletions"] = len(slow_deletions)
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def test_publication_and_pruning_hold_no_rank_longer_than_the_short_timeout(tmp_path):
    mp.spawn(_rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, out in enumerate(results):
        assert out["error"] is None, f"rank {rank}: {out['error']}"
        longest = {name: max(times) for name, times in out["calls"].items()}
        assert max(longest.values()) < TIMEOUT_S, (rank, longest)
        # rank 1's checksums held the publication, not the training thread
        assert min(out["published_after"]) >= SLOW_S, out["published_after"]
    # the slow deletions did happen, in the background: the sync saves' pruned and replaced folders and
    # the async saves' pruned one
    assert results[0]["slow_deletions"] == 3
    assert results[0]["sync"] == ["latest", "step-2"] and results[0]["async"] == ["latest", "step-2"], results[0]
