"""scripts/study/lr_sweep.py's numbers on synthetic runs: the LR sensitivity against a hand computation,
divergence capped at the initial NLL, and the staleness figure and table of the delayed comparison."""

import json

import pytest

from tests.conftest import load_script


def _sweep():
    return load_script("scripts/study/lr_sweep.py")


def _run(recipe, lr, seed, final, init=9.0):
    return {
        "recipe": recipe,
        "lr": lr,
        "seed": seed,
        "status": "finished" if final is not None else "diverged",
        "init_nll": init,
        "final_nll": final,
    }


def test_sensitivity_is_the_mean_gap_to_the_best_lr_with_divergence_capped_at_init():
    sw = _sweep()
    args = sw.parse_args(["--recipes", "bf16", "nvfp4", "--lrs", "0.1", "0.01", "0.03", "--seeds", "1", "2"])
    assert args.lrs == [0.01, 0.03, 0.1]
    runs = [
        _run("bf16", 0.01, 1, 5.0),
        _run("bf16", 0.03, 1, 5.5),
        _run("bf16", 0.1, 1, 6.5),
        _run("bf16", 0.01, 2, 5.2),
        _run("bf16", 0.03, 2, 5.1),
        _run("bf16", 0.1, 2, 9.5),  # above init: capped
        _run("nvfp4", 0.01, 1, 5.1),
        _run("nvfp4", 0.03, 1, 5.6),
        _run("nvfp4", 0.1, 1, None),  # diverged
        _run("nvfp4", 0.01, 2, 5.3),
        _run("nvfp4", 0.03, 2, 5.7),
        _run("nvfp4", 0.1, 2, None),
    ]
    table = sw.aggregate(args, runs)["table"]
    # seed 1: (0 + 0.5 + 1.5) / 3; seed 2: (0.1 + 0 + 3.9) / 3 (9.5 capped at the initial 9.0)
    assert table["bf16"]["sensitivity_per_seed"] == {"1": pytest.approx(2 / 3), "2": pytest.approx(4 / 3)}
    assert table["bf16"]["sensitivity"][0] == pytest.approx(1.0)
    assert table["nvfp4"]["sensitivity_per_seed"]["1"] == pytest.approx((0 + 0.5 + 3.9) / 3)
    assert table["nvfp4"]["per_lr"]["0.1"] == {"nll": (9.0, 0.0), "seeds": 2, "spread": 0.0, "diverged": 2}
    assert table["bf16"]["best_lr"] == 0.01 and table["bf16"]["best_nll"][0] == pytest.approx(5.1)
    assert "9.0000 ± 0.0000 (2 diverged)" in sw.markdown_table(args, {"table": table})


def test_extreme_seeds_train_only_at_the_ends_and_stay_out_of_the_sensitivity():
    sw = _sweep()
    args = sw.parse_args(
        ["--recipes", "bf16", "--lrs", "0.01", "0.03", "0.1", "--seeds", "1", "--extreme-seeds", "2", "3"]
    )
    assert sw.grid(args) == [
        ("bf16", 0.01, 1),
        ("bf16", 0.01, 2),
        ("bf16", 0.01, 3),
        ("bf16", 0.03, 1),
        ("bf16", 0.1, 1),
        ("bf16", 0.1, 2),
        ("bf16", 0.1, 3),
    ]
    runs = [
        _run("bf16", 0.01, 1, 5.0),
        _run("bf16", 0.01, 2, 5.25),
        _run("bf16", 0.01, 3, 4.75),
        _run("bf16", 0.03, 1, 5.5),
        _run("bf16", 0.1, 1, 6.5),
        _run("bf16", 0.1, 2, None),
        _run("bf16", 0.1, 3, 7.0),
    ]
    row = sw.aggregate(args, runs)["table"]["bf16"]
    assert row["sensitivity_per_seed"] == {"1": pytest.approx((0 + 0.5 + 1.5) / 3)}  # seed 1 alone has the grid
    assert row["per_lr"]["0.01"]["seeds"] == 3 and row["per_lr"]["0.01"]["spread"] == pytest.approx(0.5)
    assert row["per_lr"]["0.1"]["spread"] == pytest.approx(9.0 - 6.5) and row["per_lr"]["0.1"]["diverged"] == 1
    assert row["per_lr"]["0.03"]["seeds"] == 1
    table = sw.markdown_table(args, {"table": sw.aggregate(args, runs)["table"]})
    assert "seed spread @ lr 0.01 | seed spread @ lr 0.1 |" in table and "| 0.5000 | 2.5000 |" in table
    with pytest.raises(SystemExit):
        sw.parse_args(["--recipes", "bf16", "--lrs", "0.01", "--seeds", "1", "--extreme-seeds", "1"])


def test_bad_arguments_name_the_value(capsys):
    sw = _sweep()
    for argv, message in (
        (["--recipes", "bf16", "--lrs", "0.01", "0"], "--lrs must be positive"),
        (["--recipes", "bf16", "--lrs", "0.01", "--staleness-recipes", "ue5m3"], "not in --recipes"),
        (["--recipes", "bf16", "--lrs", "0.01", "--staleness-lr", "0.02"], "is not in the grid"),
        (["--recipes", "bf16", "bf16", "--lrs", "0.01"], "repeated value"),
        (["--recipes", "bf16", "fp3", "--lrs", "0.01"], "no experiment preset tiny_fp3 in configs/experiment"),
    ):
        with pytest.raises(SystemExit):
            sw.parse_args(argv)
        assert message in capsys.readouterr().err


