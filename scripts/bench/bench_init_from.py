#!/usr/bin/env python
"""Host memory per rank of loading a transformers folder into an FSDP2-sharded model (train.init_from).

A random Nemotron-H of ~106M parameters (the ``small`` preset with 18 layers,
``M-M-M*-M-M-M-M*-M-``) is saved by transformers in bf16, sharded with an index as the released
folders are (``scripts/make_tiny_hf_model.py``). Then, for each approach, ``--ranks`` gloo processes
(torchrun) do what the trainer does: build the model on the meta device, shard it with FSDP2
(``nemofp4.training.parallel.parallelize``), materialize and initialize it on the CPU, and load:

* ``sharded`` (train.init_from): ``nemofp4.training.init_from.load_initial_weights``: DCP's
  HuggingFaceStorageReader reads each rank's slices with safetensors ``get_slice``;
* ``full_per_rank``: every rank reads the whole folder (``import_hf``, FP32) and keeps its shard
  (``set_model_state_dict(full_state_dict=True)``), the simple way;
* ``rank0_broadcast``: rank 0 alone reads the whole folder and broadcasts the shards
  (``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``).

Each rank reports its resident memory before the load (the torch import and its own shard), the peak
during the load (``VmHWM``, reset with ``/proc/self/clear_refs`` just before; file pages mapped by
safetensors count while mapped) and the wall time, and a hash of its local shards: every approach
must give every rank the same bytes (checked).

    python scripts/bench/bench_init_from.py                  # 2 ranks, ~106M parameters
    python scripts/bench/bench_init_from.py --ranks 2 --pattern M-M-M*-M-   # a quicker smaller model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APPROACHES = ("sharded", "full_per_rank", "rank0_broadcast")
DEFAULT_PATTERN = "M-M-M*-M-M-M-M*-M-"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)


def worker(approach: str, folder: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from nemofp4.models import build_model
    from nemofp4.models.nemotron_h import from_hf_config, import_hf, read_hf_config
    from nemofp4.training.init_from import load_initial_weights, resolve_source
    from nemofp4.training.parallel import DistributedConfig, parallelize

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = from_hf_config(read_hf_config(folder))
    model = build_model(config, device="meta")
    model = parallelize(model, DistributedConfig(backend="fsdp"), device_type="cpu")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    dist.barrier()
    before = _status_kib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    if approach == "sharded":
        load_initial_weights(model, resolve_source(str(folder)))
    elif approach == "full_per_rank":
        full = import_hf(folder).state_dict()
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        del full
    else:
        full = import_hf(folder).state_dict() if rank == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
    dist.barrier()
    wall = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        local = param.to_local() if hasattr(param, "to_local") else param
        digest.update(name.encode())
        digest.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    shard_bytes = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    result = {
        "approach": approach,
        "rank": rank,
        "rss_before_kib": before,
        "peak_kib": peak,
        "wall_s": wall,
        "shard_bytes": shard_bytes,
        "shard_sha256": digest.hexdigest(),
    }
    (out / f"{approach}-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--pattern", default=DEFAULT_PATTERN, help="hybrid_layer_pattern of the small preset")
    parser.add_argument("--max-shard-size", default="100MB")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--worker", nargs=3, metavar=("APPROACH", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), Path(args.worker[2]))
        return
    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_hf_model import make_tiny_hf_model

    from nemofp4.models.nemotron_h import from_hf_config, read_hf_config

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-init-from-"))
    folder = make_tiny_hf_model(
        work / "hf", preset="small", hybrid_layer_pattern=args.pattern, max_shard_size=args.max_shard_size
    )
    params = from_hf_config(read_hf_config(folder)).num_parameters()
    files = sorted(folder.glob("*.safetensors"))
    print(
        f"model: {params / 1e6:.1f}M parameters, {sum(f.stat().st_size for f in files) / 2**20:.0f} MiB of bf16 "
        f"safetensors in {len(files)} files; {args.ranks} gloo ranks; load average {os.getloadavg()[0]:.1f}"
    )
    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for approach in APPROACHES:
        out = work / "results"
        out.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={args.ranks}",
            f"--master_port={_free_port()}",
            str(Path(__file__).resolve()),
            "--worker",
            approach,
            str(folder),
            str(out),
        ]
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
        results += [json.loads((out / f"{approach}-rank{r}.json").read_text()) for r in range(args.ranks)]
    for rank in range(args.ranks):
        hashes = {r["shard_sha256"] for r in results if r["rank"] == rank}
        assert len(hashes) == 1, f"rank {rank}: the approaches loaded different shards"
    print("\n| approach | rank | RSS before load | peak during load | peak - before | wall |")
    print("|---|---|---|---|---|---|")
    for r in results:
        mib = lambda kib: kib / 1024
        print(
            f"| {r['approach']} | {r['rank']} | {mib(r['rss_before_kib']):.0f} MiB | {mib(r['peak_kib']):.0f} MiB | "
            f"{mib(r['peak_kib'] - r['rss_before_kib']):.0f} MiB | {r['wall_s']:.2f} s |"
        )
    shard = results[0]["shard_bytes"] / 2**20
    print(f"\nown FP32 shard per rank: {shard:.0f} MiB; every approach loaded the same bytes on every rank")


if __name__ == "__main__":
    main()
