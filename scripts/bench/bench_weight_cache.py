"""CPU step time with each FP4 weight quantized once per optimizer step (``train.weight_cache=true``)
against once per micro-batch (false), for the tiny and small presets at ``grad_accum`` 4.

    python scripts/bench/bench_weight_cache.py [--presets tiny small] [--recipe ue5m3] [--repeats 5]

One step: ``set_step``, ``--grad-accum`` micro-batches of ``--micro-batch`` x ``--seq-len`` tokens
(forward, LM loss, backward) inside :func:`nemofp4.quant.cached_weights` or not, and AdamW. Float32
on CPU (the trainer's CPU default) with the trainer's default quantizer (``auto``: the compiled torch
program where a C++ compiler is present); the two settings alternate step by step after a warm-up
step each, and the table gives the median of ``--repeats`` steps and their ratio from the same run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from nemofp4.models import build_model, get_model_config, lm_loss
from nemofp4.quant import cached_weights, set_quant_backend, set_step
from nemofp4.recipes import apply_recipe, get_recipe


def _model(preset: str, recipe: str, kernels: str):
    torch.manual_seed(0)
    model = build_model(get_model_config(preset), device="meta")
    apply_recipe(model, get_recipe(recipe), log=False)
    model.to_empty(device="cpu")
    model.init_weights()
    set_quant_backend(model, kernels)
    return model


def _step(model, optimizer, batches, *, step: int, cache: bool) -> float:
    started = time.perf_counter()
    set_step(model, step, seed=0)
    optimizer.zero_grad(set_to_none=True)
    with cached_weights(model, enabled=cache):
        for ids in batches:
            (lm_loss(model, ids[:, :-1], ids[:, 1:]) / len(batches)).backward()
    optimizer.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--recipe", default="ue5m3")
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for preset in args.presets:
        vocab = get_model_config(preset).vocab_size
        models = {cache: _model(preset, args.recipe, args.kernels) for cache in (False, True)}
        optimizers = {cache: torch.optim.AdamW(m.parameters(), lr=1e-4) for cache, m in models.items()}
        times = {False: [], True: []}
        for step in range(1, args.repeats + 2):
            generator = torch.Generator().manual_seed(step)
            batches = [
                torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=generator)
                for _ in range(args.grad_accum)
            ]
            for cache in (False, True) if step % 2 else (True, False):  # alternate which goes first
                elapsed = _step(models[cache], optimizers[cache], batches, step=step, cache=cache)
                if step > 1:  # the first step of each compiles
                    times[cache].append(elapsed)
        before, after = statistics.median(times[False]), statistics.median(times[True])
        rows.append([preset, args.recipe, f"{before:.3f}", f"{after:.3f}", f"{after / before:.3f}"])
        print(f"{preset}: per micro-batch {before:.3f} s, once per step {after:.3f} s", flush=True)
    print(
        f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
        f"grad_accum {args.grad_accum} x micro-batch {args.micro_batch} x seq {args.seq_len}, "
        f"median of {args.repeats} steps, kernels={args.kernels}"
    )
    print("| preset | recipe | step s, weights quantized per micro-batch | step s, once per step | ratio |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
