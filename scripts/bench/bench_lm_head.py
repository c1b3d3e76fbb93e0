"""Peak memory and time of the LM-head cross-entropy: plain FP32 logits vs the chunked loss.

Runs forward + backward of ``F.cross_entropy(F.linear(h, W).float(), labels)`` and of
``nemofp4.models.loss.chunked_cross_entropy`` on the same inputs and reports, for each, the peak
bytes of tensors alive at once during the pass (allocated inside it, the inputs excluded; the
weight's and the hidden states' gradients included) and the wall time. On CUDA the peak is ``torch.cuda.max_memory_allocated`` above the
starting point; on CPU it is counted by a dispatch mode that tracks every tensor storage an
operator creates until it is freed.

    python scripts/bench/bench_lm_head.py --tokens 1024 --width 1024 --vocab 32768

``--tiny-step`` instead measures the head's share of the tiny model's training step for each head
precision (``model.head_precision``, and the tiny preset's unchunked FP32 head): each step (forward,
backward, AdamW) is cut at the final hidden states, so the head and loss (forward and backward) are
timed inside the same step as the whole; the variants are interleaved, ``--repeats`` rounds, medians;
the share is the median over rounds of head / step, and the head's time is also given relative to the
tiny preset's unchunked FP32 head of the same round (what every run had before ``model.head_precision``).
On CPU this measures the program, not the arithmetic's speed: TF32 does not exist there (tf32 runs the
FP32 head), and bf16 runs as FP32 GEMMs of BF16-rounded operands (CPU BF16 matmul is ~200x slower).
It also prints the head's share of the step's FLOPs at the tiny and 8B shapes (formula:
``NemotronHConfig.flops_per_token`` plus the chunked loss's recomputed logits).

    python scripts/bench/bench_lm_head.py --tiny-step --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
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


def head_flops_share(model_cfg, seq_len: int, chunked: bool = True) -> tuple[float, float]:
    """(head FLOPs per token, the head's share of the step's FLOPs): 6 V D for the three head GEMMs,
    plus 2 V D for the chunked loss's recomputed logits in backward."""
    head = (8 if chunked else 6) * model_cfg.vocab_size * model_cfg.hidden_size
    total = model_cfg.flops_per_token(seq_len) + (head - 6 * model_cfg.vocab_size * model_cfg.hidden_size)
    return head, head / total


def tiny_step(repeats: int, chunk_tokens: int) -> None:
    from nemofp4.cli.train import compose_job_config
    from nemofp4.models import build_model, get_model_config
    from nemofp4.models.loss import HEAD_PRECISIONS
    from nemofp4.recipes import apply_recipe, recipe_from_config
    from nemofp4.training.parallel import parallelize

    cfg = compose_job_config(["experiment=tiny_bf16", "train.kernels=eager"])
    torch.manual_seed(0)
    model = build_model(cfg.model, device="meta")
    apply_recipe(model, recipe_from_config(cfg.precision), log=False)
    model = parallelize(model, cfg.distributed, device_type="cpu")
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, seq = cfg.train.micro_batch, cfg.train.seq_len
    ids = torch.randint(0, cfg.model.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)

    # (row, head_chunk_tokens, head_precision): the tiny preset's own unchunked FP32 head first
    variants = [
        ("fp32, unchunked (the tiny preset)", 0, "fp32"),
        *((f"{p}, chunks of {chunk_tokens}", chunk_tokens, p) for p in HEAD_PRECISIONS),
    ]

    def head_loss(h: torch.Tensor, chunk: int, precision: str) -> torch.Tensor:
        """What lm_loss runs after the final norm: the head module and the full FP32 logits' loss, or the
        head's chunked loss in the given precision."""
        if chunk == 0 and precision == "fp32":
            logits = model.lm_head(h)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return model.lm_head.chunked_cross_entropy(h, labels, chunk_tokens=chunk or labels.numel(), precision=precision)

    def step(chunk: int, precision: str) -> tuple[float, float]:
        """One training step cut at the final hidden states, so the head is timed inside it: (step s,
        head + loss forward and backward s)."""
        start = time.perf_counter()
        hidden = model(ids, return_hidden=True)
        h = hidden.detach().requires_grad_()
        head_start = time.perf_counter()
        head_loss(h, chunk, precision).backward()
        head_s = time.perf_counter() - head_start
        hidden.backward(h.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, head_s

    times = {row: {"step": [], "head": []} for row, _, _ in variants}
    for _, chunk, precision in variants:  # warm-up
        step(chunk, precision)
    for _ in range(repeats):
        for row, chunk, precision in variants:
            step_s, head_s = step(chunk, precision)
            times[row]["step"].append(step_s)
            times[row]["head"].append(head_s)
    print(
        f"tiny model ({cfg.model.hidden_size} wide, vocab {cfg.model.vocab_size}), {batch} x {seq} tokens, CPU "
        f"({torch.get_num_threads()} threads), {repeats} interleaved rounds"
    )
    print(
        "| head | step s (median) | head + loss s (median) | head share of the step (median of rounds) "
        "| head + loss / the tiny preset's (median of rounds) |"
    )
    print("|---|---|---|---|---|")
    before = times[variants[0][0]]["head"]  # what every run had before model.head_precision
    for row, _, _ in variants:
        step_s, head_s = times[row]["step"], times[row]["head"]
        share = statistics.median(h / t for h, t in zip(head_s, step_s))
        ratio = statistics.median(h / b for h, b in zip(head_s, before))
        print(
            f"| {row} | {statistics.median(step_s):.3f} | {statistics.median(head_s):.3f} | {share:.1%} | {ratio:.2f} |"
        )
    for name, seq_len in (("tiny", seq), ("nemotron_h_8b_paper", 8192)):
        model_cfg = cfg.model if name == "tiny" else get_model_config(name)
        per_token, share = head_flops_share(model_cfg, seq_len)
        print(
            f"{name} at seq {seq_len}: head {per_token / 1e9:.3f} GFLOP per token (chunked), {share:.1%} of the "
            f"step's FLOPs; {per_token * 8192 / 1e12:.1f} TFLOP per 8192-token micro-batch"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: 128 (1024 with --tiny-step)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny-step", action="store_true", help="the head's share of the tiny model's CPU step")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.tiny_step:
        tiny_step(args.repeats, args.chunk_tokens or 1024)
        return
    args.chunk_tokens = args.chunk_tokens or 128
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.width, generator=g).to(args.device).requires_grad_()
    w = (torch.randn(args.vocab, args.width, generator=g) * 0.02).to(args.device).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(args.device)
    logits_bytes = args.tokens * args.vocab * 4
    print(
        f"tokens {args.tokens}, width {args.width}, vocab {args.vocab}, device {args.device}; "
        f"one FP32 logits tensor = {logits_bytes / 2**20:.1f} MiB"
    )
    print("| loss | peak bytes (MiB) | peak / FP32 logits | seconds |")
    print("|---|---|---|---|")
    rows = [
        ("plain F.cross_entropy", _plain),
        (
            f"chunked, {args.chunk_tokens} tokens a chunk",
            lambda a, b, c: chunked_cross_entropy(a, b, c, chunk_tokens=args.chunk_tokens),
        ),
    ]
    for name, fn in rows:
        measure(fn, h, w, labels)  # warm-up
        seconds, peak = measure(fn, h, w, labels)
        print(f"| {name} | {peak / 2**20:.1f} | {peak / logits_bytes:.2f} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
