"""docs/planning.md's tables of published runs and of the kernel-level measurements are what
scripts/plan/plan_against_published.py prints, every run is predicted within 0.8 to 1.25 of its measured
throughput, the model's FP8-over-BF16 speed-up for TorchTitan's compiled runs and
the time per token FP8 saves are within 10% of the measured ones, and each run is planned on the hardware and
settings its source states."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from nemofp4.planning.devices import get_device
from nemofp4.planning.published import PUBLISHED_RUNS, SPEED_UPS, TORCHTITAN, predict

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "plan_against_published", ROOT / "scripts/plan/plan_against_published.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_tables_are_the_scripts_output():
    docs = (ROOT / "docs/planning.md").read_text()
    assert _script().table() in docs
    assert _script().sources_table() in docs


def test_every_published_run_is_predicted_within_the_goal():
    for run in PUBLISHED_RUNS:
        ratio = predict(run)["tokens_per_s_per_gpu"] / run.measured_tokens_per_s_per_gpu
        assert 0.8 <= ratio <= 1.25, (run.name, ratio)


def test_the_fp8_speed_up_over_bf16_is_within_ten_percent_of_the_measured_one():
    runs = {run.name: run for run in PUBLISHED_RUNS}
    bf16, fp8 = runs["Llama 3.1 8B BF16, FSDP, torch.compile"], runs["Llama 3.1 8B FP8 (torchao), FSDP, torch.compile"]
    predicted = predict(fp8)["tokens_per_s_per_gpu"] / predict(bf16)["tokens_per_s_per_gpu"]
    measured = fp8.measured_tokens_per_s_per_gpu / bf16.measured_tokens_per_s_per_gpu
    assert abs(predicted / measured - 1) < 0.10


def test_the_time_fp8_saves_per_token_is_predicted_within_ten_percent():
    """What FP8 changes (the linears' GEMMs and their quantizer passes) against what it measurably saved: the
    seconds per token the BF16 run spends and the FP8 run does not."""
    runs = {run.name: run for run in PUBLISHED_RUNS}
    for bf16, fp8 in SPEED_UPS:
        measured = 1 / runs[bf16].measured_tokens_per_s_per_gpu - 1 / runs[fp8].measured_tokens_per_s_per_gpu
        predicted = 1 / predict(runs[bf16])["tokens_per_s_per_gpu"] - 1 / predict(runs[fp8])["tokens_per_s_per_gpu"]
        assert abs(predicted / measured - 1) < 0.10


def test_the_prediction_is_slower_than_the_roofline():
    for run in PUBLISHED_RUNS:
        assert predict(run)["tokens_per_s_per_gpu"] < predict(run, efficiency="peak")["tokens_per_s_per_gpu"]


def test_each_run_is_planned_on_the_hardware_and_settings_its_source_states():
    titan = [run for run in PUBLISHED_RUNS if run.source == TORCHTITAN]
    assert titan and all(run.device == "h100_hbm2e_500w" and run.recompute_linears for run in titan)
    device = get_device("h100_hbm2e_500w")
    assert device.hbm_tb_s == 2.4 and device.memory_gib == 96  # "96GB HBM2e with 2.4 TB/sec"
    assert [run.compiled for run in titan] == ["compile" in run.name for run in titan]
    eager, compiled = titan[0], titan[1]
    assert predict(eager)["tokens_per_s_per_gpu"] < predict(compiled)["tokens_per_s_per_gpu"]
    assert {pair for pair in SPEED_UPS} <= {(a.name, b.name) for a in PUBLISHED_RUNS for b in PUBLISHED_RUNS}
    # TorchTitan: torch's AdamW (foreach by default) and FSDP2's copies; Megatron: a fused Adam, and buffers its
    # parameters and gradients are views of
    assert {run.framework for run in titan} == {"torchtitan"}
    assert {run.framework for run in PUBLISHED_RUNS if run.source != TORCHTITAN} == {"megatron"}
