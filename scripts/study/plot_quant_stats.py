"""Quantization diagnostics of FP4 runs: saturated / underflowed blocks over training, and
per-layer histograms of block-scale exponents under UE5M3 and E4M3.

    python scripts/study/plot_quant_stats.py runs/tiny-ue5m3 runs/tiny-nvfp4 --out docs/results/quant
    python scripts/study/plot_quant_stats.py runs/tiny-ue5m3 --checkpoint runs/tiny-ue5m3 --out docs/results/quant

From each run's ``metrics.jsonl`` quant rows (``logging.quant_stats_interval`` > 0), one figure
``<run>_blocks.png``: the fraction of saturated and of underflowed blocks (non-zero blocks whose
scale code rounds to zero) per operand role, averaged over the FP4 linears, against the step, and,
for recipes with held tensor references, the staleness rho = current amax / held amax (mean over
the FP4 linears, band min-max). With ``--compare``, also ``staleness.png``: rho and the two block
fractions per operand role, one line per run, to set recipes side by side.

With ``--checkpoint``, ``scale_exponents.png``: the checkpoint's model runs one validation batch;
every FP4 linear's input X and weight W are block-quantized with both scale formats (T = 448)
under three tensor references: the current amax, and a held reference grown stale (the tensor
grew 8x, or shrank 1024x, since it was sampled). The binary exponents of the block-scale codes are
histogrammed over all FP4 linears, one panel per operand and reference. Under the current amax
the codes lie in (2^-9, 448] in either format; a stale reference pushes them past 448, where
E4M3 saturates and UE5M3 reaches 61,440, or below 2^-9, where E4M3 gives zero and UE5M3 reaches
2^-17.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
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


RATIO = "amax_ratio"
"""rho = current amax / held amax (nemofp4.quant.stats), logged only for held references."""


def staleness_series(rows: list[dict]) -> dict[str, list[tuple[int, float, float, float]]]:
    """role -> [(step, min, mean, max of rho over layers)], for the roles that have rho."""
    out: dict[str, list[tuple[int, float, float, float]]] = {}
    for row in rows:
        for role in ROLES:
            values = [layer[f"{role}/{RATIO}"] for layer in row["layers"].values() if f"{role}/{RATIO}" in layer]
            if values:
                out.setdefault(role, []).append((row["step"], min(values), statistics.fmean(values), max(values)))
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_block_fractions(run_dir: Path, out: Path) -> Path:
    plt = _pyplot()
    rows = quant_rows(run_dir)
    series = block_fractions(rows)
    ratios = staleness_series(rows)
    fig, axes = plt.subplots(1, 3 if ratios else 2, figsize=(18 if ratios else 12, 4))
    if ratios:
        ax = axes[2]
        for role, points in ratios.items():
            steps = [p[0] for p in points]
            (line,) = ax.plot(steps, [p[2] for p in points], marker=".", label=role)
            ax.fill_between(steps, [p[1] for p in points], [p[3] for p in points], color=line.get_color(), alpha=0.15)
        ax.set_yscale("log", base=2)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set(
            xlabel="step", ylabel="current amax / held amax", title=f"{run_dir.name}: staleness (mean, band min-max)"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax, stat in zip(axes, STATS):
        for role, points in series[stat].items():
            ax.plot([s for s, _ in points], [100 * v for _, v in points], marker=".", label=role)
        ax.set(
            xlabel="step",
            ylabel=f"{stat.replace('_', ' ')} (% of blocks, mean over layers)",
            title=f"{run_dir.name}: {stat.replace('_', ' ')}",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{run_dir.name}_blocks.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_staleness(runs: dict[str, list[dict]], out: Path, *, name: str = "staleness.png", title: str = "") -> Path:
    """One figure for several runs (label -> quant rows): per operand role (columns), the largest rho
    over the layers, and the saturated and underflowed block fractions (mean over layers), against the
    step. A run without held references has no rho (current scaling: rho = 1 by construction)."""
    plt = _pyplot()
    ratios = {label: staleness_series(rows) for label, rows in runs.items()}
    fractions = {label: block_fractions(rows) for label, rows in runs.items()}
    roles = [r for r in ROLES if any(r in f[STATS[0]] for f in fractions.values())]
    fig, axes = plt.subplots(3, len(roles), figsize=(4.2 * len(roles), 10), squeeze=False)
    for col, role in enumerate(roles):
        for label in runs:
            points = ratios[label].get(role, [])
            axes[0][col].plot([p[0] for p in points], [p[3] for p in points], marker=".", label=label)
            for row, stat in enumerate(STATS, start=1):
                pts = fractions[label][stat].get(role, [])
                axes[row][col].plot([s for s, _ in pts], [100 * v for _, v in pts], marker=".", label=label)
        axes[0][col].set_yscale("log", base=2)
        axes[0][col].axhline(1.0, color="black", lw=0.6)
        axes[0][col].set(title=f"{role}: max rho = current / held amax", xlabel="step")
        for row, stat in enumerate(STATS, start=1):
            axes[row][col].set(title=f"{role}: {stat.replace('_', ' ')} (% of blocks)", xlabel="step")
        for row in range(3):
            axes[row][col].grid(alpha=0.3)
            axes[row][col].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


REFERENCES = {"current": 1.0, "stale, tensor grew 8x": 1 / 8, "stale, tensor shrank 1024x": 1024.0}
"""Column of the figure -> held tensor reference as a multiple of the tensor's current amax."""
SCALE_LIMITS = {"e4m3": (2.0**-9, 448.0), "ue5m3": (2.0**-17, 61440.0)}
"""Smallest non-zero and largest block-scale code of each format."""


