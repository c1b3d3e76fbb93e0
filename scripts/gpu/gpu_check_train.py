"""The trainer's part of the GPU check: ``nemofp4-train``, an exact resume and ``nemofp4-eval``.

    python scripts/gpu/gpu_check_train.py WORK [--json FILE] [--rehearse] [--budget-s 170]

In WORK, each as its own process (``python -m``, as on a machine where nothing is installed):

1. ``experiment=tiny_ue5m3`` for 30 steps, checkpoints every 10, with ``train.sync_debug=error``: on
   CUDA, a host synchronization in forward, backward, clipping or the optimizer step of steps 2-30
   raises (then the run is repeated with ``sync_debug=warn``, which counts them, so that the steps below
   still run);
2. the same run killed after step 20 (``debug.sigkill_at_step``, its checkpoint written), then resumed
   to 30 by the same command: its losses and gradient norms must equal the first run's, bit for bit;
3. ``nemofp4-eval`` of the first run's last checkpoint: held-out NLL and a multiple-choice task.

Prints a table (check | result | detail) and writes the rows and figures as JSON. ``--rehearse`` runs
the same on the CPU with smaller batches (scripts/gpu/gpu_check.sh --rehearse).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
STEPS, KILL_AT = 30, 20
TRAIN = [
    "experiment=tiny_ue5m3",
    f"train.max_steps={STEPS}",
    "checkpoint.interval=10",
    "eval.interval=0",
    "logging.wandb=false",
    "logging.plots=false",
    "logging.log_interval=10",
    "train.sync_debug=error",
]
REHEARSAL = [
    "train.seq_len=64",
    "train.global_batch=2",
    "train.micro_batch=2",
    "eval.num_sequences=4",
    "eval.batch_size=4",
    "train.kernels=eager",
]
"""The CPU rehearsal's smaller steps, on the eager quantizer (nemofp4.kernels takes Triton for CUDA tensors only;
the kernels equal it bit for bit, which tests/unit/test_kernels.py checks under the interpreter)."""
SYNC_ERROR = "called a synchronizing CUDA operation"
"""What torch.cuda.set_sync_debug_mode's error and warning say."""
EVAL = ["policy=current", f"tasks=[{REPO / 'data/tasks/austen_cloze.jsonl'}]", "task_limit=16"]

ROWS: list[tuple[str, str, str]] = []


def row(check: str, ok: bool | None, detail: str) -> bool:
    ROWS.append((check, {True: "ok", False: "FAILED", None: "skipped"}[ok], detail))
    print(f"  {check}: {ROWS[-1][1]}  [{detail}]", flush=True)
    return bool(ok)


