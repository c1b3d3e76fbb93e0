"""scripts/study/lr_sweep.py on a very short budget (2 recipes x 2 LRs x 1 seed, 3 steps, two workers): trains,
writes a results JSON, table and plots that agree with the runs' own metrics; a rerun trains nothing."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script

SMALL = [
    "train.seq_len=64",
    "train.global_batch=4",
    "train.micro_batch=4",
    "eval.num_sequences=8",
    "eval.batch_size=4",
    "checkpoint.interval=0",
    "schedule.warmup_steps=1",
    "logging.quant_stats_interval=1",
    "train.kernels=eager",
]  # the quantizer's compile would take longer than these runs


def _script():
    return load_script("scripts/study/lr_sweep.py")


def _argv(base, study, *extra):
    argv = [
        "--study",
        study,
        "--steps",
        "3",
        "--runs-root",
        str(base / "runs"),
        "--out",
        str(base / "out"),
        "--threads",
        "1",
        *extra,
    ]
    for override in SMALL:
        argv += ["--train-override", override]
    return argv


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    base = tmp_path_factory.mktemp("sweep")
    argv = _argv(
        base,
        "smoke",
        "--recipes",
        "bf16",
        "ue5m3",
        "--lrs",
        "1e-3",
        "1e-2",
        "--seeds",
        "1",
        "--workers",
        "2",
        "--staleness-recipes",
        "ue5m3",
        "--staleness-lr",
        "1e-2",
    )
    _script().main(argv)
    return base, argv


def test_sweep_writes_results_table_and_plots_consistent_with_the_runs(sweep):
    base, _ = sweep
    folder = base / "out" / "smoke"
    results = json.loads((folder / "results.json").read_text())
    assert {(r["recipe"], r["lr"]) for r in results["runs"]} == {
        (a, b) for a in ("bf16", "ue5m3") for b in (1e-3, 1e-2)
    }
    sw = _script()
    for run in results["runs"]:
        path = base / "runs" / "smoke" / run["recipe"] / f"lr-{run['lr']:g}" / "seed-1"
        evals = {r["step"]: r["val_loss"] for r in sw.read_rows(path, "eval")}
        assert run["status"] == "finished" and run["final_nll"] == evals[3] and run["init_nll"] == evals[0]
        assert max(r["lr"] for r in sw.read_rows(path, "train")) == run["lr"]  # the LR reached the run (peak)
        config = (path / "config.yaml").read_text()
        assert f"lr: {run['lr']}" in config
    # the trainer's quant rows: per layer, and per role over the layers, rho included for ue5m3's held references
    from nemofp4.training.metrics import quant_role_summary

    quant = sw.read_rows(base / "runs" / "smoke" / "ue5m3" / "lr-0.01" / "seed-1", "quant")
    assert [r["step"] for r in quant] == [1, 2, 3]
    assert all(r["roles"] == quant_role_summary(r["layers"]) for r in quant)
    assert quant[0]["roles"]["x"]["amax_ratio_max"] == 1.0  # sampled at step 1: current == held
    table = results["summary"]["table"]
    for recipe, row in table.items():
        nll = {r["lr"]: r["final_nll"] for r in results["runs"] if r["recipe"] == recipe}
        assert row["sensitivity"][0] == pytest.approx(sum(nll.values()) / 2 - min(nll.values()))
    readme = (folder / "README.md").read_text()
    assert "python scripts/study/lr_sweep.py --study smoke" in readme and "| `ue5m3` |" in readme
    assert "| `ue5m3` | x | " in readme  # the staleness table of the delayed comparison
    for png in ("nll_vs_lr.png", "lr_sensitivity.png", "staleness.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_trains_nothing(sweep):
    base, argv = sweep
    metrics = base / "runs" / "smoke" / "ue5m3" / "lr-0.01" / "seed-1" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    _script().main([*argv, "--launcher", "none"])
    assert metrics.stat().st_mtime_ns == before
    with pytest.raises(SystemExit, match="not finished"):
        _script().main([*argv, "--launcher", "none", "--lrs", "1e-3", "1e-2", "3e-2"])
