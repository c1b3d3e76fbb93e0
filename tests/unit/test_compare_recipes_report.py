"""compare_recipes' report on synthetic runs: a budget inside the warmup, seed bands, --replot."""

import json

from tests.conftest import load_script


def _script():
    return load_script("scripts/study/compare_recipes.py")


def _runs(steps: int, warmup: int) -> list[dict]:
    runs = []
    for recipe, offset in (("bf16", 0.0), ("ue5m3", 0.05)):
        for seed in (1, 2):
            loss = [5.0 - 0.01 * s + offset * seed + 0.01 * seed for s in range(1, steps + 1)]
            runs.append(
                {
                    "recipe": recipe,
                    "seed": seed,
                    "warmup_steps": warmup,
                    "steps": list(range(1, steps + 1)),
                    "loss": loss,
                    "grad_norm": [0.5] * steps,
                    "eval_steps": [0, steps],
                    "val_loss": [9.0, loss[-1]],
                    "final_loss": loss[-1],
                    "nll": {"current": loss[-1]},
                }
            )
    return runs


def test_a_budget_inside_the_warmup_reports_spikes_as_not_counted(tmp_path):
    cr = _script()
    args = cr.parse_args(
        [
            "--recipes",
            "bf16",
            "ue5m3",
            "--seeds",
            "1",
            "2",
            "--steps",
            "8",
            "--policies",
            "current",
            "--out",
            str(tmp_path),
            "--study",
            "s",
        ]
    )
    runs = _runs(steps=8, warmup=20)  # spikes would be counted after step 20
    summary = cr.aggregate(args, runs)
    assert summary["loss_threshold"] is None and summary["table"]["ue5m3"]["loss_spikes"] is None
    assert summary["table"]["ue5m3"]["gap_to_bf16"][0] > 0
    table = cr.markdown_table(args, summary)
    assert table.splitlines()[-1].endswith("| n/a | n/a |")
    folder = cr.write_report(args, runs, summary, [], 1.0)
    assert "Spikes are not counted (n/a): counting starts after step 20" in (folder / "README.md").read_text()
    counted = cr.aggregate(
        cr.parse_args([*["--recipes", "bf16", "ue5m3"], "--steps", "40", "--policies", "current"]),
        _runs(steps=40, warmup=20),
    )
    assert counted["table"]["bf16"]["loss_spikes"] == (0.0, 0.0)


def test_replot_redraws_the_plots_from_results_json_alone(tmp_path, monkeypatch):
    cr = _script()
    args = cr.parse_args(
        [
            "--recipes",
            "bf16",
            "ue5m3",
            "--seeds",
            "1",
            "2",
            "--steps",
            "40",
            "--policies",
            "current",
            "--out",
            str(tmp_path),
            "--study",
            "s",
        ]
    )
    runs = _runs(steps=40, warmup=4)
    folder = cr.write_report(args, runs, cr.aggregate(args, runs), [], 1.0)
    for png in ("training_loss.png", "validation_nll.png"):
        (folder / png).unlink()
    calls = []
    real_fill = __import__("matplotlib.axes", fromlist=["Axes"]).Axes.fill_between
    monkeypatch.setattr(
        "matplotlib.axes.Axes.fill_between", lambda self, *a, **k: calls.append(a) or real_fill(self, *a, **k)
    )
    cr.main(["--replot", str(folder / "results.json")])
    assert (folder / "training_loss.png").read_bytes()[:4] == b"\x89PNG" and (folder / "validation_nll.png").is_file()
    # a band per recipe on the absolute and on the relative panel of each figure; on the relative panel each
    # seed is compared with BF16's same seed, so BF16's own band is zero and ue5m3's is its seeds' spread
    assert len(calls) == 2 * 2 * 2
    _, bf16_lo, bf16_hi = calls[1]  # training loss figure: bf16 absolute, bf16 relative, ue5m3 absolute, ...
    assert max(bf16_hi) == min(bf16_lo) == 0.0
    _, lo, hi = calls[3]
    assert min(h - low for low, h in zip(lo, hi)) > 0.5  # seeds 1 and 2: +1 % and +2 % above their BF16 seed
    assert json.loads((folder / "results.json").read_text())["runs"][0]["recipe"] == "bf16"
