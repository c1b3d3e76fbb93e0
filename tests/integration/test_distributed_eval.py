"""Data-parallel evaluation: ranks split the validation batches and reduce the NLL, giving the
single-process value, also when the batches do not divide evenly over the ranks."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemofp4.training.metrics import read_metrics
from nemofp4.training.trainer import evaluate
from tests.conftest import free_port as _free_port
from tests.conftest import launch


def _eval_records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir, "eval")}


def test_three_ranks_split_uneven_validation_batches_and_match_one_process(tmp_path):
    # 10 sequences in batches of 4 -> 3 batches of 4, 4 and 2 sequences over 3 FSDP ranks
    common = [
        "precision=bf16",
        "train.max_steps=1",
        "train.global_batch=6",
        "eval.num_sequences=10",
        "checkpoint.interval=0",
        "checkpoint.save_final=false",
    ]
    launch(1, tmp_path / "one", *common, "train.micro_batch=6", "eval.batch_size=4")
    launch(3, tmp_path / "three", *common, "distributed=fsdp", "train.micro_batch=2", "eval.batch_size=4")
    one, three = (_eval_records(tmp_path / name)[0] for name in ("one", "three"))
    assert one["val_tokens"] == three["val_tokens"] == 10 * 64
    assert three["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)


class _CountingLM(torch.nn.Module):
    """A fixed bigram LM that records the batches it is asked to score."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)
        torch.nn.init.normal_(self.table.weight, generator=torch.Generator().manual_seed(0))
        self.seen: list[int] = []

    def forward(self, input_ids):
        self.seen.append(int(input_ids[0, 0]))
        return self.table(input_ids)


def _batches(n: int, vocab: int = 11) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (1 + i % 3, 16), generator=g)
        ids[0, 0] = i  # the batch's tag
        out.append({"input_ids": ids, "labels": torch.randint(0, vocab, ids.shape, generator=g)})
    return out


def _rank(rank: int, world: int, port: int, num_batches: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = _CountingLM(11)
        result = evaluate(model, _batches(num_batches), device=torch.device("cpu"), autocast=contextlib.nullcontext)
        queue.put((rank, result, model.seen))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, num_batches", [(3, 7), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_each_rank_scores_its_share_and_the_reduced_nll_is_the_single_rank_one(world, num_batches):
    single_model = _CountingLM(11)
    single = evaluate(single_model, _batches(num_batches), device=torch.device("cpu"), autocast=contextlib.nullcontext)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, num_batches, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = dict((rank, (res, seen)) for rank, res, seen in (queue.get(timeout=120) for _ in procs))
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    rounds = -(-num_batches // world)
    counted = sorted(tag for _, seen in results.values() for tag in seen if tag < num_batches)
    for result, seen in results.values():
        assert result["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)
        assert result["val_tokens"] == single["val_tokens"]
        assert len(seen) == rounds  # the same number of forward calls on every rank
    # every batch scored exactly once, beyond the uncounted repeats that keep the calls matched
    assert sorted(set(counted)) == list(range(num_batches))
    assert sum(len(seen) for _, seen in results.values()) == rounds * world
