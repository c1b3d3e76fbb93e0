"""nemofp4-eval end to end on a freshly trained checkpoint: loading, the results files, and the
validation NLL reproducing the trainer's own eval exactly under current scaling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemofp4.evaluation import (
    EvalSession,
    EvaluateConfig,
    evaluate,
    load_checkpoint_model,
    resolve_checkpoint,
)
from nemofp4.quant import quant_linears
from nemofp4.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "data" / "tasks" / "austen_cloze.jsonl"
SMALL = [
    "train.seq_len=64",
    "train.global_batch=4",
    "train.micro_batch=4",
    "eval.num_sequences=8",
    "eval.batch_size=4",
    "logging.wandb=false",
    "logging.console=false",
]


def train_tiny(run_dir: Path, *overrides: str) -> None:
    """A few steps of the tiny model, in this process."""
    from nemofp4.cli.train import compose_job_config
    from nemofp4.training.trainer import train

    cfg = compose_job_config(["model=tiny", "data=tiny", *SMALL, f"run_dir={run_dir}", *overrides])
    summary = train(cfg)
    assert summary["stop_reason"] == "budget", summary


@pytest.fixture(scope="module")
def nvfp4_run(tmp_path_factory):
    # NVFP4 uses current scaling, so the trainer's eval is exactly the 'current' policy.
    run = tmp_path_factory.mktemp("eval") / "nvfp4"
    # trained on the eager quantizer (no compile in the training process); the evaluation compiles,
    # so the val-loss comparison below also holds the two paths together
    train_tiny(
        run,
        "precision=nvfp4",
        "precision.num_bf16_last_layers=2",
        "train.max_steps=3",
        "logging.quant_stats_interval=1",
        "train.kernels=eager",
    )
    return run


def test_checkpoint_is_found_from_run_dir_checkpoints_dir_or_step_folder(nvfp4_run):
    step = nvfp4_run / "checkpoints" / "step-3"
    for path in (nvfp4_run, nvfp4_run / "checkpoints", step):
        assert resolve_checkpoint(path) == step
    model, job, state = load_checkpoint_model(nvfp4_run)
    assert state["step"] == 3 and job.precision.name == "nvfp4" and not model.training
    assert len(quant_linears(model)) > 0  # the run's recipe is applied
    plain, _, _ = load_checkpoint_model(step, precision="bf16")
    assert not quant_linears(plain)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_checkpoint(nvfp4_run.parent)  # a folder with no checkpoint in it
    with pytest.raises(FileNotFoundError, match="no such"):
        resolve_checkpoint(nvfp4_run / "nope")


def test_eval_command_writes_json_and_markdown_and_matches_the_trainers_val_loss(nvfp4_run, tmp_path):
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "nemofp4.cli.evaluate",
        f"checkpoint={nvfp4_run}",
        "policy=current",
        f"tasks=[{TASK}]",
        "task_limit=4",
        "task_batch_size=4",
        f"out={out}",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    trainer_final = [r for r in read_metrics(nvfp4_run, "eval") if r["step"] == 3][0]
    assert results["val_loss"] == trainer_final["val_loss"]
    assert results["step"] == 3 and results["policy"] == "current" and results["recipe"] == "nvfp4"
    task = results["tasks"]["austen_cloze"]
    assert task["num_items"] == 4 and 0.0 <= task["acc"] <= 1.0 and 0.0 <= task["acc_norm"] <= 1.0
    markdown = out.with_suffix(".md").read_text()
    assert f"{results['val_loss']:.5f}" in markdown and "austen_cloze acc" in markdown


def test_policies_through_the_python_api(nvfp4_run):
    base = dict(checkpoint=str(nvfp4_run), calibration_sequences=4, delay=1, device="cpu")
    current = evaluate(EvaluateConfig(policy="current", **base))
    delayed = evaluate(EvaluateConfig(policy="delayed", **base))
    calibrated = evaluate(EvaluateConfig(policy="calibrated", **base))
    unquantized = evaluate(EvaluateConfig(policy="unquantized", **base))
    assert delayed["val_loss"] == current["val_loss"]  # D = 1 is current scaling
    assert calibrated["val_loss"] != current["val_loss"]
    assert unquantized["val_loss"] != current["val_loss"]
    assert evaluate(EvaluateConfig(val_data="none", **base)).keys().isdisjoint({"val_loss"})


def test_the_kernels_knob_reaches_every_fp4_linear_and_keeps_the_numerics(nvfp4_run):
    """kernels=eager (as train.kernels): every FP4 linear of the loaded model quantizes with it, and the
    validation NLL is the trainer's, which ran eagerly too (the CLI test above holds the compiled path)."""
    cfg = EvaluateConfig(checkpoint=str(nvfp4_run), policy="current", device="cpu", kernels="eager")
    session = EvalSession.open(cfg.checkpoint, device=cfg.device, kernels=cfg.kernels)
    assert {m.quant_backend for _, m in quant_linears(session.model)} == {"eager"}
    trainer_final = [r for r in read_metrics(nvfp4_run, "eval") if r["step"] == 3][0]
    assert evaluate(cfg, session)["val_loss"] == trainer_final["val_loss"]
    with pytest.raises(ValueError, match="kernels='gpu'; valid: auto, triton, native, compiled, eager"):
        EvaluateConfig(checkpoint=str(nvfp4_run), kernels="gpu")


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nemofp4.cli.evaluate", f"checkpoint={tmp_path / 'none'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "no such step folder or run directory" in proc.stderr


def test_lm_eval_model_name_loads_the_checkpoint(nvfp4_run, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from nemofp4.evaluation.lm_eval_adapter import LOCAL_TASKS_DIR

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = lm_eval.simple_evaluate(
        model="nemofp4",
        model_args={"checkpoint": str(nvfp4_run), "policy": "current"},
        batch_size=8,
        tasks=["austen_cloze"],
        task_manager=TaskManager(include_path=str(LOCAL_TASKS_DIR), include_defaults=False),
        limit=2,
        bootstrap_iters=0,
        log_samples=False,
    )
    builtin = evaluate(
        EvaluateConfig(
            checkpoint=str(nvfp4_run), val_data="none", tasks=[str(TASK)], task_limit=2, task_batch_size=8, device="cpu"
        )
    )
    assert out["results"]["austen_cloze"]["acc,none"] == builtin["tasks"]["austen_cloze"]["acc"]


def test_quant_plots_from_the_run(nvfp4_run, tmp_path):
    from tests.conftest import plot_script

    out = tmp_path / "plots"
    written = plot_script().main(
        [str(nvfp4_run), "--checkpoint", str(nvfp4_run), "--out", str(out), "--sequences", "2"]
    )
    assert [p.name for p in written] == ["nvfp4_blocks.png", "scale_exponents.png"]
    for path in written:
        assert path.read_bytes()[:4] == b"\x89PNG"
    histograms = json.loads((out / "scale_exponents.json").read_text())
    x = histograms["x"]
    assert len({entry["blocks"] for by_fmt in x.values() for entry in by_fmt.values()}) == 1  # the same blocks
    hist = {
        ref: {fmt: {int(e): c for e, c in entry["hist"].items()} for fmt, entry in by_fmt.items()}
        for ref, by_fmt in x.items()
    }
    current, grown, shrunk = (x[ref] for ref in ("current", "stale, tensor grew 8x", "stale, tensor shrank 1024x"))
    for fmt in ("ue5m3", "e4m3"):
        assert max(hist["current"][fmt]) <= 8 and current[fmt]["saturated"] == 0  # codes <= T = 448 < 2^9
    assert grown["e4m3"]["saturated"] > 0 and max(hist["stale, tensor grew 8x"]["e4m3"]) == 8  # clipped at 448
    assert grown["ue5m3"]["saturated"] == 0 and max(hist["stale, tensor grew 8x"]["ue5m3"]) >= 10  # up to 2^11.8
    # too large a reference: only codes below E4M3's 2^-9 become zero there; UE5M3 reaches 2^-17
    below = sum(c for e, c in hist["stale, tensor shrank 1024x"]["ue5m3"].items() if e < -9)
    assert shrunk["ue5m3"]["zero"] == 0 and shrunk["e4m3"]["zero"] <= below
