"""scripts/study/compare_recipes.py on a very short budget (4 steps, 2 recipes, 1 seed): trains, evaluates every policy, writes the
table, results and plots; a second invocation collects the finished runs without retraining."""

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
    "eval.interval=2",
    "checkpoint.interval=0",
    "schedule.warmup_steps=2",
]


def _script():
    return load_script("scripts/study/compare_recipes.py")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    base = tmp_path_factory.mktemp("study")
    argv = [
        "--study",
        "smoke",
        "--recipes",
        "bf16",
        "ue5m3",
        "--seeds",
        "1",
        "--steps",
        "4",
        "--runs-root",
        str(base / "runs"),
        "--out",
        str(base / "out"),
        "--calibration-sequences",
        "2",
        "--delay",
        "1",
        "--window",
        "3",
        "--threads",
        "1",
    ]
    for override in SMALL:
        argv += ["--train-override", override]
    _script().main(argv)
    return base, argv


def test_study_writes_table_results_and_plots(study):
    base, argv = study
    folder = base / "out" / "smoke"
    results = json.loads((folder / "results.json").read_text())
    table = results["summary"]["table"]
    assert set(table) == {"bf16", "ue5m3"}
    for run in results["runs"]:
        assert run["steps"] == list(range(1, 5))
        assert run["final_loss"] == pytest.approx(sum(run["loss"][-3:]) / 3)
        # delay=1 makes delayed replay the current policy; BF16 has no FP4 linear so all its policies agree.
        assert run["nll"]["delayed"] == run["nll"]["current"]
        if run["recipe"] == "bf16":
            assert len(set(run["nll"].values())) == 1
        else:
            assert run["nll"]["unquantized"] != run["nll"]["current"]
        after = results["summary"]["spike_after_step"]
        expected = sum(g > 1.0 for s, g in zip(run["steps"], run["grad_norm"]) if s > after)
        assert run["grad_norm_spikes"] == expected
    assert table["bf16"]["gap_to_bf16"] == [0.0, 0.0]
    ue = [r for r in results["runs"] if r["recipe"] == "ue5m3"][0]
    bf = [r for r in results["runs"] if r["recipe"] == "bf16"][0]
    assert table["ue5m3"]["gap_to_bf16"][0] == pytest.approx(
        (ue["nll"]["current"] - bf["nll"]["current"]) / bf["nll"]["current"]
    )
    readme = (folder / "README.md").read_text()
    assert "python scripts/study/compare_recipes.py --study smoke" in readme and "| `ue5m3` |" in readme
    for png in ("training_loss.png", "validation_nll.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_second_invocation_collects_without_retraining(study):
    base, argv = study
    metrics = base / "runs" / "smoke" / "ue5m3" / "seed-1" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    _script().main([*argv, "--launcher", "none"])
    assert metrics.stat().st_mtime_ns == before
    with pytest.raises(SystemExit, match="not finished"):
        _script().main([*argv, "--launcher", "none", "--steps", "5"])
