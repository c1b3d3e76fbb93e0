#!/usr/bin/env python
"""Data pipeline benchmark: sample-index build at paper scale, loader and tokenizer throughput.

1. Index build. A synthetic 189B-token corpus of int32 tokens (Nemotron-H's vocabulary) is
   written as real ``.idx`` files with *sparse* ``.bin`` files (holes, no disk use), in shards,
   with log-normal document lengths (median 600, mean ~1,100 tokens, clipped to [16, 262,144]).
   The sample index for the paper's budget (30,000 steps x 768 x 8,192 tokens) is built in a
   fresh subprocess; its wall time and peak RSS (``ru_maxrss``, which includes the torch import
   and the memory-mapped index pages it touched) are reported.
2. Loader. A smaller corpus of real random int32 tokens (memory-mapped, page cache warm) is
   served by ``build_train_loader`` (seq_len 8,192, micro-batch 4, one process, no workers):
   tokens/s over a full pass, median of ``--repeats`` passes.
3. Start-up per rank. ``--ranks`` gloo processes (torchrun) each open the synthetic corpus as
   the trainer does (``verify=index``, the paper's 0.05% document hold-out split, the sample
   index), first with an empty cache (rank 0 builds it) and then with the cache present: wall
   time (a rank waiting for rank 0 counts the wait), CPU time and peak RSS of every rank.
4. Tokenization. ``preprocess`` of the shipped corpus cut into ~4 KB documents and repeated,
   with the shipped tokenizer, workers=1 and 2 interleaved: tokens/s in total and per worker
   (median), including reading the jsonl and writing the shards.

    python scripts/bench/bench_data.py                        # everything (~4 GB of .idx files in --workdir)
    python scripts/bench/bench_data.py --tokens 2e9           # a quick smaller run
    python scripts/bench/bench_data.py --skip index loader tokenize --ranks 2 --tokens 2e10   # start-up per rank only
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
STEPS, GLOBAL_BATCH, SEQ_LEN = 30_000, 768, 8192


def doc_lengths(rng: np.random.Generator, count: int) -> np.ndarray:
    lengths = rng.lognormal(mean=np.log(600.0), sigma=1.1, size=count)
    return np.clip(lengths, 16, 262_144).astype(np.int32)


def write_idx(prefix: Path, lengths: np.ndarray, itemsize: int = 4, dtype_code: int = 4) -> int:
    """Write <prefix>.idx for one-sequence documents and a sparse <prefix>.bin; return tokens."""
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype_code, lengths.size, lengths.size + 1))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(lengths.size + 1, dtype="<i8").tobytes())
    tokens = int(lengths.sum(dtype=np.int64))
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(tokens * itemsize)  # sparse: no blocks written
    return tokens


def write_manifest(prefix: Path, shard_prefixes: list[Path], shard_tokens: list[int], shard_docs: list[int]):
    from nemofp4.data.indexed import file_sha256

    records = []
    for shard, tokens, docs in zip(shard_prefixes, shard_tokens, shard_docs):
        records.append(
            {
                "prefix": shard.name,
                "documents": docs,
                "tokens": tokens,
                "max_token_id": 131071,
                "bin_bytes": os.path.getsize(f"{shard}.bin"),
                "idx_bytes": os.path.getsize(f"{shard}.idx"),
                "bin_sha256": "not-computed (sparse synthetic file)",
                "idx_sha256": file_sha256(f"{shard}.idx"),
            }
        )
    manifest = {
        "format": "nemofp4-token-manifest",
        "version": 1,
        "dtype": "int32",
        "tokenizer": {"hash": None},
        "documents": sum(shard_docs),
        "tokens": sum(shard_tokens),
        "shards": records,
    }
    Path(f"{prefix}.manifest.json").write_text(json.dumps(manifest))


def make_synthetic_corpus(folder: Path, total_tokens: float, num_shards: int, seed: int = 0) -> Path:
    prefix = folder / "synthetic"
    if Path(f"{prefix}.manifest.json").exists():
        return prefix
    rng = np.random.default_rng(seed)
    per_shard = total_tokens / num_shards
    shard_prefixes, shard_tokens, shard_docs = [], [], []
    for shard in range(num_shards):
        estimate = int(per_shard / 1100 * 1.05) + 16
        lengths = doc_lengths(rng, estimate)
        cut = int(np.searchsorted(np.cumsum(lengths, dtype=np.int64), per_shard)) + 1
        lengths = lengths[: min(cut, lengths.size)]
        shard_prefix = folder / f"synthetic_{shard:05d}"
        shard_tokens.append(write_idx(shard_prefix, lengths))
        shard_docs.append(int(lengths.size))
        shard_prefixes.append(shard_prefix)
    write_manifest(prefix, shard_prefixes, shard_tokens, shard_docs)
    return prefix


INDEX_CHILD = r"""
import json, resource, sys, time
from nemofp4.data.manifest import open_token_source
from nemofp4.data.datasets import PackedSequences
prefix, cache, num_samples, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
source = open_token_source(prefix, verify="sizes")
opened = time.perf_counter()
ds = PackedSequences(source, split={"all": True}, documents=source.num_documents, seq_len=seq_len,
                     num_samples=num_samples, seed=1234, cache_dir=cache, vocab_size=131072)
