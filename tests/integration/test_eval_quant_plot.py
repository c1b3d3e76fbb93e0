"""scripts/plot_quant_stats.py: block fractions from logged quant rows, and block-scale exponent
histograms of a trained checkpoint."""

from __future__ import annotations

import importlib.util
import json

import pytest

from .test_eval_cli import ROOT, train_tiny


def _script():
    spec = importlib.util.spec_from_file_location("plot_quant_stats", ROOT / "scripts" / "plot_quant_stats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_block_fractions_average_over_layers_per_role():
    rows = [
        {"kind": "quant", "step": 5, "layers": {"a": {"x/saturated_blocks": 0.1, "x/underflow_blocks": 0.0},
                                                  "b": {"x/saturated_blocks": 0.3, "x/underflow_blocks": 0.5}}},
        {"kind": "quant", "step": 10, "layers": {"a": {"x/saturated_blocks": 0.0, "x/underflow_blocks": 0.2}}},
    ]  # fmt: skip
    series = _script().block_fractions(rows)
    assert series["saturated_blocks"]["x"] == [(5, pytest.approx(0.2)), (10, 0.0)]
    assert series["underflow_blocks"]["x"] == [(5, 0.25), (10, 0.2)]


def test_plots_from_a_trained_run(tmp_path):
    run = tmp_path / "run"
    train_tiny(run, "precision=ue5m3", "train.max_steps=2", "logging.quant_stats_interval=1")
    out = tmp_path / "plots"
    written = _script().main([str(run), "--checkpoint", str(run), "--out", str(out), "--sequences", "2"])
    assert [p.name for p in written] == ["run_blocks.png", "scale_exponents.png"]
    for path in written:
        assert path.read_bytes()[:4] == b"\x89PNG"
    histograms = json.loads((out / "scale_exponents.json").read_text())
    fqn = "layers.0.mixer.in_proj"
    # X of in_proj: 2 sequences x 64 tokens, 128 features -> 16-element blocks: 128 * 8 blocks per format.
    for fmt in ("ue5m3", "e4m3"):
        assert sum(histograms[f"{fqn}:x"][fmt].values()) == 2 * 64 * 128 // 16
        assert max(int(e) for e in histograms[f"{fqn}:x"][fmt]) <= 8  # codes <= T = 448 < 2^9
