"""The 8B presets planned before they are paid for: the analytical memory plan and, with
``--simulate``, the training step simulated on fake tensors over a fake process group (FSDP2,
FSDPMemTracker), side by side; then the step-cost model's projected step time and MFU on each device.

    python scripts/bench/bench_plan.py --simulate --world-size 64 --devices h200 gb200

Figures for the 8B are simulated at the real widths (the trainer's own build and step on fake
tensors) or a formula (the projection, at achieved efficiency: nemofp4/planning/efficiency.py;
--efficiency peak: the roofline, a lower bound on the step time); none is measured on a GPU.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from nemofp4 import planning
from nemofp4.cli.train import compose_job_config
from nemofp4.planning.efficiency import EFFICIENCY_MODES, get_efficiency
from nemofp4.planning.memory import GIB

PRESETS = ("nemotron_h_8b_bf16", "nemotron_h_8b_nvfp4", "nemotron_h_8b_ue5m3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--device-memory-gib", type=float, default=141.0)
    parser.add_argument("--devices", nargs="+", default=["h200", "gb200"])
    parser.add_argument("--mamba-scan", default="mamba_ssm")
    parser.add_argument("--simulate", action="store_true")
    parser.add_argument("--overrides", nargs="*", default=[], help="extra Hydra overrides for every preset")
    parser.add_argument(
        "--head-precisions",
        nargs="+",
        default=["config"],
        help="project the LM head's GEMMs in these precisions too (config, fp32, tf32, bf16)",
    )
    parser.add_argument(
        "--tokens",
        type=float,
        default=189e9,
        help="training tokens for the GPU-hours column (default: the paper's 189B-token run)",
    )
    parser.add_argument(
        "--efficiency",
        default="achieved",
        choices=EFFICIENCY_MODES,
        help="achieved (the prediction) or peak (the roofline, a lower bound on the step time)",
    )
    args = parser.parse_args()
    memory_rows, cost_rows = [], []
    for preset in args.presets:
        job = compose_job_config([f"experiment={preset}", *args.overrides])
        if job.distributed.activation_checkpointing == "auto":  # the policy the trainer's start-up picks here
            policy, _ = planning.choose_checkpointing(
                job,
                world_size=args.world_size,
                memory_gib=args.device_memory_gib,
                reserve_gib=job.distributed.memory_reserve_gib,
                mamba_scan=args.mamba_scan,
            )
            job = replace(job, distributed=replace(job.distributed, activation_checkpointing=policy))
        started = time.perf_counter()
        plan = planning.plan_for_job(
            job, world_size=args.world_size, device_memory_gib=args.device_memory_gib, mamba_scan=args.mamba_scan
        )
        plan_s = time.perf_counter() - started
        row = [
            preset,
            job.distributed.activation_checkpointing,
            f"{plan.peak.total / GIB:.2f}",
            plan.peak.describe(),
            f"{plan_s:.0f}",
        ]
        if args.simulate:
            started = time.perf_counter()
            sim = planning.simulate_for_job(job, world_size=args.world_size, mamba_scan=args.mamba_scan)
            same = plan.moment(sim.peak_phase, sim.peak_group, sim.peak_micro_batch)
            worst = max(abs(same.items[k] - v) / v for k, v in sim.categories.items() if v > 0.01 * sim.peak_bytes)
            row += [
                f"{sim.peak_bytes / GIB:.2f}",
                f"{sim.peak_phase} of {sim.peak_group}, {sim.peak_micro_batch}",
                f"{worst * 100:.1f}%",
                f"{time.perf_counter() - started:.0f}",
            ]
            print(
                f"{preset}: simulated by item (GiB):",
                {k: round(v / GIB, 2) for k, v in sim.categories.items()},
                flush=True,
            )
        memory_rows.append(row)
        for device_name, head in ((d, h) for d in args.devices for h in args.head_precisions):
            device = planning.get_device(device_name)
            efficiency = get_efficiency(args.efficiency, device_name.strip().lower())
            cost = planning.cost_for_job(
                job,
                world_size=args.world_size,
                gpus_per_node=device.gpus_per_node,
                head_precision=None if head == "config" else head,
            )
            for layout in cost.collectives:
                p = cost.project(device, layout, efficiency)
                cost_rows.append(
                    [
                        preset,
                        cost.precision["head and loss"],
                        device.name,
                        layout,
                        f"{cost.total_flops / 1e12:,.0f}",
                        f"{sum(p.compute_s.values()):.2f}",
                        f"{p.quant_s:.2f}",
                        f"{p.comm_s:.2f}",
                        f"{p.exposed_comm_s:.2f}",
                        f"{p.step_s:.2f}",
                        f"{p.mfu * 100:.1f}%",
                        f"{cost.tokens / p.step_s:,.0f}",
                        f"{p.body_tokens_per_s:,.0f}",
                        f"{args.tokens * p.step_s / cost.tokens / 3600:,.0f}",
                    ]
                )
        print(f"{preset}: done", flush=True)
    header = ["preset", "activation checkpointing", "planned peak GiB", "planned peak at", "plan s"]
    if args.simulate:
        header += ["simulated peak GiB", "simulated peak at", "largest item difference", "simulation s"]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in memory_rows:
        print("| " + " | ".join(row) + " |")
    header = [
        "preset",
        "head GEMMs",
        "device",
        "layout",
        "TFLOP per rank",
        "compute s",
        "quantization s",
        "communication s",
        "of it exposed s",
        "step s",
        "MFU",
        "tokens/s per GPU",
        "body tokens/s per GPU",
        f"GPU-hours for {args.tokens / 1e9:g}B tokens",
    ]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in cost_rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
