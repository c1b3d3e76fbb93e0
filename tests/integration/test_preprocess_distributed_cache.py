"""Index caches under torch.distributed: rank 0 builds, the other ranks wait and load the same bytes."""

import json

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemofp4.data import DataConfig, DataSourceConfig, build_train_loader, write_indexed_dataset


def _rank_main(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    import nemofp4.data.cache as cache

    builds = []
    real_build = cache._build

    def counting_build(*args, **kwargs):
        builds.append(str(args[0]))
        return real_build(*args, **kwargs)

    cache._build = counting_build
    cfg = DataConfig(
        sources=[DataSourceConfig(prefix=f"{folder}/a", weight=2.0), DataSourceConfig(prefix=f"{folder}/b")],
        cache_dir=f"{folder}/cache",
    )
    loader = build_train_loader(
        cfg, seq_len=16, global_batch=8, micro_batch=2, num_samples=64, seed=3, dp_rank=rank, dp_size=world
    )
    batches = [b["input_ids"].tolist() for b in loader]
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump({"builds": builds, "batches": batches}, f)
    dist.destroy_process_group()


def test_rank_zero_builds_and_other_ranks_load(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        write_indexed_dataset(
            tmp_path / name, [rng.integers(1, 8000, size=int(n)) for n in rng.integers(5, 60, 40)], np.uint16
        )
    mp.spawn(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(results[0]["builds"]) == 3  # the blend and one sample index per source
    assert results[1]["builds"] == []
    assert not list((tmp_path / "cache").glob(".*tmp*"))
    # the two ranks' slices are the two halves of each global batch of a single-rank loader
    single = build_train_loader(
        DataConfig(
            sources=[
                DataSourceConfig(prefix=str(tmp_path / "a"), weight=2.0),
                DataSourceConfig(prefix=str(tmp_path / "b")),
            ],
            cache_dir=str(tmp_path / "cache"),
        ),
        seq_len=16,
        global_batch=8,
        micro_batch=2,
        num_samples=64,
        seed=3,
    )
    full = [b["input_ids"] for b in single]
    for step in range(len(full) // 4):
        merged = torch.tensor(
            results[0]["batches"][2 * step : 2 * step + 2] + results[1]["batches"][2 * step : 2 * step + 2]
        )
        assert torch.equal(merged.reshape(8, 16), torch.cat(full[4 * step : 4 * step + 4]))
