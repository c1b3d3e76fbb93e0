"""One metrics stream, fanned out: JSONL (always), console, wandb, TensorBoard.

Only rank 0 writes. `metrics.jsonl` holds one JSON object per line with a `kind` ("train",
"eval", "quant", "event") and the `step`; on resume, lines past the resumed step (written by the
interrupted run after its last checkpoint) are dropped, and a train or eval record of a step already
in the file is not written again (a rerun of a finished run), so the file reads as one clean history
of the branch that resumed: one train record per step, one eval record per evaluated step. A resume
from an older checkpoint first copies the lines past its step beside the checkpoints it sets aside
(`copy_rows_after`), so the abandoned branch's history is kept out of the live file, not lost.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .console import StepLine

log = logging.getLogger("nemofp4")

METRICS_FILE = "metrics.jsonl"


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go and how often."""

    log_interval: int = 1
    """Console line / progress refresh every this many steps (JSONL gets every step)."""
    console: bool = True
    wandb: bool = True
    """Log to Weights & Biases (offline by default: no network needed, sync later with `wandb sync`)."""
    wandb_mode: str = "offline"
    """offline | online | disabled."""
    wandb_project: str = "nemofp4"
    wandb_entity: str = ""
    tensorboard: bool = False
    plots: bool = True
    """Draw the loss curves into <run_dir>/plots/loss.png when training ends."""
    quant_stats_interval: int = 0
    """Log per-layer quantization statistics every this many steps (0: never)."""
    peak_tflops: float = 0.0
    """Peak dense BF16 TFLOP/s of one accelerator for MFU (0: looked up from the device name)."""

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logging.wandb_mode={self.wandb_mode!r}; valid: offline, online, disabled")
        if self.log_interval < 1:
            raise ValueError(f"logging.log_interval must be >= 1, got {self.log_interval}")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                "logging.tensorboard=true needs the tensorboard package, which is not installed: "
                "pip install 'nemofp4[tensorboard]' (or tensorboard), or set logging.tensorboard=false"
            )


# Dense BF16 tensor-core peaks (TFLOP/s), for MFU.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "GB200": 2500.0, "L40S": 362.0}


def peak_tflops(cfg: LoggingConfig) -> float:
    if cfg.peak_tflops > 0:
        return cfg.peak_tflops
    import torch

    if not torch.cuda.is_available():
        return 0.0
    name = torch.cuda.get_device_name()
    for key, value in _PEAK_TFLOPS.items():
        if key in name:
            return value
    return 0.0


UNIQUE_KINDS = ("train", "eval")
"""Kinds with at most one record per step."""


def _step_of_line(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:  # a line cut by a kill mid-write
        return None
    return record.get("step", 0) if isinstance(record, dict) else None


def copy_rows_after(path: Path, step: int, dest: Path) -> int:
    """Write the lines of `path` with step > `step` to `dest`, durably: an abandoned branch's rows, kept
    before the live file drops them. Returns how many (no file when none)."""
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if (_step_of_line(line) or 0) > step]
    if lines:
        with open(dest, "w") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
    return len(lines)


def truncate_after(path: Path, step: int) -> dict[tuple[str, int], dict[str, Any]]:
    """Drop lines with step > `step` (from a run interrupted after its last checkpoint) and repeated
    train/eval records of one step; returns the kept train/eval records by (kind, step)."""
    if not path.is_file():
        return {}
    kept, seen = [], {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
        if not isinstance(record, dict) or record.get("step", 0) > step:
            continue
        key = (record.get("kind"), record.get("step", 0))
        if key[0] in UNIQUE_KINDS:
            if key in seen:
                continue
            seen[key] = record
        kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return seen


class MetricsLogger:
    """Rank-0 fan-out of metrics; on other ranks every call is a no-op."""

    def __init__(
        self,
        run_dir: Path,
        cfg: LoggingConfig,
        *,
        rank: int,
        run_name: str,
        config: dict[str, Any],
        total_steps: int,
        resume_step: int = 0,
        wandb_id: str | None = None,
    ):
        self.cfg = cfg
        self.enabled = rank == 0
        self.total_steps = total_steps
        self.wandb_run = None
        self.tb = None
        self._step_line = StepLine(total_steps)
        self.wandb_id = wandb_id
        self.logged: dict[tuple[str, int], dict[str, Any]] = {}
        """Train and eval records already in the file, by (kind, step)."""
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        self.logged = truncate_after(self.path, resume_step)
        self._file = open(self.path, "a", buffering=1)
        if cfg.wandb and cfg.wandb_mode != "disabled":
            self._init_wandb(run_dir, run_name, config)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def _init_wandb(self, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        if self.wandb_id is None:
            self.wandb_id = secrets.token_hex(4)  # kept in checkpoints, so a resumed run continues it
        self.wandb_run = wandb.init(
            project=self.cfg.wandb_project,
            entity=self.cfg.wandb_entity or None,
            name=run_name,
            id=self.wandb_id,
            resume="allow",
            dir=str(run_dir),
            mode=self.cfg.wandb_mode,
            config=config,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, kind: str, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if kind in UNIQUE_KINDS:
            if (kind, step) in self.logged:
                return  # this step's record is already in the history (a rerun of a finished run)
            self.logged[(kind, step)] = {"kind": kind, "step": step, **metrics}
        record = {"kind": kind, "step": step, **metrics}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        flat = {f"{kind}/{k}": v for k, v in _flatten(metrics).items() if isinstance(v, (int, float))}
        if self.wandb_run is not None:
            self.wandb_run.log(flat, step=step)
        if self.tb is not None:
            for k, v in flat.items():
                self.tb.add_scalar(k, v, step)
        if kind == "train":
            self._step_line.update(metrics.get("step_time_s", math.nan))
        if self.cfg.console and kind == "train" and (step % self.cfg.log_interval == 0 or step == self.total_steps):
            print(self._step_line.format(step, metrics), flush=True)
        elif self.cfg.console and kind == "eval":
            print(
                f"[eval] step {step:>6}  val_loss {metrics['val_loss']:.4f}  val_ppl {metrics['val_ppl']:.2f}",
                flush=True,
            )

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            # Stop wandb's service process now rather than at interpreter exit: after a requeue, Slurm
            # signals every process of the step, and a service killed then fails that teardown.
            import wandb

            wandb.teardown()
        if self.tb is not None:
            self.tb.close()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def quant_role_summary(layers: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per operand role, over the FP4 linears of one quant record (``{fqn: {'<role>/<stat>': value}}``):
    the mean of each block fraction, and for ``amax_ratio`` (rho = current / held amax, see
    :mod:`nemofp4.quant.stats`) its min, mean and max, since one layer past its reference is what
    saturates. Layers without a stat (e.g. current scaling has no rho) do not count towards it."""
    values: dict[str, dict[str, list[float]]] = {}
    for layer in layers.values():
        for key, value in layer.items():
            role, _, stat = key.partition("/")
            values.setdefault(role, {}).setdefault(stat, []).append(float(value))
    out: dict[str, dict[str, float]] = {}
    for role, stats in values.items():
        row = out[role] = {}
        for stat, vs in stats.items():
            if stat == "amax_ratio":
                row.update(amax_ratio_min=min(vs), amax_ratio_mean=math.fsum(vs) / len(vs), amax_ratio_max=max(vs))
            else:
                row[stat] = math.fsum(vs) / len(vs)
    return out


def read_metrics(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Parse `<run_dir>/metrics.jsonl` (optionally one kind)."""
    rows = [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines() if line]
    return [r for r in rows if kind is None or r.get("kind") == kind]
