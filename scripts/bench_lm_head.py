"""Peak memory and time of the LM-head cross-entropy: plain FP32 logits vs the chunked loss.

Runs forward + backward of ``F.cross_entropy(F.linear(h, W).float(), labels)`` and of
``nemofp4.models.loss.chunked_cross_entropy`` on the same inputs and reports, for each, the peak
bytes of tensors alive at once during the pass (allocated inside it, the inputs excluded; the
weight's and the hidden states' gradients included) and the wall time. On CUDA the peak is ``torch.cuda.max_memory_allocated`` above the
starting point; on CPU it is counted by a dispatch mode that tracks every tensor storage an
operator creates until it is freed.

    python scripts/bench_lm_head.py --tokens 1024 --width 1024 --vocab 32768
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from nemofp4.models.loss import chunked_cross_entropy
from nemofp4.planning.measure import LiveTensorBytes


def _plain(h, w, labels):
    logits = F.linear(h, w).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def measure(loss_fn, h, w, labels) -> tuple[float, int]:
    h.grad = w.grad = None
    if h.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss_fn(h, w, labels).backward()
        torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated() - base
    mode = LiveTensorBytes(h, w, labels)
    start = time.perf_counter()
    with mode:
        loss_fn(h, w, labels).backward()
    return time.perf_counter() - start, mode.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.width, generator=g).to(args.device).requires_grad_()
    w = (torch.randn(args.vocab, args.width, generator=g) * 0.02).to(args.device).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(args.device)
    logits_bytes = args.tokens * args.vocab * 4
    print(f"tokens {args.tokens}, width {args.width}, vocab {args.vocab}, device {args.device}; "
          f"one FP32 logits tensor = {logits_bytes / 2**20:.1f} MiB")
    print("| loss | peak bytes (MiB) | peak / FP32 logits | seconds |")
    print("|---|---|---|---|")
    rows = [("plain F.cross_entropy", _plain),
            (f"chunked, {args.chunk_tokens} tokens a chunk",
             lambda a, b, c: chunked_cross_entropy(a, b, c, chunk_tokens=args.chunk_tokens))]
    for name, fn in rows:
        measure(fn, h, w, labels)  # warm-up
        seconds, peak = measure(fn, h, w, labels)
        print(f"| {name} | {peak / 2**20:.1f} | {peak / logits_bytes:.2f} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
