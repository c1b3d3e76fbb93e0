"""Training-thread time per checkpoint save, sync against async, on 2 gloo ranks with a ~100M-parameter model.

Each rank holds its FSDP2 shard of a stack of linears (``--layers`` x ``--width``^2 parameters, 100.7M
by default) and its AdamW state, and saves through ``nemofp4.training.checkpoint.CheckpointManager``
every few "steps" of a fixed matmul workload (the training loop's stand-in). The figure is the time the
training thread spends inside the manager per save: ``save()`` itself (the whole write for a sync save;
staging, rank and trainer state for an async one), every ``poll()`` until the save is published, and
the publication (marker, renames, retention with ``keep_last_k=1``, so every save after the first
deletes one). Sync and async saves alternate, ``--rounds`` of each, and the table reports medians.
The step workload's own time is reported too, since the background write competes with it for the CPU.

    torchrun --nproc_per_node=2 scripts/bench/bench_checkpoint.py --root /tmp/bench-ckpt

It uses only the manager's long-standing interface, so the same command measures an older commit's
package: ``git archive <commit> nemofp4 | tar -x -C <dir>`` and pass ``--source <dir>`` (imported
instead of the installed, possibly editable, package).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _model(layers: int, width: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # Adam state exists (2 more FP32 copies of the shard)
    return model, optimizer


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _step_work(seconds_of_matmul: int, width: int) -> float:
    """The training step's stand-in: a fixed amount of matmul work; returns its wall time."""
    a = torch.randn(width, width)
    start = time.perf_counter()
    for _ in range(seconds_of_matmul):
        a = torch.tanh(a @ a / width**0.5)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="scratch folder for the checkpoints (emptied)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="saves of each kind (alternating)")
    parser.add_argument("--step-matmuls", type=int, default=8, help="matmuls of the step stand-in")
    parser.add_argument("--steps-between-saves", type=int, default=4)
    parser.add_argument("--source", type=Path, help="import nemofp4 from this folder (an older commit's package)")
    args = parser.parse_args()
    if args.source is not None:  # ahead of the installed package, editable finders included
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
        sys.path.insert(0, str(args.source.resolve()))

    from nemofp4.training.checkpoint import CheckpointConfig, CheckpointManager

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shutil.rmtree(args.root, ignore_errors=True)
    dist.barrier()
    model, optimizer = _model(args.layers, args.width)
    params = sum(p.numel() for p in model.parameters())
    managers = {
        kind: CheckpointManager(args.root / kind, CheckpointConfig(async_save=kind == "async", keep_last_k=1))
        for kind in ("sync", "async")
    }
    thread_s: dict[str, list[float]] = {"sync": [], "async": []}
    step_s: dict[str, list[float]] = {"sync": [], "async": []}
    step = 0
    for _ in range(args.rounds):
        for kind, mgr in managers.items():
            step += 1
            start = time.perf_counter()
            mgr.save(
                step,
                dcp_state=_state(model, optimizer),
                trainer_state={"step": step},
                rank_state={"rank": torch.tensor(rank)},
            )
            blocked = time.perf_counter() - start
            published = not mgr.pending
            for _ in range(args.steps_between_saves):
                step_s[kind].append(_step_work(args.step_matmuls, args.width))
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1e-3)  # training changes the weights while a save is in flight
                if not published:
                    start = time.perf_counter()
                    published = mgr.poll() is not None
                    blocked += time.perf_counter() - start
            if not published:
                start = time.perf_counter()
                mgr.wait()
                blocked += time.perf_counter() - start
            thread_s[kind].append(blocked)
    for mgr in managers.values():
        if hasattr(mgr, "close"):
            mgr.close()
    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, {"thread": thread_s, "step": step_s})
    if rank == 0:
        import nemofp4

        print(f"nemofp4 from {Path(nemofp4.__file__).parent}")
        shard_mb = sum(p.to_local().numel() for p in model.parameters()) * 4 * 3 / 2**20
        print(
            f"{params / 1e6:.1f}M parameters on {world} ranks: {shard_mb:.0f} MiB of weights + AdamW state per rank; "
            f"{args.rounds} saves of each kind, keep_last_k=1"
        )
        print(
            "| save | training-thread s per save, median (rank 0 / rank 1) | all saves (rank 0) | "
            "step stand-in s, median |"
        )
        print("|---|---|---|---|")
        for kind in ("sync", "async"):
            medians = " / ".join(f"{statistics.median(g['thread'][kind]):.3f}" for g in gathered)
            every = ", ".join(f"{t:.2f}" for t in gathered[0]["thread"][kind])
            print(f"| {kind} | {medians} | {every} | {statistics.median(gathered[0]['step'][kind]):.3f} |")
        shutil.rmtree(args.root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
