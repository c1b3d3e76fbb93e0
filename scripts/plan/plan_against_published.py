"""The step-cost model against published, measured training runs: each run's model, GPUs, precision,
parallelism, sequence and batch planned with `nemofp4-plan`'s model, its prediction beside the measured
throughput (nemofp4.planning.published lists the runs and their sources).

    python scripts/plan/plan_against_published.py

Arithmetic only: no GPU, a few seconds. The runs are the test of the model: no efficiency is fitted to them.
"""

from __future__ import annotations

import argparse

from nemofp4.planning.published import PUBLISHED_RUNS, predict


def table(efficiency: str = "achieved") -> str:
    """The Markdown table docs/planning.md holds (tests/unit/test_plan_published.py checks it)."""
    lines = ["| run | source | GPUs | precision (our recipe) | parallelism | seq | global / micro batch | "
             "measured tokens/s/GPU | predicted tokens/s/GPU | body tokens/s/GPU | predicted / measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in PUBLISHED_RUNS:
        p = predict(run, efficiency=efficiency)
        lines.append(f"| {run.name} | {run.source} | {run.gpus}x {run.device} | {run.recipe} | {run.parallelism} | "
                     f"{run.seq_len} | {run.global_batch} / {run.micro_batch} | {run.measured_tokens_per_s_per_gpu:,.0f} | "
                     f"{p['tokens_per_s_per_gpu']:,.0f} | {p['body_tokens_per_s_per_gpu']:,.0f} | "
                     f"{p['tokens_per_s_per_gpu'] / run.measured_tokens_per_s_per_gpu:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--efficiency", default="achieved", choices=("achieved", "peak"))
    print(table(parser.parse_args().efficiency))


if __name__ == "__main__":
    main()
