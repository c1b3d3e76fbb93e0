"""The recipe comparison study: the same model, data and budget under several recipes and seeds.

    python scripts/study/compare_recipes.py --study tiny --steps 200 --seeds 1 2 3

For every (recipe, seed) it trains ``experiment=<preset>_<recipe>`` into
``<runs-root>/<study>/<recipe>/seed-<seed>`` (skipped when that run already reached the budget),
then evaluates the final checkpoint's held-out NLL under each inference policy and collects the
training curves. It writes ``<out>/<study>/``: ``README.md`` (the table, the exact command, the
ordering), ``results.json`` (every number, per run and aggregated) and PNG plots of the training
loss and validation NLL curves, absolute and relative to BF16.

Runs go one after another on this machine (``--launcher local``), or are submitted through the
SLURM launcher (``--launcher slurm``: ``nemofp4-launch`` per run; rerun with ``--launcher none``
when the jobs are done to collect them). Table columns:

* final train loss: mean of the last ``--window`` logged losses (the paper's Table 10 uses 10);
* NLL <policy>: held-out NLL of the final checkpoint under that inference policy (nemofp4-eval);
* gap to BF16: (NLL - NLL_bf16) / NLL_bf16 under the ``current`` policy;
* loss spikes: logged losses above ``--loss-threshold`` after ``--spike-after`` steps (default: the
  mean BF16 loss over the 10 steps before that point, i.e. a return to an earlier level of training);
* grad-norm spikes: logged gradient norms above ``--grad-norm-threshold`` (1.0) after the same step.
Every number is the mean +- sample standard deviation over the seeds. When the spike window is
empty (``--steps`` at or below the preset's warmup), the spike columns say so instead.

``--replot results.json`` redraws the plots of a finished study from its saved curves, without
training or evaluating anything.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_common  # noqa: E402 (the scripts folder, also when this file is loaded by path)
from study_common import (  # noqa: E402
    COLORS,
    REPO_ROOT,
    add_run_arguments,
    display_path,
    is_finished,
    mean_curve,
    mean_std,
    moving_average,
    read_rows,
)

DEFAULT_RECIPES = ("bf16", "nvfp4", "ue5m3", "ue5m3_te_settings", "nvfp4_all_fp4_no_rht", "fp8", "mxfp8")
DEFAULT_POLICIES = ("current", "delayed", "calibrated", "unquantized")
# The paper's validation-NLL ordering (recipes.md §1.10, Table 11), best first; "~" ties.
PAPER_ORDER = "bf16 < ue5m3_te_settings < ue5m3 ~ nvfp4 < nvfp4_all_fp4_no_rht"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--study", default="tiny", help="study name: the output folder <out>/<study>")
    p.add_argument("--preset", default="tiny", help="experiment preset: runs use experiment=<preset>_<recipe>")
    p.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    add_run_arguments(p, steps=200, runs_root=REPO_ROOT / "runs" / "compare", local_launch="one after another")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    p.add_argument("--delay", type=int, default=50, help="delayed policy: D (inference batches)")
    p.add_argument("--calibration-sequences", type=int, default=64, help="calibrated policy: C")
    p.add_argument("--window", type=int, default=10, help="final train loss: mean of this many last logged losses")
    p.add_argument(
        "--spike-after", type=int, default=0, help="count spikes after this step (0: a quarter of the budget)"
    )
    p.add_argument("--loss-threshold", type=float, default=0.0, help="loss spike threshold (0: see module doc)")
    p.add_argument("--grad-norm-threshold", type=float, default=1.0)
    p.add_argument("--smooth", type=int, default=10, help="moving-average width of the plotted training curves")
    p.add_argument("--threads", type=int, default=0, help="OMP/torch threads of local runs (0: leave as is)")
    p.add_argument(
        "--replot",
        type=Path,
        metavar="RESULTS_JSON",
        help="only redraw the plots of a finished study from its results.json, into the same folder",
    )
    args = p.parse_args(argv)
    if "bf16" not in args.recipes:
        p.error("--recipes must include bf16 (the baseline every gap is relative to)")
    if args.steps < 1 or args.window < 1:
        p.error("--steps and --window must be >= 1")
    return args


# ----------------------------------------------------------------------------------------- runs
def run_dir(args, recipe: str, seed: int) -> Path:
    return args.runs_root / args.study / recipe / f"seed-{seed}"


def train_overrides(args, recipe: str, seed: int) -> list[str]:
    """The recipe's training overrides; a ``precision.<knob>=`` override goes only to recipes that have the knob."""
    from nemofp4.recipes import recipe_knobs

    knobs = {*recipe_knobs(recipe), "name", "restore_references"}
    shared = [
        o
        for o in args.train_override
        if not o.startswith("precision.") or o.split("=", 1)[0].removeprefix("precision.") in knobs
    ]
    return [
        f"experiment={args.preset}_{recipe}",
        f"train.seed={seed}",
        f"train.max_steps={args.steps}",
        "logging.wandb=false",
        "logging.console=false",
        *shared,
    ]


