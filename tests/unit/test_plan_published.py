"""docs/planning.md's table of published runs is what scripts/plan/plan_against_published.py prints, and the
model's FP8-over-BF16 speed-up for TorchTitan's compiled runs is within 10% of the measured one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from nemofp4.planning.published import PUBLISHED_RUNS, predict

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("plan_against_published", ROOT / "scripts/plan/plan_against_published.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_scripts_output():
    assert _script().table() in (ROOT / "docs/planning.md").read_text()


def test_the_fp8_speed_up_over_bf16_is_within_ten_percent_of_the_measured_one():
    runs = {run.name: run for run in PUBLISHED_RUNS}
    bf16, fp8 = runs["Llama 3.1 8B BF16, FSDP, torch.compile"], runs["Llama 3.1 8B FP8 (torchao), FSDP, torch.compile"]
    predicted = predict(fp8)["tokens_per_s_per_gpu"] / predict(bf16)["tokens_per_s_per_gpu"]
    measured = fp8.measured_tokens_per_s_per_gpu / bf16.measured_tokens_per_s_per_gpu
    assert abs(predicted / measured - 1) < 0.10


def test_the_prediction_is_slower_than_the_roofline():
    for run in PUBLISHED_RUNS:
        assert predict(run)["tokens_per_s_per_gpu"] < predict(run, efficiency="peak")["tokens_per_s_per_gpu"]
