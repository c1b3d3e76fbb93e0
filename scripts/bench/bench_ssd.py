"""Forward+backward time of our chunked SSD scan vs transformers' pure-PyTorch Mamba-2 scan.

Both sides compute the same thing from the same inputs: dt = softplus(dt_raw + dt_bias) clamped
at time_step_min, the chunked scan, and the D skip. Ours is ``ssd_chunked`` plus those two
elementwise steps (exactly what ``Mamba2Mixer`` runs on CPU); theirs is the torch fallback of
``mamba_chunk_scan_combined`` in ``transformers.models.nemotron_h``. Calls are interleaved and
the median is reported, because the machine is shared.

    python scripts/bench/bench_ssd.py                       # small width, seq 2048, batch 2
    python scripts/bench/bench_ssd.py --preset nemotron_h_8b --seq-len 1024 --batch 1
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from nemofp4.models import get_model_config
from nemofp4.models.nemotron_h.ssd import ssd_chunked


def make_inputs(cfg, batch: int, seq_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h, p, n, groups = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_num_groups
    x = torch.randn(batch, seq_len, h, p, generator=g)
    dt_raw = torch.randn(batch, seq_len, h, generator=g) * 0.5
    dt_bias = torch.log(torch.expm1(torch.linspace(cfg.time_step_min, cfg.time_step_max, h)))
    A = -torch.arange(1, h + 1, dtype=torch.float32)
    B = torch.randn(batch, seq_len, groups, n, generator=g)
    C = torch.randn(batch, seq_len, groups, n, generator=g)
    D = torch.ones(h)
    tensors = [x, dt_raw, dt_bias, B, C, D]
    for t in tensors:
        t.requires_grad_(True)
    return tensors, A


def ours(cfg, x, dt_raw, dt_bias, A, B, C, D):
    dt = F.softplus(dt_raw + dt_bias).clamp(min=cfg.time_step_min)
    y, _ = ssd_chunked(x, dt, A, B, C, cfg.chunk_size)
    return y + D[:, None] * x


def theirs_fn():
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    def theirs(cfg, x, dt_raw, dt_bias, A, B, C, D):
        return hf.mamba2_chunk_scan(
            x,
            dt_raw,
            A,
            B,
            C,
            chunk_size=cfg.chunk_size,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
            dt_limit=(cfg.time_step_min, float("inf")),
        )

    return theirs


def time_fwd_bwd(fn, cfg, tensors, A) -> float:
    for t in tensors:
        t.grad = None
    x, dt_raw, dt_bias, B, C, D = tensors
    start = time.perf_counter()
    y = fn(cfg, x, dt_raw, dt_bias, A, B, C, D)
    y.square().sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    cfg = get_model_config(args.preset)
    tensors, A = make_inputs(cfg, args.batch, args.seq_len)
    theirs = theirs_fn()

    # Same numbers first: a fast wrong scan is no result.
    with torch.no_grad():
        x, dt_raw, dt_bias, B, C, D = tensors
        y_theirs = theirs(cfg, x, dt_raw, dt_bias, A, B, C, D)
        diff = (ours(cfg, x, dt_raw, dt_bias, A, B, C, D) - y_theirs).abs().max() / y_theirs.abs().max()

    impls = {"ours (ssd_chunked)": ours, "transformers torch path": theirs}
    times = {name: [] for name in impls}
    for fn in impls.values():  # warm-up
        time_fwd_bwd(fn, cfg, tensors, A)
    for _ in range(args.repeats):  # interleaved
        for name, fn in impls.items():
            times[name].append(time_fwd_bwd(fn, cfg, tensors, A))

    print(
        f"SSD forward+backward, preset={args.preset} (heads={cfg.mamba_num_heads}, head_dim={cfg.mamba_head_dim}, "
        f"groups={cfg.mamba_num_groups}, state={cfg.ssm_state_size}, chunk={cfg.chunk_size}), "
        f"batch={args.batch}, seq={args.seq_len}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}"
    )
    print(f"max |ours - transformers| / max |transformers| = {diff.item():.2e}")
    print(f"{'implementation':<26} {'median s':>9} {'min s':>8} {'max s':>8}")
    medians = {}
    for name, ts in times.items():
        medians[name] = statistics.median(ts)
        print(f"{name:<26} {medians[name]:>9.3f} {min(ts):>8.3f} {max(ts):>8.3f}")
    ratio = medians["transformers torch path"] / medians["ours (ssd_chunked)"]
    print(f"speed-up of ours over transformers (ratio of medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
