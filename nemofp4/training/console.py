"""The trainer's console: the step line and the end-of-run summary.

The step line's ETA comes from a moving average of recent step times, not from the time since
start: the first step of a process pays for compilation and warm-up (tens of seconds for a
2-minute run), and including it would overstate the rest of the run. Memory is the resident
set size on CPU and the peak allocated CUDA memory on GPU.
"""

from __future__ import annotations

import math
import os
import resource
from collections import deque
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepLine", "format_duration", "memory_record", "run_summary"]


def memory_record(device: torch.device) -> dict[str, float]:
    """``peak_memory_gib`` (max allocated) on CUDA, ``rss_gib`` (resident set) on CPU."""
    if device.type == "cuda":
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    return {"rss_gib": _rss_bytes() / 2**30}


def _rss_bytes() -> int:
    try:  # current resident set: /proc/self/statm's second field, in pages
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: the peak is what is available
        scale = 1 if os.uname().sysname == "Darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def format_duration(seconds: float) -> str:
    """``H:MM:SS``, or ``?`` for an unknown duration."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StepLine:
    """Formats the console line of a training step; fed every step, printed every log interval.

    The ETA is the mean of the last ``window`` step times times the steps left. The first step
    of the process is left out of the mean once a second one exists (it carries compilation).
    """

    def __init__(self, total_steps: int, *, window: int = 20) -> None:
        self.total_steps = total_steps
        self.times: deque[float] = deque(maxlen=window)
        self._first: float | None = None

    def update(self, step_time_s: float) -> None:
        if self._first is None:
            self._first = step_time_s
        else:
            self.times.append(step_time_s)

    def seconds_per_step(self) -> float:
        if self.times:
            return sum(self.times) / len(self.times)
        return self._first if self._first is not None else math.nan

    def eta_seconds(self, step: int) -> float:
        return self.seconds_per_step() * max(self.total_steps - step, 0)

    def format(self, step: int, m: dict[str, Any]) -> str:
        parts = [
            f"step {step:>6}/{self.total_steps}",
            f"loss {m['loss']:.4f}",
            f"grad_norm {m['grad_norm']:.3f}",
            f"lr {m['lr']:.2e}",
            f"tok/s {m['tokens_per_s']:,.0f}",
        ]
        if m.get("mfu"):
            parts.append(f"mfu {m['mfu']:.1%}")
        if "peak_memory_gib" in m:
            parts.append(f"mem {m['peak_memory_gib']:.2f} GiB max alloc")
        elif "rss_gib" in m:
            parts.append(f"rss {m['rss_gib']:.2f} GiB")
        if m.get("skipped"):
            parts.append("SKIPPED (non-finite)")
        parts.append(f"eta {format_duration(self.eta_seconds(step))}")
        return "  ".join(parts)


def run_summary(
    *,
    run_dir: Path,
    records: list[dict[str, Any]],
    first_step: int,
    step: int,
    total_steps: int,
    tokens_seen: int,
    wall_s: float,
    stop_reason: str,
    checkpoint: Path | None,
    plot: Path | None,
) -> str:
    """A few lines that close a run: what ran, how fast, where it ended, where the files are.

    ``records`` are the run's metrics.jsonl rows; only this process's steps count for speed.
    """
    train = [r for r in records if r.get("kind") == "train" and first_step < r.get("step", 0) <= step]
    evals = [r for r in records if r.get("kind") == "eval" and r.get("step", -1) <= step]
    loop_s = sum(r.get("step_time_s", 0.0) for r in train)
    tokens_here = sum(r.get("tokens_per_s", 0.0) * r.get("step_time_s", 0.0) for r in train)
    resumed = f" (resumed at step {first_step})" if first_step else ""
    how = {"budget": "finished", "preempted": "stopped on a preemption signal; rerun the command to resume"}
    lines = [
        f"run {how.get(stop_reason, stop_reason)}: step {step}/{total_steps}{resumed}, {tokens_seen:,} tokens seen, "
        f"wall time {format_duration(wall_s)}",
    ]
    if train:
        rate = tokens_here / loop_s if loop_s > 0 else math.nan
        lines.append(
            f"  this run: {len(train)} steps, {tokens_here:,.0f} tokens in {format_duration(loop_s)} "
            f"of training steps, {rate:,.0f} tokens/s"
        )
        lines.append(
            f"  final train loss {train[-1]['loss']:.4f} (step {train[-1]['step']})"
            + (f", val loss {evals[-1]['val_loss']:.4f} (step {evals[-1]['step']})" if evals else "")
        )
    lines.append(f"  run directory: {run_dir.resolve()}")
    if checkpoint is not None:
        lines.append(f"  last checkpoint: {checkpoint.resolve()}")
    lines.append(f"  metrics: {(run_dir / 'metrics.jsonl').resolve()}")
    if plot is not None:
        lines.append(f"  loss curves: {plot.resolve()}")
    return "\n".join(lines)