def _block_amax(tensor, two_d: bool, block: int = 16):
    """Per-block amax: 16-element blocks along the last dim, or 16x16 tiles (zero-padded)."""
    import torch.nn.functional as F

    t = tensor.detach().float().abs().reshape(-1, tensor.shape[-1])
    rows, cols = t.shape
    t = F.pad(t, (0, -cols % block, 0, (-rows % block) if two_d else 0))
    if two_d:
        return t.reshape(t.shape[0] // block, block, t.shape[1] // block, block).amax(dim=(1, 3)).flatten()
    return t.reshape(-1, block).amax(dim=-1)


def scale_exponent_histograms(checkpoint: str | Path, *, sequences: int = 4) -> dict:
    """operand ('x' / 'w') -> reference -> scale format -> {"hist": {exponent: blocks}, "blocks",
    "saturated", "zero"}, summed over the FP4 linears, on one validation batch. Exponent
    floor(log2(block-scale code)); ZERO_BIN counts zero codes. ``saturated``: blocks whose exact code
    (T * block amax / reference) exceeds the format's largest; ``zero``: non-zero blocks coded 0.

    Every operand is quantized with both formats under the same reference (T = 448): the current
    amax, where the codes span at most (2^-9, 448] whatever the format and the two histograms
    nearly agree, and a held reference that has grown stale (the case of sample-and-hold), where
    codes leave E4M3's range at one end or the other while UE5M3 still represents them.
    """
    import torch

    from nemofp4.evaluation import EvalSession
    from nemofp4.formats import quantize_blocks
    from nemofp4.quant import quant_linears

    session = EvalSession.open(checkpoint, device="cpu")
    batch = session.validation_batches(
        session.data_config("checkpoint"), num_sequences=sequences, batch_size=sequences
    )[0]
    inputs: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, fqn=fqn: inputs.__setitem__(fqn, args[0].detach()))
        for fqn, m in quant_linears(session.model)
    ]
    with torch.no_grad():
        session.model(batch["input_ids"])
    for handle in handles:
        handle.remove()
    histograms: dict = {
        op: {
            ref: {fmt: {"hist": {}, "blocks": 0, "saturated": 0, "zero": 0} for fmt in SCALE_FORMATS}
            for ref in REFERENCES
        }
        for op in ("x", "w")
    }
    for fqn, module in quant_linears(session.model):
        for operand, tensor, two_d in (
            ("x", inputs[fqn].reshape(-1, inputs[fqn].shape[-1]), False),
            ("w", module.weight.detach(), True),
        ):
            amax = tensor.abs().max().float()
            block_amax = _block_amax(tensor, two_d)
            for ref, factor in REFERENCES.items():
                exact_codes = 448.0 * block_amax / (amax * factor)
                for fmt in SCALE_FORMATS:
                    scales = (
                        quantize_blocks(tensor, scale_format=fmt, two_d=two_d, tensor_amax=amax * factor)
                        .block_scales()
                        .flatten()
                    )
                    exps = torch.where(scales > 0, torch.floor(torch.log2(scales.clamp_min(1e-30))), float(ZERO_BIN))
                    values, counts = torch.unique(exps.to(torch.int64), return_counts=True)
                    entry = histograms[operand][ref][fmt]
                    for v, c in zip(values.tolist(), counts.tolist()):
                        entry["hist"][v] = entry["hist"].get(v, 0) + c
                    entry["blocks"] += scales.numel()
                    # the block holding the amax codes T exactly; a relative 1e-6 absorbs the float32 division
                    entry["saturated"] += int((exact_codes > SCALE_LIMITS[fmt][1] * (1 + 1e-6)).sum())
                    entry["zero"] += int(((scales == 0) & (block_amax > 0)).sum())
    return histograms


