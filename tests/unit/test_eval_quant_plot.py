"""scripts/study/plot_quant_stats.py: block fractions from logged quant rows (the plots of a trained
run are checked in tests/integration/test_eval_cli.py)."""

from __future__ import annotations

import pytest

from tests.conftest import plot_script


def test_block_fractions_average_over_layers_per_role():
    rows = [
        {
            "kind": "quant",
            "step": 5,
            "layers": {
                "a": {"x/saturated_blocks": 0.1, "x/underflow_blocks": 0.0},
                "b": {"x/saturated_blocks": 0.3, "x/underflow_blocks": 0.5},
            },
        },
        {"kind": "quant", "step": 10, "layers": {"a": {"x/saturated_blocks": 0.0, "x/underflow_blocks": 0.2}}},
    ]
    series = plot_script().block_fractions(rows)
    assert series["saturated_blocks"]["x"] == [(5, pytest.approx(0.2)), (10, 0.0)]
    assert series["underflow_blocks"]["x"] == [(5, 0.25), (10, 0.2)]


def test_scale_exponent_figure_has_six_panels_and_exact_saturation_counts(tmp_path):
    import torch

    script = plot_script()
    x = torch.ones(4, 32)
    x[0, :16] = 2.0  # one block of 8 holds the amax: the others code 448 * 1/2 = 224 under the current amax
    assert script._block_amax(x, two_d=False).tolist() == [2.0] + [1.0] * 7
    assert script._block_amax(torch.ones(20, 20), two_d=True).tolist() == [1.0] * 4  # padded 16x16 tiles
    entry = {"hist": {-32: 10, 0: 30, 8: 60}, "blocks": 100, "saturated": 60, "zero": 10}
    histograms = {
        op: {ref: {"e4m3": entry, "ue5m3": {**entry, "saturated": 0, "zero": 0}} for ref in script.REFERENCES}
        for op in ("x", "w")
    }
    path = script.plot_scale_exponents(histograms, tmp_path)
    assert path.read_bytes()[:4] == b"\x89PNG"
