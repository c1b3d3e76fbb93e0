"""Under torch.distributed only rank 0 hashes the ``.idx`` files and splits the documents; the other
ranks check sizes, take rank 0's counts and load its cache, and refuse to go on when they see
different data than rank 0."""

import json

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemofp4.data import DataConfig, DataSourceConfig, build_train_loader, write_indexed_dataset
from nemofp4.data.manifest import shard_record


def _write_corpus(folder) -> str:
    rng = np.random.default_rng(0)
    records = []
    for shard in ("s0", "s1"):
        docs = [rng.integers(1, 8000, size=int(n)) for n in rng.integers(5, 60, 60)]
        write_indexed_dataset(folder / shard, docs, np.uint16)
        records.append(shard_record(str(folder / shard), folder))
    manifest = {
        "format": "nemofp4-token-manifest",
        "version": 1,
        "dtype": "uint16",
        "tokenizer": {"hash": None},
        "documents": sum(r["documents"] for r in records),
        "tokens": sum(r["tokens"] for r in records),
        "shards": records,
    }
    (folder / "corpus.manifest.json").write_text(json.dumps(manifest))
    return str(folder / "corpus")


def _config(folder, prefix) -> DataConfig:
    return DataConfig(
        sources=[DataSourceConfig(prefix=prefix)], cache_dir=f"{folder}/cache", validation_fraction=0.2, verify="index"
    )


def _rank_main(rank: int, world: int, folder: str, prefix: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    import nemofp4.data.loader as loader_module
    import nemofp4.data.manifest as manifest

    calls = {"sha256": 0, "split": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    manifest.file_sha256 = counted("sha256", manifest.file_sha256)
    loader_module.split_documents = counted("split", loader_module.split_documents)
    loader = build_train_loader(
        _config(folder, prefix),
        seq_len=16,
        global_batch=8,
        micro_batch=2,
        num_samples=64,
        seed=3,
        dp_rank=rank,
        dp_size=world,
    )
    batches = [b["input_ids"].tolist() for b in loader]
    build_calls = dict(calls)

    real_open = manifest._open_token_source

    def other_data(*args, **kwargs):  # rank 1 reads a shard rank 0 does not know
        source = real_open(*args, **kwargs)
        if rank == 1:
            source.identity = {**source.identity, "documents": source.identity["documents"] + 1}
        return source

    manifest._open_token_source = other_data
    try:
        manifest.open_token_source(prefix)
        error = None
    except ValueError as exc:
        error = str(exc)
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump({"calls": build_calls, "batches": batches, "error": error}, f)
    dist.destroy_process_group()


def test_other_ranks_neither_hash_nor_split_and_serve_rank_zeros_order(tmp_path):
    prefix = _write_corpus(tmp_path)
    mp.spawn(_rank_main, args=(2, str(tmp_path), prefix), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["calls"] == {"sha256": 2, "split": 1}  # rank 0 checks both .idx files and splits once
    assert results[1]["calls"] == {"sha256": 0, "split": 0}
    single = [
        b["input_ids"]
        for b in build_train_loader(
            _config(tmp_path, prefix), seq_len=16, global_batch=8, micro_batch=2, num_samples=64, seed=3
        )
    ]
    for step in range(len(single) // 4):
        merged = torch.tensor(
            results[0]["batches"][2 * step : 2 * step + 2] + results[1]["batches"][2 * step : 2 * step + 2]
        )
        assert torch.equal(merged.reshape(8, 16), torch.cat(single[4 * step : 4 * step + 4]))
    for result in results:  # both ranks stop, neither waits forever
        assert result["error"] and "rank(s) [1] see different data than rank 0 for token source" in result["error"]
    assert "vs rank 0's" in results[1]["error"]