def plot_scale_exponents(histograms: dict, out: Path, *, title: str = "") -> Path:
    """Six panels: rows X and W, columns the reference (current, and two stale ones)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    operands = [op for op in ("x", "w") if op in histograms]
    refs = list(REFERENCES)
    colors = {"e4m3": "tab:blue", "ue5m3": "tab:red"}
    fig, axes = plt.subplots(len(operands), len(refs), figsize=(5.2 * len(refs), 3.6 * len(operands)), squeeze=False)
    low = min(int(math.floor(math.log2(lo))) for lo, _ in SCALE_LIMITS.values()) - 2
    for row, operand in enumerate(operands):
        for col, ref in enumerate(refs):
            ax = axes[row][col]
            for offset, fmt in zip((-0.2, 0.2), SCALE_FORMATS):
                entry = histograms[operand][ref][fmt]
                hist = {int(e): c for e, c in entry["hist"].items()}  # JSON keys are strings
                total = entry["blocks"]
                xs = sorted(hist)
                shown = [low if x == ZERO_BIN else x for x in xs]  # zero codes drawn at the left edge
                zero, saturated = 100 * entry["zero"] / total, 100 * entry["saturated"] / total
                ax.bar(
                    [x + offset for x in shown],
                    [100 * hist[x] / total for x in xs],
                    width=0.4,
                    color=colors[fmt],
                    label=f"{fmt}: {saturated:.1f}% saturated, {zero:.1f}% zero",
                )
            for fmt, (lo, hi) in SCALE_LIMITS.items():
                for limit in (lo, hi):
                    ax.axvline(math.log2(limit), color=colors[fmt], ls="--", lw=0.8)
            ax.set_xlim(low - 1, 17)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(f"{'activations X' if operand == 'x' else 'weights W'}, reference {ref}", fontsize=10)
            ax.set_xlabel(f"log2 of the block-scale code (bar at {low}: zero code)", fontsize=9)
            ax.set_ylabel("% of blocks (all FP4 linears)", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        title or "block-scale codes under E4M3 and UE5M3 (dashed: each format's smallest and largest code)", fontsize=11
    )
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
    parser.add_argument("--compare", action="store_true", help="also staleness.png: all runs side by side per role")
    args = parser.parse_args(argv)
    if not args.runs and not args.checkpoint:
        parser.error("give at least one run directory or --checkpoint")
    args.out.mkdir(parents=True, exist_ok=True)
    written = [plot_block_fractions(run, args.out) for run in args.runs]
    if args.compare and args.runs:
        written.append(plot_staleness({run.name: quant_rows(run) for run in args.runs}, args.out))
    if args.checkpoint:
        histograms = scale_exponent_histograms(args.checkpoint, sequences=args.sequences)
        (args.out / "scale_exponents.json").write_text(json.dumps(histograms, indent=1) + "\n")
        written.append(plot_scale_exponents(histograms, args.out))
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