def test_staleness_figure_and_table_from_quant_rows(tmp_path):
    sw = _sweep()
    args = sw.parse_args(
        [
            "--recipes",
            "ue5m3",
            "nvfp4",
            "--lrs",
            "0.01",
            "--seeds",
            "1",
            "--runs-root",
            str(tmp_path),
            "--study",
            "s",
            "--staleness-recipes",
            "ue5m3",
            "nvfp4",
        ]
    )
    held = {"x/saturated_blocks": 0.0, "x/underflow_blocks": 0.5, "x/amax_ratio": 2.0}
    for recipe, layers in (
        ("ue5m3", [held, {**held, "x/amax_ratio": 0.25}]),
        ("nvfp4", [{"x/saturated_blocks": 0.1, "x/underflow_blocks": 0.0}]),
    ):
        path = sw.run_dir(args, recipe, 0.01, 1)
        path.mkdir(parents=True)
        rows = [
            {"kind": "quant", "step": s, "layers": {f"l{i}": layer for i, layer in enumerate(layers)}} for s in (5, 10)
        ]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = sw.staleness_table(args).splitlines()
    assert "| `ue5m3` | x | 2 | 0.000 % | 50.000 % |" in table
    assert "| `nvfp4` | x | — (current scaling) | 10.000 % | 0.000 % |" in table
    rows = {r: sw.plot_quant_stats.quant_rows(sw.run_dir(args, r, 0.01, 1)) for r in args.staleness_recipes}
    assert sw.plot_quant_stats.staleness_series(rows["ue5m3"])["x"] == [(5, 0.25, 1.125, 2.0), (10, 0.25, 1.125, 2.0)]
    path = sw.plot_quant_stats.plot_staleness(rows, tmp_path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_run_stopped_on_a_non_finite_loss_is_recorded_as_diverged_and_other_failures_stop_the_sweep(
    tmp_path, monkeypatch
):
    sw = _sweep()
    args = sw.parse_args(
        ["--recipes", "bf16", "--lrs", "1", "--seeds", "1", "--runs-root", str(tmp_path), "--study", "s"]
    )
    path = sw.run_dir(args, "bf16", 1.0, 1)

    def failing(message):
        def train(path_, overrides, **_):
            assert "optim.lr=1.0" in overrides
            path_.mkdir(parents=True, exist_ok=True)
            (path_ / "train.log").write_text(message)
            return 1

        return train

    monkeypatch.setattr(
        sw.study_common,
        "train_local",
        failing("nemofp4.training.nonfinite.NonFiniteError: step 7: non-finite loss (nan)"),
    )
    sw.train_missing(args, [("bf16", 1.0, 1)])
    assert sw.is_done(args, path) and sw.has_diverged(path)
    rows = [{"kind": "eval", "step": 0, "val_loss": 9.0}, {"kind": "train", "step": 1, "loss": 9.0, "step_time_s": 0.5}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = sw.collect_run(args, "bf16", 1.0, 1)
    assert run["status"] == "diverged" and run["final_nll"] is None and sw.capped_nll(run) == 9.0
    assert run["train_time_s"] == 0.5
    other = sw.run_dir(args, "bf16", 1.0, 2)
    monkeypatch.setattr(sw.study_common, "train_local", failing("ValueError: optim.lr=..."))
    with pytest.raises(SystemExit, match="failed"):
        sw.train_local(args, "bf16", 1.0, 2)
    assert not sw.is_done(args, other)


def test_the_report_keeps_the_hand_written_reading(tmp_path):
    sw = _sweep()
    args = sw.parse_args(
        ["--recipes", "bf16", "--lrs", "0.01", "0.1", "--seeds", "1", "--out", str(tmp_path), "--study", "s"]
    )
    runs = [_run("bf16", 0.01, 1, 5.0), _run("bf16", 0.1, 1, 6.0)]
    summary = sw.aggregate(args, runs)
    folder = tmp_path / "s"
    folder.mkdir()
    reading = sw.READING_MARKER + "\n\n## Reading\n\nBF16 prefers 0.01.\n"
    (folder / "README.md").write_text("# draft\n\n" + reading)
    sw.write_report(args, runs, summary, ["--study", "s"], 1.0)
    text = (folder / "README.md").read_text()
    assert text.startswith("# Learning-rate sweep: `s`") and text.endswith(reading) and "# draft" not in text
    assert "| `bf16` | 5.0000 | 6.0000 | 0.01 | 0.5000 |" in text  # one seed: no spread shown
    sw.write_report(args, runs, summary, ["--study", "s"], 1.0)  # collected again: still one reading
    assert (folder / "README.md").read_text().count(sw.READING_MARKER) == 1
    assert (folder / "nll_vs_lr.png").is_file() and (folder / "lr_sensitivity.png").is_file()
