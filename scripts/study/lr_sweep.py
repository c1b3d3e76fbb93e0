"""Learning-rate sensitivity per recipe: recipes x learning rates x seeds on one preset.

    python scripts/study/lr_sweep.py --study lr_sweep --recipes bf16 ue5m3 --lrs 3e-3 1e-2 3e-2 --seeds 1 2 --steps 150

For every (recipe, LR, seed) it trains ``experiment=<preset>_<recipe> optim.lr=<LR>`` into
``<runs-root>/<study>/<recipe>/lr-<LR>/seed-<seed>`` (the overrides of scripts/study/compare_recipes.py
plus the LR; a run that reached the budget, or diverged, is not trained again, so an interrupted
sweep continues where it stopped), with ``--workers`` runs at a time here (``--launcher local``) or
submitted through SLURM (``--launcher slurm``; collect with ``--launcher none`` when done; there the
sweep does not see a job's exit, so a run that stopped on a non-finite loss, NonFiniteError in its
job log, is listed as not finished until ``diverged.json`` is written into its folder). It writes
``<out>/<study>/``: ``README.md`` (the command, the table; a hand-written part after its
``READING_MARKER`` line is kept), ``results.json`` and the plots:

* ``nll_vs_lr.png``: the final held-out NLL (the trainer's evaluation at the last step) against the
  LR per recipe, seed mean with a min-max band; a run that diverged (stopped on a non-finite loss)
  counts as the NLL at initialization;
* ``lr_sensitivity.png``: each recipe's LR sensitivity (Wortsman et al. 2023, "Small-scale proxies for
  large-scale Transformer training instabilities"), per seed s over the LR grid H:
  ``mean_{lr in H} [min(NLL_s(lr), NLL_s(init)) - min_{lr in H} NLL_s(lr)]``: how much is lost, on
  average over the grid, to not being at the best LR, with divergence capped at the initial loss.
  Mean +- sample std over seeds;
* ``staleness.png`` (with ``--staleness-recipes``): the delayed-scaling comparison at
  ``--staleness-lr``, first seed: per operand role, rho = current amax / held amax (the largest over
  the FP4 linears) and the saturated and underflowed block fractions over training (from the quant
  rows: pass ``--train-override logging.quant_stats_interval=N``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_recipes  # noqa: E402 (the scripts folder, also when this file is loaded by path)
import plot_quant_stats  # noqa: E402
import study_common  # noqa: E402
from study_common import (  # noqa: E402
    COLORS,
    REPO_ROOT,
    add_run_arguments,
    display_path,
    is_finished,
    mean_std,
    read_rows,
)

READING_MARKER = "<!-- reading: written by hand, kept when the study is collected again -->"
"""In the study's README.md, everything from this line on (the settings and the reading) is kept."""
DIVERGED = "diverged.json"
"""Marker in a run folder: training stopped on a non-finite loss (a result of the sweep, not an error)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--study", default="lr_sweep", help="study name: the output folder <out>/<study>")
    p.add_argument("--preset", default="tiny", help="experiment preset: runs use experiment=<preset>_<recipe>")
    p.add_argument("--recipes", nargs="+", required=True)
    p.add_argument("--lrs", nargs="+", type=float, required=True, help="the learning-rate grid (optim.lr)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2], help="seeds trained at every learning rate")
    p.add_argument(
        "--extreme-seeds",
        nargs="*",
        type=int,
        default=[],
        help="further seeds trained only at the grid's smallest and largest learning rates: the seed "
        "spread where a recipe is slow and where it becomes unstable, at a fraction of a full seed's cost",
    )
    add_run_arguments(p, steps=150, runs_root=REPO_ROOT / "runs" / "lr_sweep", local_launch="--workers at a time")
    p.add_argument("--workers", type=int, default=1, help="local runs trained at the same time")
    p.add_argument("--threads", type=int, default=0, help="OMP/torch threads of each local run (0: leave as is)")
    p.add_argument(
        "--staleness-recipes",
        nargs="*",
        default=[],
        help="recipes of the delayed-scaling comparison (staleness.png), e.g. ue5m3 nvfp4_delayed nvfp4",
    )
    p.add_argument(
        "--staleness-lr", type=float, default=None, help="LR of the staleness comparison (default: the grid's smallest)"
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.workers < 1:
        p.error(f"--steps and --workers must be >= 1, got {args.steps} and {args.workers}")
    for name, values in (
        ("--recipes", args.recipes),
        ("--lrs", args.lrs),
        ("--seeds", args.seeds + args.extreme_seeds),
    ):
        if len(set(values)) != len(values):
            p.error(f"{name} has a repeated value: {values}" + (" (with --extreme-seeds)" if name == "--seeds" else ""))
    if any(not (lr > 0 and math.isfinite(lr)) for lr in args.lrs):
        p.error(f"--lrs must be positive and finite, got {args.lrs}")
    args.lrs = sorted(args.lrs)
    presets = REPO_ROOT / "configs" / "experiment"
    absent = [r for r in args.recipes if not (presets / f"{args.preset}_{r}.yaml").is_file()]
    if absent:
        p.error(
            f"no experiment preset {', '.join(f'{args.preset}_{r}' for r in absent)} in configs/experiment "
            f"(runs use experiment=<preset>_<recipe>); presets there: {sorted(f.stem for f in presets.glob('*.yaml'))}"
        )
    unknown = sorted(set(args.staleness_recipes) - set(args.recipes))
    if unknown:
        p.error(f"--staleness-recipes {unknown} are not in --recipes {args.recipes}")
    if args.staleness_lr is None:
        args.staleness_lr = args.lrs[0]
    elif args.staleness_lr not in args.lrs:
        p.error(f"--staleness-lr {args.staleness_lr:g} is not in the grid --lrs {[f'{lr:g}' for lr in args.lrs]}")
    return args


# ----------------------------------------------------------------------------------------- runs
def grid(args) -> list[tuple[str, float, int]]:
    """Every (recipe, LR, seed) of the study: ``--seeds`` at every LR, ``--extreme-seeds`` at the two ends."""
    ends = sorted({args.lrs[0], args.lrs[-1]})
    return [
        (r, lr, s)
        for r in args.recipes
        for lr in args.lrs
        for s in [*args.seeds, *(args.extreme_seeds if lr in ends else [])]
    ]


def run_dir(args, recipe: str, lr: float, seed: int) -> Path:
    return args.runs_root / args.study / recipe / f"lr-{lr:g}" / f"seed-{seed}"


def train_overrides(args, recipe: str, lr: float, seed: int) -> list[str]:
    """The comparison study's overrides of (recipe, seed), with the learning rate."""
    base = compare_recipes.parse_args(
        [
            "--preset",
            args.preset,
            "--steps",
            str(args.steps),
            "--recipes",
            "bf16",
            recipe,
            *[a for o in args.train_override for a in ("--train-override", o)],
        ]
    )
    return [*compare_recipes.train_overrides(base, recipe, seed), f"optim.lr={lr!r}"]


