"""Quantization diagnostics of FP4 runs: saturated / underflowed blocks over training, and
per-layer histograms of block-scale exponents under UE5M3 and E4M3.

    python scripts/plot_quant_stats.py runs/tiny-ue5m3 runs/tiny-nvfp4 --out docs/results/quant
    python scripts/plot_quant_stats.py runs/tiny-ue5m3 --checkpoint runs/tiny-ue5m3 --out docs/results/quant

From each run's ``metrics.jsonl`` quant rows (``logging.quant_stats_interval`` > 0), one figure
``<run>_blocks.png``: the fraction of saturated and of underflowed blocks (non-zero blocks whose
scale code rounds to zero) per operand role, averaged over the FP4 linears, against the step.

With ``--checkpoint``, ``scale_exponents.png``: the checkpoint's model runs one validation batch;
every FP4 linear's input X and weight W are block-quantized with both scale formats from the
same current amax (T = 448) and the binary exponents of the decoded block scales are
histogrammed per layer. E4M3 ends at 2^-9 (its smallest subnormal): blocks further down
underflow to a zero scale, which UE5M3 still represents (down to 2^-17).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

ROLES = ("x", "w", "dy_dgrad", "dy_wgrad", "x_wgrad")
STATS = ("saturated_blocks", "underflow_blocks")
SCALE_FORMATS = ("ue5m3", "e4m3")
ZERO_BIN = -32
"""Histogram bin of block scales that are exactly zero (underflowed)."""


def quant_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a run directory")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    quant = {r["step"]: r for r in rows if r.get("kind") == "quant"}
    if not quant:
        raise ValueError(f"{path} has no quant rows: train with logging.quant_stats_interval > 0")
    return [quant[s] for s in sorted(quant)]


def block_fractions(rows: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """stat -> role -> [(step, mean over layers)]."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {s: {} for s in STATS}
    for row in rows:
        for stat in STATS:
            for role in ROLES:
                values = [layer[f"{role}/{stat}"] for layer in row["layers"].values() if f"{role}/{stat}" in layer]
                if values:
                    out[stat].setdefault(role, []).append((row["step"], statistics.fmean(values)))
    return out


def plot_block_fractions(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = block_fractions(quant_rows(run_dir))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, stat in zip(axes, STATS):
        for role, points in series[stat].items():
            ax.plot([s for s, _ in points], [100 * v for _, v in points], marker=".", label=role)
        ax.set(xlabel="step", ylabel=f"{stat.replace('_', ' ')} (% of blocks, mean over layers)",
               title=f"{run_dir.name}: {stat.replace('_', ' ')}")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{run_dir.name}_blocks.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scale_exponent_histograms(checkpoint: str | Path, *, sequences: int = 4) -> dict[str, dict[str, dict[int, int]]]:
    """layer operand ('<fqn>:x' / '<fqn>:w') -> scale format -> {exponent: block count} on one
    validation batch. Exponent floor(log2(scale)); ZERO_BIN counts zero (underflowed) scales."""
    import torch

    from nemofp4.evaluation import EvalSession
    from nemofp4.formats import quantize_blocks
    from nemofp4.quant import quant_linears

    session = EvalSession.open(checkpoint, device="cpu")
    batch = session.validation_batches(session.data_config("checkpoint"), num_sequences=sequences,
                                       batch_size=sequences)[0]  # fmt: skip
    inputs: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, fqn=fqn: inputs.__setitem__(fqn, args[0].detach()))
        for fqn, m in quant_linears(session.model)
    ]
    with torch.no_grad():
        session.model(batch["input_ids"])
    for handle in handles:
        handle.remove()
    histograms: dict[str, dict[str, dict[int, int]]] = {}
    for fqn, module in quant_linears(session.model):
        for operand, tensor, two_d in (("x", inputs[fqn].reshape(-1, inputs[fqn].shape[-1]), False),
                                       ("w", module.weight.detach(), True)):  # fmt: skip
            per_format = {}
            for fmt in SCALE_FORMATS:
                scales = quantize_blocks(tensor, scale_format=fmt, two_d=two_d).block_scales().flatten()
                exps = torch.where(scales > 0, torch.floor(torch.log2(scales.clamp_min(1e-30))), float(ZERO_BIN))
                values, counts = torch.unique(exps.to(torch.int64), return_counts=True)
                per_format[fmt] = dict(zip(values.tolist(), counts.tolist()))
            histograms[f"{fqn}:{operand}"] = per_format
    return histograms


def plot_scale_exponents(histograms: dict[str, dict[str, dict[int, int]]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = sorted(histograms)
    cols = 4
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for offset, fmt in zip((-0.2, 0.2), SCALE_FORMATS):
            hist = histograms[name][fmt]
            total = sum(hist.values())
            xs = sorted(hist)
            ax.bar([x + offset for x in xs], [100 * hist[x] / total for x in xs], width=0.4, label=fmt)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel(f"block-scale exponent ({ZERO_BIN} = zero scale)", fontsize=7)
        ax.set_ylabel("% of blocks", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    path = out / "scale_exponents.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories with quant rows in metrics.jsonl")
    parser.add_argument("--checkpoint", default="", help="also histogram block-scale exponents of this checkpoint")
    parser.add_argument("--sequences", type=int, default=4, help="validation sequences for the histograms")
    parser.add_argument("--out", type=Path, default=Path("quant_plots"))
    args = parser.parse_args(argv)
    if not args.runs and not args.checkpoint:
        parser.error("give at least one run directory or --checkpoint")
    args.out.mkdir(parents=True, exist_ok=True)
    written = [plot_block_fractions(run, args.out) for run in args.runs]
    if args.checkpoint:
        histograms = scale_exponent_histograms(args.checkpoint, sequences=args.sequences)
        (args.out / "scale_exponents.json").write_text(json.dumps(histograms, indent=1) + "\n")
        written.append(plot_scale_exponents(histograms, args.out))
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
