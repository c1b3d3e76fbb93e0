"""scripts/plot_quant_stats.py: block fractions from logged quant rows (the plots of a trained
run are checked in tests/integration/test_eval_cli.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def plot_script():
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
    series = plot_script().block_fractions(rows)
    assert series["saturated_blocks"]["x"] == [(5, pytest.approx(0.2)), (10, 0.0)]
    assert series["underflow_blocks"]["x"] == [(5, 0.25), (10, 0.2)]
