"""Loss curves of one run, drawn from its metrics.jsonl at the end of training."""

from __future__ import annotations

from pathlib import Path

from nemofp4.training.metrics import read_metrics


def plot_run(run_dir: Path, *, title: str = "") -> Path:
    """Write `<run_dir>/plots/loss.png`: training loss per step and validation loss per evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = read_metrics(run_dir, "train")
    evals = read_metrics(run_dir, "eval")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, alpha=0.8, label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(run_dir) / "plots" / "loss.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
