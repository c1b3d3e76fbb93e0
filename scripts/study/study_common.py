"""What the study scripts (compare_recipes.py, lr_sweep.py) share: launching a training run here or
through SLURM, telling a finished run, reading its metrics, evaluating its final checkpoint, and the
statistics and curve helpers of their reports. One implementation; the scripts only say which runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

COLORS = {
    "bf16": "black",
    "nvfp4": "tab:blue",
    "ue5m3": "tab:red",
    "ue5m3_te_settings": "tab:orange",
    "nvfp4_all_fp4_no_rht": "tab:purple",
    "mxfp4": "tab:green",
    "nvfp4_delayed": "tab:cyan",
}


# ----------------------------------------------------------------------------------------- runs
def add_run_arguments(p: argparse.ArgumentParser, *, steps: int, runs_root: Path, local_launch: str) -> None:
    """The arguments every study takes to train and find its runs: the budget, extra trainer overrides, where
    runs and results go, and how missing runs are launched (``local_launch``: what ``local`` does)."""
    p.add_argument("--steps", type=int, default=steps, help="train.max_steps of every run (the budget)")
    p.add_argument(
        "--train-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra trainer override for every run (repeatable), e.g. train.seq_len=128",
    )
    p.add_argument("--runs-root", type=Path, default=runs_root)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "results")
    p.add_argument(
        "--launcher",
        choices=("local", "slurm", "none"),
        default="local",
        help=f"local: train missing runs here, {local_launch}; slurm: submit them with nemofp4-launch "
        "and stop; none: only collect runs that exist",
    )
    p.add_argument(
        "--slurm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra nemofp4-launch override (repeatable), e.g. slurm.partition=batch",
    )


def display_path(path: Path) -> str:
    """Paths inside the repository are recorded relative to it, so committed results name no machine."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def is_finished(path: Path, steps: int) -> bool:
    """The run reached the budget: a final checkpoint of that step exists."""
    return (path / "checkpoints" / f"step-{steps}" / "COMPLETE.json").is_file()


def train_command(path: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "nemofp4.train", *overrides, f"run_dir={path}"]


def train_local(path: Path, overrides: list[str], *, label: str, threads: int = 0) -> int:
    """Train one run here (appending its output to ``<path>/train.log``); returns the exit status."""
    path.mkdir(parents=True, exist_ok=True)
    cmd = train_command(path, overrides)
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    print(f"[train] {label}: {shlex.join(cmd)}", flush=True)
    with open(path / "train.log", "a") as log:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    status = "done" if proc.returncode == 0 else f"exit {proc.returncode}"
    print(f"[train] {label}: {status} in {time.perf_counter() - start:.0f} s", flush=True)
    return proc.returncode


def submit_slurm(path: Path, overrides: list[str], *, job_name: str, slurm_args: list[str]) -> None:
    """Submit one run with ``nemofp4-launch``; ``overrides[0]`` must be ``experiment=<name>``."""
    key, experiment = overrides[0].split("=", 1)
    if key != "experiment":
        raise ValueError(f"the first override must be experiment=<name>, got {overrides[0]!r}")
    cmd = [
        sys.executable,
        "-m",
        "nemofp4.cli.launch",
        f"experiment={experiment}",
        f"run_dir={path}",
        "train_overrides=[" + ",".join(json.dumps(o) for o in overrides[1:]) + "]",
        f"slurm.job_name={job_name}",
        *slurm_args,
    ]
    print(f"[slurm] {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)


# ----------------------------------------------------------------------------------------- metrics
def read_rows(path: Path, kind: str) -> list[dict]:
    """The run's ``metrics.jsonl`` records of one kind, one per step (a resumed run's repeat: the last)."""
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {}
    for row in rows:
        if row.get("kind") == kind:
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def evaluate_checkpoint(
    path: Path,
    *,
    step: int,
    policies: list[str],
    delay: int,
    calibration_sequences: int,
    cache_name: str = "compare_eval.json",
) -> dict[str, float]:
    """Held-out NLL of the run's step-``step`` checkpoint under each inference policy (cached in the run folder)."""
    cache = path / cache_name
    key = {"step": step, "policies": list(policies), "delay": delay, "C": calibration_sequences}
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return saved["nll"]
    from nemofp4.evaluation import EvalSession, InferencePolicy, validation_nll

    session = EvalSession.open(path / "checkpoints" / f"step-{step}", device="auto")
    batches = session.validation_batches(session.data_config("checkpoint"))
    nll = {}
    for name in policies:
        policy = InferencePolicy(name=name, delay=delay, calibration_sequences=calibration_sequences)
        with session.policy_forward(policy) as forward:
            nll[name] = validation_nll(forward, batches, device=session.device)["val_loss"]
    cache.write_text(json.dumps({"key": key, "nll": nll}, indent=1) + "\n")
    return nll


# ----------------------------------------------------------------------------------------- statistics
def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def moving_average(values: list[float], width: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= width:
            acc -= values[i - width]
        out.append(acc / min(i + 1, width))
    return out


def mean_curve(runs: list[dict], xkey: str, ykey: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Over the steps every run logged: the mean, min and max of ``ykey`` across runs."""
    common = sorted(set.intersection(*(set(r[xkey]) for r in runs)))
    per_run = [dict(zip(r[xkey], r[ykey])) for r in runs]
    ys = [[c[x] for c in per_run] for x in common]
    return common, [statistics.fmean(v) for v in ys], [min(v) for v in ys], [max(v) for v in ys]


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
