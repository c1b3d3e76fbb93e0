"""The tiny training step of ``bench_recipes.py`` in two checkouts, timed in one run: did a change
make a recipe slower?

One worker process per checkout imports that checkout's ``nemofp4`` and ``scripts/bench/bench_recipes.py``
(``build_tiny`` and ``_tiny_step``) and holds every recipe's tiny model (4x256 tokens, one thread,
``kernels=auto``, statistics off, 1 BF16 layer where a recipe has a tail). The driver alternates the
workers' rounds (before then after, then after then before), so that the machine's drift falls on
both, and prints the medians after a warm-up round as a Markdown table.

    python scripts/bench/bench_recipes_against.py --before ../checkout-at-the-parent [--after .] [--rounds 9]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH, SEQ_LEN = 4, 256


def worker(root: Path, recipes: list[str]) -> None:
    """Build the models, then time one step of each recipe per line read from stdin (JSON out)."""
    sys.path.insert(0, str(root))  # ahead of an installed nemofp4
    import torch

    torch.set_num_threads(1)
    script = root / "scripts" / "bench" / "bench_recipes.py"
    if not script.is_file():  # a checkout from before scripts/ was grouped
        script = root / "scripts" / "bench_recipes.py"
    spec = importlib.util.spec_from_file_location("bench_recipes", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from nemofp4.models import get_model_config
    from nemofp4.quant import set_quant_backend, set_quant_stats

    vocab = get_model_config("tiny").vocab_size
    ids = torch.randint(0, vocab, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name in recipes or bench.RECIPES:
        model, _, _ = bench.build_tiny(name, 1)
        set_quant_stats(model, False)
        set_quant_backend(model, "auto")
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    print("ready", flush=True)
    for step, _ in enumerate(sys.stdin, start=1):
        times = {}
        for name, (model, optimizer) in runs.items():
            start = time.perf_counter()
            bench._tiny_step(model, optimizer, ids, step)
            times[name] = time.perf_counter() - start
        print(json.dumps(times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="the checkout to compare against (required)")
    parser.add_argument("--after", type=Path, default=Path("."), help="the changed checkout (default: here)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds after one warm-up round")
    parser.add_argument("--recipes", default="", help="comma-separated recipe names (default: bench_recipes.RECIPES)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    recipes = [name for name in args.recipes.split(",") if name]
    if args.worker:
        worker(args.worker.resolve(), recipes)
        return
    if args.before is None:
        parser.error("--before is required: the checkout to compare against")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        label: subprocess.Popen(
            [sys.executable, __file__, "--worker", str(root), "--recipes", args.recipes],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for label, root in (("before", args.before), ("after", args.after))
    }
    for label, proc in procs.items():
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {label} worker did not start (see its error above)")
    times: dict[str, list[dict[str, float]]] = {label: [] for label in procs}
    for round_index in range(args.rounds + 1):
        for label in ("before", "after") if round_index % 2 == 0 else ("after", "before"):
            procs[label].stdin.write("step\n")
            procs[label].stdin.flush()
            row = json.loads(procs[label].stdout.readline())
            if round_index:  # round 0 warms up
                times[label].append(row)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    medians = {
        label: {name: statistics.median(r[name] for r in rows) for name in rows[0]} for label, rows in times.items()
    }
    before, after = medians["before"], medians["after"]
    print(
        f"| tiny model, {BATCH}x{SEQ_LEN} tokens | before: step s | before: vs bf16 | after: step s | after: vs bf16 | after / before |"
    )  # noqa: E501
    print("|---|---|---|---|---|---|")
    for name in after:
        b, a = before[name], after[name]
        vs_b = f"{b / before['bf16']:.2f}x" if "bf16" in before else "-"
        vs_a = f"{a / after['bf16']:.2f}x" if "bf16" in after else "-"
        print(f"| {name} | {b:.3f} | {vs_b} | {a:.3f} | {vs_a} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