def run(name: str, args: list[str], work: Path, deadline: float) -> tuple[int, float]:
    """One CLI process; its output goes to WORK/<name>.log. Returns (exit code, seconds)."""
    start = time.monotonic()
    with open(work / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(
                [sys.executable, "-m", *args],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=max(deadline - time.monotonic(), 1),
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - start


def last_error(work: Path, name: str) -> str:
    lines = [line for line in (work / f"{name}.log").read_text(errors="replace").splitlines() if line.strip()]
    return (lines or [""])[-1][-200:]


def train_records(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    return {r["step"]: r for r in records if r.get("kind") == "train"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rehearse", action="store_true", help="on the CPU, smaller steps")
    parser.add_argument("--budget-s", type=float, default=170.0, help="all three processes together")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = TRAIN + (REHEARSAL if args.rehearse else [])
    results: dict = {"device": device, "overrides": overrides}
    if device != "cuda" and not args.rehearse:
        row("device", False, "no CUDA device (use --rehearse on the CPU)")
        return finish(args.json, results)

    full, resumed = work / "full", work / "resumed"
    rc, seconds = run("train", ["nemofp4.train", *overrides, f"run_dir={full}"], work, deadline)
    if rc != 0 and SYNC_ERROR in (work / "train.log").read_text(errors="replace"):
        # a host sync in the step: train the reference again with warnings, to list every sync and still
        # check the resume and the evaluation
        first = last_error(work, "train")
        overrides = [o.replace("sync_debug=error", "sync_debug=warn") for o in overrides]
        shutil.rmtree(full, ignore_errors=True)
        rc, seconds = run("train_warn", ["nemofp4.train", *overrides, f"run_dir={full}"], work, deadline)
        syncs = (work / "train_warn.log").read_text(errors="replace").count(SYNC_ERROR)
        results["host_syncs"] = {"error": first, "warnings_steps_2_to_30": syncs}
        row("host syncs in steps 2-30", False, f"{syncs} call sites warned with sync_debug=warn; {first}")
    records = train_records(full)
    times = [records[s]["step_time_s"] for s in range(2, STEPS + 1) if s in records]
    results["train"] = {"rc": rc, "wall_s": seconds, "steps": len(records), "overrides": overrides}
    if records:
        last = records[max(records)]
        results["train"].update(
            loss=last["loss"],
            median_step_s=statistics.median(times) if times else None,
            tokens_per_s=last["tokens_per_s"],
        )
    detail = (
        f"{device}, {len(records)} steps in {seconds:.0f} s, loss {records[max(records)]['loss']:.4f}, "
        f"median step {1e3 * statistics.median(times):.1f} ms"
        if rc == 0 and times
        else f"exit {rc}: {last_error(work, 'train')}"
    )
    mode = "warn" if "host_syncs" in results else "error"
    row(f"train {STEPS} steps, sync_debug={mode} from step 2", rc == 0 and len(records) == STEPS, detail)

    rc_kill, _ = run(
        "train_killed",
        ["nemofp4.train", *overrides, f"run_dir={resumed}", f"debug.sigkill_at_step={KILL_AT}"],
        work,
        deadline,
    )
    killed = rc_kill in (-9, 137) and (resumed / "checkpoints" / f"step-{KILL_AT}").is_dir()
    row(
        f"killed after step {KILL_AT}",
        killed,
        f"exit {rc_kill}, checkpoint step-{KILL_AT}"
        if killed
        else f"exit {rc_kill}: {last_error(work, 'train_killed')}",
    )
    rc_resume, seconds = run("train_resumed", ["nemofp4.train", *overrides, f"run_dir={resumed}"], work, deadline)
    again = train_records(resumed)
    row(
        f"resumed {KILL_AT} -> {STEPS}",
        rc_resume == 0 and max(again, default=0) == STEPS,
        f"{seconds:.0f} s" if rc_resume == 0 else f"exit {rc_resume}: {last_error(work, 'train_resumed')}",
    )
    pairs = [(records[s], again[s]) for s in range(1, STEPS + 1) if s in records and s in again]
    same = [a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in pairs]
    first_diff = next((s for s, ok in zip(range(1, STEPS + 1), same) if not ok), None)
    max_diff = max((abs(a["loss"] - b["loss"]) for a, b in pairs), default=float("nan"))
    results["resume"] = {
        "kill_rc": rc_kill,
        "resume_rc": rc_resume,
        "steps_compared": len(pairs),
        "bitwise_equal_steps": sum(same),
        "first_differing_step": first_diff,
        "max_abs_loss_diff": max_diff,
    }
    row(
        "resume exact (loss, grad norm)",
        len(pairs) == STEPS and all(same),
        f"{sum(same)}/{STEPS} steps bitwise equal"
        + (f"; first differs at {first_diff}, max |dloss| {max_diff:.3g}" if first_diff else ""),
    )

    out = work / "eval.json"
    kernels = ["kernels=eager"] if args.rehearse else []
    rc, seconds = run(
        "eval", ["nemofp4.cli.evaluate", f"checkpoint={full}", *EVAL, *kernels, f"out={out}"], work, deadline
    )
    evaluation = json.loads(out.read_text()) if rc == 0 and out.exists() else {}
    results["eval"] = {"rc": rc, "wall_s": seconds, "results": evaluation}
    row(
        "nemofp4-eval (policy=current)",
        rc == 0 and bool(evaluation),
        f"{seconds:.0f} s, {summarize_eval(evaluation)}" if rc == 0 else f"exit {rc}: {last_error(work, 'eval')}",
    )
    return finish(args.json, results)


def summarize_eval(results: dict) -> str:
    """The headline figures of nemofp4-eval's JSON: held-out loss and each task's accuracy."""
    parts = []
    for key, value in sorted(_flatten(results).items()):
        if key.rsplit(".", 1)[-1] in ("val_loss", "nll", "acc", "accuracy") and isinstance(value, float):
            parts.append(f"{key} {value:.4f}")
    return ", ".join(parts[:4]) or "no figures"


def _flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def finish(json_path: Path | None, results: dict) -> int:
    results["rows"] = ROWS
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(result != "FAILED" for _, result, _ in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