def train_local(args, recipe: str, seed: int) -> None:
    path = run_dir(args, recipe, seed)
    status = study_common.train_local(
        path, train_overrides(args, recipe, seed), label=f"{recipe} seed {seed}", threads=args.threads
    )
    if status != 0:
        raise SystemExit(f"training {recipe} seed {seed} failed (exit {status}); see {path / 'train.log'}")


def submit_slurm(args, recipe: str, seed: int) -> None:
    study_common.submit_slurm(
        run_dir(args, recipe, seed),
        train_overrides(args, recipe, seed),
        job_name=f"{args.study}-{recipe}-s{seed}",
        slurm_args=args.slurm_arg,
    )


# ----------------------------------------------------------------------------------------- metrics
def evaluate_run(args, path: Path) -> dict[str, float]:
    """Held-out NLL of the final checkpoint under each policy (cached in the run folder)."""
    return study_common.evaluate_checkpoint(
        path,
        step=args.steps,
        policies=args.policies,
        delay=args.delay,
        calibration_sequences=args.calibration_sequences,
    )


def spike_start(args, warmup: int) -> int:
    return args.spike_after or max(warmup, args.steps // 4)


def collect_run(args, recipe: str, seed: int) -> dict:
    path = run_dir(args, recipe, seed)
    from nemofp4.evaluation.run_config import read_saved_config
    from nemofp4.training.config import job_config_from_yaml
    from nemofp4.training.run_dir import RUN_CONFIG

    job = job_config_from_yaml(read_saved_config(path / RUN_CONFIG))
    train = read_rows(path, "train")
    evals = read_rows(path, "eval")
    losses = [r["loss"] for r in train]
    return {
        "recipe": recipe,
        "seed": seed,
        "run_dir": display_path(path),
        "warmup_steps": job.schedule.warmup_steps,
        "steps": [r["step"] for r in train],
        "loss": losses,
        "grad_norm": [r["grad_norm"] for r in train],
        "eval_steps": [r["step"] for r in evals],
        "val_loss": [r["val_loss"] for r in evals],
        "final_loss": statistics.fmean(losses[-args.window :]),
        "nll": evaluate_run(args, path),
    }


def aggregate(args, runs: list[dict]) -> dict:
    start = spike_start(args, runs[0]["warmup_steps"])
    bf16_runs = [r for r in runs if r["recipe"] == "bf16"]
    threshold = args.loss_threshold
    counted = start < args.steps  # else no step lies after the spike window's start
    if counted and not threshold:  # BF16's mean loss over the 10 logged steps before counting starts
        before = [loss for r in bf16_runs for s, loss in zip(r["steps"], r["loss"]) if start - 10 < s <= start]
        threshold = statistics.fmean(before)
    for r in runs:
        after = [(loss, g) for s, loss, g in zip(r["steps"], r["loss"], r["grad_norm"]) if s > start]
        r["loss_spikes"] = sum(loss > threshold for loss, _ in after) if counted else None
        r["grad_norm_spikes"] = sum(g > args.grad_norm_threshold for _, g in after) if counted else None
    table = {}
    bf16_nll = mean_std([r["nll"]["current"] for r in bf16_runs])[0] if "current" in args.policies else None
    for recipe in args.recipes:
        rs = [r for r in runs if r["recipe"] == recipe]
        row = {
            "seeds": [r["seed"] for r in rs],
            "final_loss": mean_std([r["final_loss"] for r in rs]),
            "nll": {p: mean_std([r["nll"][p] for r in rs]) for p in args.policies},
            "loss_spikes": mean_std([r["loss_spikes"] for r in rs]) if counted else None,
            "grad_norm_spikes": mean_std([r["grad_norm_spikes"] for r in rs]) if counted else None,
        }
        if bf16_nll is not None:
            gaps = [(r["nll"]["current"] - bf16_nll) / bf16_nll for r in rs]
            row["gap_to_bf16"] = mean_std(gaps)
        table[recipe] = row
    return {
        "spike_after_step": start,
        "loss_threshold": threshold if counted else None,
        "grad_norm_threshold": args.grad_norm_threshold,
        "table": table,
    }


# ----------------------------------------------------------------------------------------- report
def _pm(value: tuple[float, float] | None, fmt: str) -> str:
    if value is None:
        return "n/a"
    mean, std = value
    return f"{mean:{fmt}} ± {std:{fmt}}"


def markdown_table(args, summary: dict) -> str:
    policies = args.policies
    header = [
        "recipe",
        "final train loss",
        *[f"NLL {p}" for p in policies],
        "gap to BF16 (current)",
        "loss spikes",
        "grad-norm spikes",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for recipe, row in summary["table"].items():
        cells = [
            f"`{recipe}`",
            _pm(row["final_loss"], ".4f"),
            *[_pm(row["nll"][p], ".4f") for p in policies],
            _pm(tuple(100 * v for v in row["gap_to_bf16"]), ".2f") + " %" if "gap_to_bf16" in row else "",
            _pm(row["loss_spikes"], ".1f"),
            _pm(row["grad_norm_spikes"], ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ordering(summary: dict, policy: str = "current") -> list[tuple[str, float, float]]:
    rows = [(recipe, *row["nll"][policy]) for recipe, row in summary["table"].items()]
    return sorted(rows, key=lambda r: r[1])


def plot(args, runs: list[dict], folder: Path) -> list[str]:
    plt = study_common.pyplot()
    written = []

    def relative(curve_x, curve_y, reference):  # percent above a (smoothed) BF16 curve, where it has the step
        return [
            (x_, 100 * (y / reference[x_] - 1))
            for x_, y in zip(curve_x, moving_average(curve_y, smooth))
            if x_ in reference
        ]

    for xkey, ykey, name, ylabel, smooth in (
        ("steps", "loss", "training_loss.png", "training loss", args.smooth),
        ("eval_steps", "val_loss", "validation_nll.png", "validation NLL (trainer's eval)", 1),
    ):
        fig, (ax_abs, ax_rel) = plt.subplots(1, 2, figsize=(12, 4.5))
        base_x, base_y, _, _ = mean_curve([r for r in runs if r["recipe"] == "bf16"], xkey, ykey)
        base = dict(zip(base_x, moving_average(base_y, smooth)))
        # Seed s of a recipe is compared with BF16's seed s: the same data order and initial weights, so
        # the band shows what the recipe changes, not how much the seeds' data orders differ.
        bf16_by_seed = {
            r["seed"]: dict(zip(r[xkey], moving_average(r[ykey], smooth))) for r in runs if r["recipe"] == "bf16"
        }
        for recipe in args.recipes:
            rs = [r for r in runs if r["recipe"] == recipe]
            x, mean, lo, hi = mean_curve(rs, xkey, ykey)
            mean_s = moving_average(mean, smooth)
            color = COLORS.get(recipe)
            ax_abs.plot(x, mean_s, label=recipe, color=color, lw=1.2)
            if len(rs) > 1:
                ax_abs.fill_between(x, moving_average(lo, smooth), moving_average(hi, smooth), color=color, alpha=0.15)
            rel = relative(x, mean, base)
            ax_rel.plot([a for a, _ in rel], [b for _, b in rel], label=recipe, color=color, lw=1.2)
            paired = [
                dict(relative(r[xkey], r[ykey], bf16_by_seed[r["seed"]])) for r in rs if r["seed"] in bf16_by_seed
            ]
            if len(paired) > 1:
                steps = [a for a, _ in rel if all(a in c for c in paired)]
                ax_rel.fill_between(
                    steps,
                    [min(c[a] for c in paired) for a in steps],
                    [max(c[a] for c in paired) for a in steps],
                    color=color,
                    alpha=0.15,
                )
        seeds = ", ".join(str(s) for s in args.seeds)
        ax_abs.set(xlabel="step", ylabel=ylabel)
        ax_abs.set_title(f"{ylabel}: mean of seeds {seeds}, band min-max", fontsize=10)
        ax_rel.set(xlabel="step", ylabel="relative to BF16 (%)")
        ax_rel.set_title("relative to BF16 of the same seed: mean, band min-max", fontsize=10)
        ax_rel.axhline(0.0, color="black", lw=0.6)
        skip = max(args.steps // 10, 1) if xkey == "steps" else 0
        if skip:  # the first steps are far above the rest and would flatten the curves
            ax_abs.set_xlim(left=skip)
            ax_rel.set_xlim(left=skip)
            tail = [m for r in runs for s, m in zip(r["steps"], moving_average(r["loss"], smooth)) if s >= skip]
            ax_abs.set_ylim(min(tail) - 0.05, max(tail) + 0.05)
        for ax in (ax_abs, ax_rel):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def write_report(args, runs: list[dict], summary: dict, argv: list[str], elapsed_s: float) -> Path:
    folder = args.out / args.study
    folder.mkdir(parents=True, exist_ok=True)
    plots = plot(args, runs, folder)
    order = ordering(summary) if "current" in args.policies else []
    command = "python scripts/study/compare_recipes.py " + shlex.join(argv)
    results = {
        "command": command,
        "args": {k: display_path(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary,
        "runs": runs,
        "ordering_current": order,
        "paper_ordering": PAPER_ORDER,
    }
    (folder / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"# Recipe comparison: `{args.study}`",
        "",
        f"Preset `{args.preset}`, {args.steps} steps per run, seeds {args.seeds}, recipes {', '.join(args.recipes)}.",
        f"Held-out NLL of each final checkpoint under the inference policies {', '.join(args.policies)} "
        f"(delayed: D = {args.delay} batches; calibrated: C = {args.calibration_sequences} sequences).",
        (
            f"Spikes are counted after step {summary['spike_after_step']}: losses above {summary['loss_threshold']:.4f}, "
            f"gradient norms above {summary['grad_norm_threshold']:g}. Mean ± sample std over seeds."
            if summary["loss_threshold"] is not None
            else f"Spikes are not counted (n/a): counting starts after step {summary['spike_after_step']} (the warmup or a "
            f"quarter of the budget), at or beyond the {args.steps}-step budget. Mean ± sample std over seeds."
        ),
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
        markdown_table(args, summary),
        "",
    ]
    if order:
        lines += [
            "Validation NLL ordering (current policy, best first): "
            + " < ".join(f"`{r}` ({m:.4f} ± {s:.4f})" for r, m, s in order),
            "",
            f"The paper's ordering (8B, 189B tokens): {PAPER_ORDER}.",
            "",
        ]
    lines += [f"![{name}]({name})" for name in plots]
    lines += ["", f"Collected in {elapsed_s:.0f} s; raw numbers in `results.json`.", ""]
    (folder / "README.md").write_text("\n".join(lines))
    return folder


def replot(results_json: Path) -> None:
    """Redraw a finished study's plots from its results.json (the saved curves), beside it."""
    if not results_json.is_file():
        raise SystemExit(f"--replot {results_json}: no such file (a study's results.json)")
    results = json.loads(results_json.read_text())
    saved = argparse.Namespace(**results["args"])
    written = plot(saved, results["runs"], results_json.parent)
    print(f"redrew {', '.join(written)} in {results_json.parent}", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replot is not None:
        replot(args.replot)
        return
    start = time.perf_counter()
    missing = [(r, s) for r in args.recipes for s in args.seeds if not is_finished(run_dir(args, r, s), args.steps)]
    if missing and args.launcher == "slurm":
        for recipe, seed in missing:
            submit_slurm(args, recipe, seed)
        print("submitted; when the jobs are done, collect with the same command and --launcher none", flush=True)
        return
    if missing and args.launcher == "none":
        names = ", ".join(f"{r}/seed-{s}" for r, s in missing)
        raise SystemExit(f"runs not finished (no step-{args.steps} checkpoint): {names}")
    for recipe, seed in missing:
        train_local(args, recipe, seed)
    runs = []
    for recipe in args.recipes:
        for seed in args.seeds:
            print(f"[eval] {recipe} seed {seed}", flush=True)
            runs.append(collect_run(args, recipe, seed))
    summary = aggregate(args, runs)
    folder = write_report(args, runs, summary, argv, time.perf_counter() - start)
    print(markdown_table(args, summary))
    print(f"written to {folder}", flush=True)


if __name__ == "__main__":
    main()
