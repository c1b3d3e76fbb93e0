"""The step-cost model against published, measured training runs: each run's model, GPUs, precision,
parallelism, sequence and batch planned with `nemofp4-plan`'s model, its prediction beside the measured
throughput, the FP8-over-BF16 speed-up measured and predicted, and the kernel-level measurements the
prediction rests on (nemofp4.planning.published lists the runs, nemofp4.planning.efficiency the measurements).

    python scripts/plan/plan_against_published.py

Arithmetic only: no GPU, a few seconds. The runs are the test of the model: no efficiency is fitted to them.
"""

from __future__ import annotations

import argparse

from nemofp4.planning.efficiency import SOURCES
from nemofp4.planning.published import PUBLISHED_RUNS, SPEED_UPS, predict


def _seconds(tokens_per_s_per_gpu: float) -> float:
    """GPU-seconds one GPU spends on a million tokens at ``tokens_per_s_per_gpu``."""
    return 1e6 / tokens_per_s_per_gpu


def table(efficiency: str = "achieved") -> str:
    """The Markdown tables docs/planning.md holds (tests/unit/test_plan_published.py checks them): the runs, and
    the FP8-over-BF16 speed-ups with the time FP8 saves and the time the model misses, per million tokens (a
    ratio mixes the two: the same missed seconds weigh more in the shorter FP8 step)."""
    lines = [
        "| run | source | GPUs | precision (our recipe) | parallelism | seq | global / micro batch | "
        "measured tokens/s/GPU | predicted tokens/s/GPU | body tokens/s/GPU | predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    predicted = {}
    for run in PUBLISHED_RUNS:
        p = predict(run, efficiency=efficiency)
        predicted[run.name] = p["tokens_per_s_per_gpu"]
        lines.append(
            f"| {run.name} | {run.source} | {run.gpus}x {run.device} | {run.recipe} | {run.parallelism} | "
            f"{run.seq_len} | {run.global_batch} / {run.micro_batch} | {run.measured_tokens_per_s_per_gpu:,.0f} | "
            f"{p['tokens_per_s_per_gpu']:,.0f} | {p['body_tokens_per_s_per_gpu']:,.0f} | "
            f"{p['tokens_per_s_per_gpu'] / run.measured_tokens_per_s_per_gpu:.2f} |"
        )
    measured = {run.name: run.measured_tokens_per_s_per_gpu for run in PUBLISHED_RUNS}
    lines += [
        "",
        "| FP8 run over BF16 run | measured speed-up | predicted speed-up | predicted / measured | "
        "GPU-seconds FP8 saves per 1M tokens, measured / predicted | GPU-seconds per 1M tokens the model misses, "
        "BF16 / FP8 run |",
        "|---|---|---|---|---|---|",
    ]
    for bf16, fp8 in SPEED_UPS:
        m, p = measured[fp8] / measured[bf16], predicted[fp8] / predicted[bf16]
        saved_m, saved_p = (
            _seconds(measured[bf16]) - _seconds(measured[fp8]),
            _seconds(predicted[bf16]) - _seconds(predicted[fp8]),
        )
        missed = [_seconds(measured[run]) - _seconds(predicted[run]) for run in (bf16, fp8)]
        lines.append(
            f"| {fp8} over {bf16} | {m:.3f}x | {p:.3f}x | {p / m:.3f} | {saved_m:.1f} / {saved_p:.1f} | "
            f"{missed[0]:.1f} / {missed[1]:.1f} |"
        )
    return "\n".join(lines)


def sources_table() -> str:
    """docs/planning.md's table of the kernel-level measurements (nemofp4.planning.efficiency.SOURCES)."""
    lines = ["| kernel class | fraction of peak | source |", "|---|---|---|"]
    lines += [f"| {kind} | {figure} | {source} |" for kind, figure, source in SOURCES]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--efficiency", default="achieved", choices=("achieved", "peak"))
    parser.add_argument("--sources", action="store_true", help="print the table of kernel-level measurements instead")
    args = parser.parse_args()
    print(sources_table() if args.sources else table(args.efficiency))


if __name__ == "__main__":
    main()