built = time.perf_counter()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"open_s": opened - start, "build_s": built - opened, "peak_rss": rss,
                  "documents": source.num_documents, "tokens": source.num_tokens, "samples": len(ds),
                  "epochs": ds.epochs}))
"""


def bench_index(workdir: Path, total_tokens: float, num_shards: int) -> dict:
    corpus_dir = workdir / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    prefix = make_synthetic_corpus(corpus_dir, total_tokens, num_shards)
    setup_s = time.perf_counter() - start
    num_samples = int(min(STEPS * GLOBAL_BATCH, (total_tokens * 0.998 - 1) // SEQ_LEN))
    cache = workdir / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    out = subprocess.run(
        [sys.executable, "-c", INDEX_CHILD, str(prefix), str(cache), str(num_samples), str(SEQ_LEN)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["setup_s"] = setup_s
    result["idx_bytes"] = sum(p.stat().st_size for p in corpus_dir.glob("*.idx"))
    result["cache_bytes"] = sum(p.stat().st_size for p in cache.rglob("*.npy"))
    return result


RANK_CHILD = r"""
import functools, json, os, resource, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
import nemofp4.data.cache as cache
from nemofp4.data.datasets import PackedSequences, split_documents
from nemofp4.data.manifest import open_token_source
prefix, cache_dir, num_samples, seq_len, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
dist.barrier()
start = time.perf_counter()
source = open_token_source(prefix, verify="index")
opened = time.perf_counter()
split = {"holdout": "train", "fraction": 0.0005, "salt": 0}
documents = functools.partial(split_documents, source.num_documents, 0.0005, 0, False)
if not hasattr(cache, "rank_zero_value"):  # a version where every rank splits for itself
    documents = documents()
ds = PackedSequences(source, split=split, documents=documents, seq_len=seq_len, num_samples=num_samples, seed=1234,
                     cache_dir=cache_dir, vocab_size=131072)
ready = time.perf_counter()
usage = resource.getrusage(resource.RUSAGE_SELF)
with open(f"{out}.rank{dist.get_rank()}.json", "w") as f:
    json.dump({"open_s": opened - start, "total_s": ready - start, "cpu_s": usage.ru_utime + usage.ru_stime,
               "peak_rss": usage.ru_maxrss * 1024, "samples": len(ds)}, f)