def has_diverged(path: Path) -> bool:
    return (path / DIVERGED).is_file()


def is_done(args, path: Path) -> bool:
    return is_finished(path, args.steps) or has_diverged(path)


def train_local(args, recipe: str, lr: float, seed: int) -> None:
    path = run_dir(args, recipe, lr, seed)
    label = f"{recipe} lr {lr:g} seed {seed}"
    status = study_common.train_local(path, train_overrides(args, recipe, lr, seed), label=label, threads=args.threads)
    if status == 0:
        return
    log = (path / "train.log").read_text(errors="replace")
    if "NonFiniteError" in log or "non-finite loss" in log:
        (path / DIVERGED).write_text(json.dumps({"exit": status}) + "\n")
        print(f"[train] {label}: diverged (non-finite loss)", flush=True)
        return
    raise SystemExit(f"training {label} failed (exit {status}); see {path / 'train.log'}")


def train_missing(args, missing: list[tuple[str, float, int]]) -> None:
    if args.workers == 1:
        for recipe, lr, seed in missing:
            train_local(args, recipe, lr, seed)
        return
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:  # each worker waits on one training process
        futures = [pool.submit(train_local, args, *run) for run in missing]
        for future in concurrent.futures.as_completed(futures):
            future.result()


# ----------------------------------------------------------------------------------------- results
def collect_run(args, recipe: str, lr: float, seed: int) -> dict:
    path = run_dir(args, recipe, lr, seed)
    evals = {r["step"]: r["val_loss"] for r in read_rows(path, "eval")}
    train = read_rows(path, "train")
    diverged = has_diverged(path)
    if 0 not in evals:
        raise SystemExit(f"{path}: no evaluation at step 0 (keep eval.at_start=true): the sensitivity needs it")
    final = evals.get(args.steps) if not diverged else None
    if final is not None and not math.isfinite(final):
        final = None
    return {
        "recipe": recipe,
        "lr": lr,
        "seed": seed,
        "run_dir": display_path(path),
        "status": "diverged" if diverged else "finished",
        "init_nll": evals[0],
        "final_nll": final,
        "final_loss": statistics.fmean(r["loss"] for r in train[-10:]) if train else None,
        "steps": len(train),
        "train_time_s": math.fsum(r["step_time_s"] for r in train),
    }


def capped_nll(run: dict) -> float:
    """The final NLL, or the NLL at initialization when the run diverged or ended above it."""
    return run["init_nll"] if run["final_nll"] is None else min(run["final_nll"], run["init_nll"])


def lr_sensitivity(nll_by_lr: dict[float, float], init_nll: float) -> float:
    """Wortsman et al. 2023: mean over the grid of min(NLL(lr), NLL(init)) - the best NLL of the grid."""
    capped = [min(v, init_nll) for v in nll_by_lr.values()]
    return statistics.fmean(capped) - min(capped)


def aggregate(args, runs: list[dict]) -> dict:
    table = {}
    for recipe in args.recipes:
        rs = [r for r in runs if r["recipe"] == recipe]
        per_lr = {}
        for lr in args.lrs:
            at = [r for r in rs if r["lr"] == lr]
            nll = [capped_nll(r) for r in at]
            per_lr[f"{lr:g}"] = {
                "nll": mean_std(nll),
                "seeds": len(at),
                "spread": max(nll) - min(nll),
                "diverged": sum(r["status"] == "diverged" for r in at),
            }
        sensitivities = []
        for seed in args.seeds:  # only seeds with the whole grid have a sensitivity
            at = {r["lr"]: capped_nll(r) for r in rs if r["seed"] == seed}
            init = next(r["init_nll"] for r in rs if r["seed"] == seed)
            sensitivities.append(lr_sensitivity(at, init))
        best = min(args.lrs, key=lambda lr: per_lr[f"{lr:g}"]["nll"][0])
        table[recipe] = {
            "per_lr": per_lr,
            "best_lr": best,
            "best_nll": per_lr[f"{best:g}"]["nll"],
            "sensitivity_per_seed": dict(zip(map(str, args.seeds), sensitivities)),
            "sensitivity": mean_std(sensitivities),
        }
    return {"table": table}


def _pm(value: tuple[float, float], n: int, fmt: str = ".4f") -> str:
    """Mean ± sample std over ``n`` seeds; one seed has no spread to show."""
    return f"{value[0]:{fmt}} ± {value[1]:{fmt}}" if n > 1 else f"{value[0]:{fmt}}"