dist.destroy_process_group()
"""


def bench_ranks(workdir: Path, total_tokens: float, num_shards: int, ranks: int) -> list[dict]:
    corpus_dir = workdir / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    prefix = make_synthetic_corpus(corpus_dir, total_tokens, num_shards)
    num_samples = int(min(STEPS * GLOBAL_BATCH, (total_tokens * 0.99 - 1) // SEQ_LEN))
    cache = workdir / "rank-cache"
    shutil.rmtree(cache, ignore_errors=True)
    child = workdir / "rank_child.py"
    child.write_text(RANK_CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.setdefault("PYTHONPATH", str(REPO))
    results = []
    for phase in ("cold cache", "warm cache"):
        out = workdir / "rank-result"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={ranks}",
                "--standalone",
                str(child),
                str(prefix),
                str(cache),
                str(num_samples),
                str(SEQ_LEN),
                str(out),
            ],
            check=True,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        for rank in range(ranks):
            results.append({"phase": phase, "rank": rank, **json.loads(Path(f"{out}.rank{rank}.json").read_text())})
    return results


def bench_loader(workdir: Path, loader_tokens: float, repeats: int) -> dict:
    from nemofp4.data import DataConfig, DataSourceConfig, build_train_loader, write_indexed_dataset

    rng = np.random.default_rng(1)
    prefix = workdir / "real" / "tokens"
    if not Path(f"{prefix}.idx").exists():
        lengths = doc_lengths(rng, int(loader_tokens / 1100) + 1)

        def docs():
            for n in lengths:
                yield rng.integers(0, 131072, size=int(n), dtype=np.int32)

        write_indexed_dataset(prefix, docs(), np.int32)
    tokenizer_dir = workdir / "tok131k"
    if not (tokenizer_dir / "tokenizer.json").exists():  # a stand-in 131,072-token vocabulary
        tokenizer_dir.mkdir(parents=True, exist_ok=True)
        vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, 131072)}}
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")).save(str(tokenizer_dir / "tokenizer.json"))
    cfg = DataConfig(
        sources=[DataSourceConfig(prefix=str(prefix))],
        tokenizer=str(tokenizer_dir),
        cache_dir=str(workdir / "real" / "cache"),
        verify="sizes",
    )
    micro, global_batch = 4, 32
    num_samples = int(loader_tokens * 0.99) // SEQ_LEN // global_batch * global_batch

    def one_pass() -> tuple[int, float]:
        loader = build_train_loader(
            cfg, seq_len=SEQ_LEN, global_batch=global_batch, micro_batch=micro, num_samples=num_samples, seed=0
        )
        start, served = time.perf_counter(), 0
        for batch in loader:
            served += batch["input_ids"].numel()
        return served, time.perf_counter() - start

    one_pass()  # warm the page cache
    rates = []
    for _ in range(repeats):
        served, seconds = one_pass()
        rates.append(served / seconds)
    return {"tokens": served, "tokens_per_s": float(np.median(rates)), "rates": rates}


def bench_tokenize(workdir: Path, repeat: int, rounds: int) -> list[dict]:
    """Shipped corpus, cut into ~4 KB documents (web-page sized), repeated; workers 1 and 2 interleaved."""
    from nemofp4.data import PreprocessConfig, preprocess

    bigger = workdir / "tok" / "austen_x.jsonl"
    bigger.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(REPO / "data" / "corpus" / "austen_train.jsonl.gz", "rt") as f:
        chapters = [json.loads(line)["text"] for line in f]
    docs = []
    for chapter in chapters:
        current = ""
        for paragraph in chapter.split("\n\n"):
            current = f"{current}\n\n{paragraph}" if current else paragraph
            if len(current) >= 4000:
                docs.append(current)
                current = ""
        if current:
            docs.append(current)
    bigger.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) * repeat)
    rates: dict[int, list[float]] = {1: [], 2: []}
    tokens = 0
    for _ in range(rounds):
        for workers in (1, 2):
            out = workdir / "tok" / f"w{workers}"
            shutil.rmtree(out, ignore_errors=True)
            manifest = preprocess(
                PreprocessConfig(
                    input=str(bigger),
                    tokenizer=str(REPO / "data" / "tokenizer"),
                    output_prefix=str(out / "x"),
                    workers=workers,
                    progress=False,
                )
            )
            rates[workers].append(manifest["throughput_tokens_per_s"])
            tokens = manifest["tokens"]
    return [
        {
            "workers": w,
            "tokens": tokens,
            "tokens_per_s": float(np.median(r)),
            "per_worker": float(np.median(r)) / w,
            "documents": len(docs) * repeat,
        }
        for w, r in rates.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=189e9, help="synthetic corpus size for the index build")
    parser.add_argument("--shards", type=int, default=48)
    parser.add_argument("--loader-tokens", type=float, default=2.5e8, help="real tokens for the loader bench")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    parser.add_argument("--tokenize-repeat", type=int, default=4, help="copies of the shipped corpus to tokenize")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["index", "loader", "tokenize"])
    parser.add_argument("--ranks", type=int, default=0, help="also measure start-up per rank on this many processes")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="nemofp4-bench-data-"))
    try:
        rows = []
        if "index" not in args.skip:
            r = bench_index(workdir, args.tokens, args.shards)
            rows += [
                (
                    "synthetic corpus",
                    f"{r['tokens'] / 1e9:.2f}B tokens, {r['documents'] / 1e6:.1f}M documents, "
                    f"{args.shards} shards, .idx {r['idx_bytes'] / 2**30:.2f} GiB",
                ),
                (
                    "samples (seq 8192)",
                    f"{r['samples']:,} built ({r['epochs']} epoch(s)), cache {r['cache_bytes'] / 2**30:.2f} GiB",
                ),
                ("index build time", f"{r['build_s']:.1f} s (target <= 120 s); open {r['open_s']:.1f} s"),
                ("index build peak RSS", f"{r['peak_rss'] / 2**30:.2f} GiB (target <= 4 GB)"),
            ]
        if "loader" not in args.skip:
            r = bench_loader(workdir, args.loader_tokens, args.repeats)
            rows.append(
                (
                    "loader throughput",
                    f"{r['tokens_per_s'] / 1e6:.1f}M tokens/s (target >= 10M), median of "
                    f"{[round(x / 1e6, 1) for x in r['rates']]}M over {r['tokens'] / 1e6:.0f}M tokens",
                )
            )
        if args.ranks:
            for r in bench_ranks(workdir, args.tokens, args.shards, args.ranks):
                rows.append(
                    (
                        f"start-up, {r['phase']}, rank {r['rank']}",
                        f"{r['total_s']:.1f} s wall (open + verify {r['open_s']:.1f} s), "
                        f"{r['cpu_s']:.1f} s CPU (process total, with the imports), peak RSS "
                        f"{r['peak_rss'] / 2**30:.2f} GiB, {r['samples']:,} samples",
                    )
                )
        if "tokenize" not in args.skip:
            for r in bench_tokenize(workdir, args.tokenize_repeat, args.repeats):
                rows.append(
                    (
                        f"tokenize, workers={r['workers']}",
                        f"{r['tokens_per_s'] / 1e3:.0f}k tokens/s ({r['per_worker'] / 1e3:.0f}k per worker), "
                        f"{r['tokens'] / 1e6:.1f}M tokens, {r['documents']:,} documents",
                    )
                )
        width = max(len(name) for name, _ in rows)
        print(f"{'measure'.ljust(width)} | result")
        print(f"{'-' * width}-|-{'-' * 60}")
        for name, value in rows:
            print(f"{name.ljust(width)} | {value}")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