def markdown_table(args, summary: dict) -> str:
    header = ["recipe", *[f"NLL @ lr {lr:g}" for lr in args.lrs], "best lr", "LR sensitivity"]
    if args.extreme_seeds:
        header += [f"seed spread @ lr {lr:g}" for lr in (args.lrs[0], args.lrs[-1])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for recipe, row in summary["table"].items():
        cells = [f"`{recipe}`"]
        for lr in args.lrs:
            cell = row["per_lr"][f"{lr:g}"]
            cells.append(
                _pm(cell["nll"], cell["seeds"]) + (f" ({cell['diverged']} diverged)" if cell["diverged"] else "")
            )
        cells += [f"{row['best_lr']:g}", _pm(row["sensitivity"], len(args.seeds))]
        if args.extreme_seeds:
            cells += [f"{row['per_lr'][f'{lr:g}']['spread']:.4f}" for lr in (args.lrs[0], args.lrs[-1])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- plots
def plot(args, runs: list[dict], summary: dict, folder: Path) -> list[str]:
    plt = study_common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for recipe in args.recipes:
        color = COLORS.get(recipe)
        cells = [summary["table"][recipe]["per_lr"][f"{lr:g}"] for lr in args.lrs]
        at = [[capped_nll(r) for r in runs if r["recipe"] == recipe and r["lr"] == lr] for lr in args.lrs]
        ax.plot(args.lrs, [c["nll"][0] for c in cells], marker="o", label=recipe, color=color, lw=1.2)
        if len(args.seeds) + len(args.extreme_seeds) > 1:
            ax.fill_between(args.lrs, [min(v) for v in at], [max(v) for v in at], color=color, alpha=0.15)
        diverged = [(lr, c["nll"][0]) for lr, c in zip(args.lrs, cells) if c["diverged"]]
        if diverged:
            ax.scatter(*zip(*diverged), marker="x", s=60, color=color)
    ax.set_xscale("log")
    ax.set(xlabel="learning rate", ylabel=f"final validation NLL (step {args.steps})")
    extreme = f" (+{args.extreme_seeds} at the ends)" if args.extreme_seeds else ""
    ax.set_title(f"seed mean over {args.seeds}{extreme}, band min-max; x: diverged (NLL at init)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "nll_vs_lr.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, recipe in enumerate(args.recipes):
        row = summary["table"][recipe]
        mean, std = row["sensitivity"]
        ax.bar(i, mean, yerr=std, color=COLORS.get(recipe, "tab:gray"), alpha=0.7, capsize=4)
        per_seed = list(row["sensitivity_per_seed"].values())
        ax.scatter([i] * len(per_seed), per_seed, color="black", s=12, zorder=3)
    ax.set_xticks(range(len(args.recipes)), args.recipes, rotation=20, fontsize=8)
    ax.set_ylabel("LR sensitivity (nats)")
    lrs = f"{args.lrs[0]:g}..{args.lrs[-1]:g}"
    ax.set_title(
        f"mean over lr in [{lrs}] of min(NLL, NLL_init) - best NLL; bar: seed mean ± std, dots: seeds", fontsize=9
    )
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(folder / "lr_sensitivity.png", dpi=110)
    plt.close(fig)
    written = ["nll_vs_lr.png", "lr_sensitivity.png"]
    if args.staleness_recipes:
        seed = args.seeds[0]
        rows = {
            r: plot_quant_stats.quant_rows(run_dir(args, r, args.staleness_lr, seed)) for r in args.staleness_recipes
        }
        title = f"delayed-scaling comparison at lr {args.staleness_lr:g}, seed {seed}"
        written.append(plot_quant_stats.plot_staleness(rows, folder, title=title).name)
    return written


def staleness_table(args) -> str:
    """Per staleness recipe and role: the largest rho over training and layers, and the mean saturated
    and underflowed block fractions over the logged steps."""
    lines = ["| recipe | role | max rho | mean saturated blocks | mean underflowed blocks |", "|---|---|---|---|---|"]
    for recipe in args.staleness_recipes:
        rows = plot_quant_stats.quant_rows(run_dir(args, recipe, args.staleness_lr, args.seeds[0]))
        ratios = plot_quant_stats.staleness_series(rows)
        fractions = plot_quant_stats.block_fractions(rows)
        for role in plot_quant_stats.ROLES:
            if role not in fractions["saturated_blocks"]:
                continue
            rho = f"{max(p[3] for p in ratios[role]):.3g}" if role in ratios else "— (current scaling)"
            sat, under = (statistics.fmean(v for _, v in fractions[s][role]) for s in plot_quant_stats.STATS)
            lines.append(f"| `{recipe}` | {role} | {rho} | {100 * sat:.3f} % | {100 * under:.3f} % |")
    return "\n".join(lines)


def write_report(args, runs: list[dict], summary: dict, argv: list[str], elapsed_s: float) -> Path:
    folder = args.out / args.study
    folder.mkdir(parents=True, exist_ok=True)
    plots = plot(args, runs, summary, folder)
    command = "python scripts/study/lr_sweep.py " + shlex.join(argv)
    saved_args = {k: display_path(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results = {"command": command, "args": saved_args, "summary": summary, "runs": runs}
    (folder / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"# Learning-rate sweep: `{args.study}`",
        "",
        f"Preset `{args.preset}`, {args.steps} steps per run, learning rates {', '.join(f'{lr:g}' for lr in args.lrs)}, "
        f"seeds {args.seeds}"
        + (f" (and {args.extreme_seeds} at the smallest and largest LR)" if args.extreme_seeds else "")
        + f", recipes {', '.join(args.recipes)}. NLL: the trainer's held-out evaluation at the last "
        "step; a diverged run counts as its NLL at initialization. LR sensitivity: per seed, the mean over the grid of "
        "min(NLL(lr), NLL(init)) - the grid's best NLL (Wortsman et al. 2023); mean ± sample std over seeds.",
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
    if args.staleness_recipes:
        lines += [
            f"Delayed-scaling comparison (lr {args.staleness_lr:g}, seed {args.seeds[0]}):",
            "",
            staleness_table(args),
            "",
        ]
    lines += [f"![{name}]({name})" for name in plots]
    lines += ["", f"Collected in {elapsed_s:.0f} s; raw numbers in `results.json`.", ""]
    readme = folder / "README.md"
    old = readme.read_text() if readme.is_file() else ""
    kept = old[old.index(READING_MARKER) :] if READING_MARKER in old else ""
    readme.write_text("\n".join(lines) + ("\n" + kept if kept else ""))
    return folder


def main(argv: list[str] | None = None) -> Path | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    start = time.perf_counter()
    runs_of_study = grid(args)
    missing = [run for run in runs_of_study if not is_done(args, run_dir(args, *run))]
    if missing and args.launcher == "slurm":
        for recipe, lr, seed in missing:
            study_common.submit_slurm(
                run_dir(args, recipe, lr, seed),
                train_overrides(args, recipe, lr, seed),
                job_name=f"{args.study}-{recipe}-lr{lr:g}-s{seed}",
                slurm_args=args.slurm_arg,
            )
        print("submitted; when the jobs are done, collect with the same command and --launcher none", flush=True)
        return None
    if missing and args.launcher == "none":
        names = ", ".join(f"{r}/lr-{lr:g}/seed-{s}" for r, lr, s in missing)
        raise SystemExit(f"runs not finished (no step-{args.steps} checkpoint, not diverged): {names}")
    train_missing(args, missing)
    runs = [collect_run(args, *run) for run in runs_of_study]
    summary = aggregate(args, runs)
    folder = write_report(args, runs, summary, argv, time.perf_counter() - start)
    print(markdown_table(args, summary))
    print(f"written to {folder}", flush=True)
    return folder


if __name__ == "__main__":
    main()
