"""The 8B presets' defaults: the policy ``distributed.activation_checkpointing=auto`` picks for each
preset and device at a world size, its recompute share, the bytes of the step's weight cache
(``train.weight_cache``), and the step-cost model's projected step time and MFU before (the former
fixed policy ``full``, each weight quantized in every micro-batch) and after (auto's policy, each
weight quantized once per step), with the tokens/s per GPU of the latter.

    python scripts/plan/plan_8b_defaults.py --world-size 64 --devices h100 h200

Every figure is the analytical plan (one block of each kind measured at the real widths on fake
tensors) and the step-cost model at achieved efficiency (nemofp4/planning/efficiency.py; --efficiency
peak: the roofline, a lower bound on the step time): a formula, not measured on a GPU.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from nemofp4 import planning
from nemofp4.cli.train import compose_job_config
from nemofp4.planning.efficiency import EFFICIENCY_MODES, get_efficiency
from nemofp4.planning.layers import cached_weight_bytes, linear_specs
from nemofp4.planning.memory import GIB

PRESETS = ("nemotron_h_8b_bf16", "nemotron_h_8b_nvfp4", "nemotron_h_8b_ue5m3", "nemotron_h_8b_ue5m3_te_settings")
FORMER = "full"
"""The presets' policy before ``auto`` (``activation_checkpointing: true``)."""


def _with(job, policy: str, weight_cache: bool):
    return replace(
        job,
        distributed=replace(job.distributed, activation_checkpointing=policy),
        train=replace(job.train, weight_cache=weight_cache),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--devices", nargs="+", default=["h100", "h200"])
    parser.add_argument("--mamba-scan", default="mamba_ssm", help="the scan the GPU runs take (the gpu extra's)")
    parser.add_argument("--overrides", nargs="*", default=[], help="extra Hydra overrides for every preset")
    parser.add_argument(
        "--efficiency",
        default="achieved",
        choices=EFFICIENCY_MODES,
        help="achieved (the prediction) or peak (the roofline, a lower bound on the step time)",
    )
    args = parser.parse_args()
    header = [
        "preset",
        "device",
        "auto picks",
        "recompute",
        "planned GiB per GPU",
        "weight cache GiB",
        "step s before",
        "MFU before",
        "step s after",
        "MFU after",
        "tokens/s per GPU after",
        "plan s",
    ]
    rows = []
    for preset in args.presets:
        job = compose_job_config([f"experiment={preset}", *args.overrides])
        cache = sum(sum(cached_weight_bytes(s)) for s in linear_specs(job.model, job.recipe))
        for name in args.devices:
            device = planning.get_device(name)
            efficiency = get_efficiency(args.efficiency, name.strip().lower())
            started = time.perf_counter()
            policy, recommendation = planning.choose_checkpointing(
                job,
                world_size=args.world_size,
                memory_gib=device.memory_gib,
                reserve_gib=job.distributed.memory_reserve_gib,
                mamba_scan=args.mamba_scan,
            )
            plan_s = time.perf_counter() - started
            _, total, recompute, _ = next(r for r in recommendation.rows if r[0] == policy)
            projected = []
            for chosen, weight_cache in ((FORMER, False), (policy, True)):
                cost = planning.cost_for_job(
                    _with(job, chosen, weight_cache), world_size=args.world_size, gpus_per_node=device.gpus_per_node
                )
                p = cost.project(device, cost.configured, efficiency)
                projected += [f"{p.step_s:.2f}", f"{p.mfu * 100:.1f}%"]
            projected.append(f"{cost.tokens / p.step_s:,.0f}")
            rows.append(
                [
                    preset,
                    device.name,
                    policy,
                    f"+{recompute * 100:.1f}% FLOPs",
                    f"{total / GIB:.1f}",
                    f"{cache / GIB:.2f}",
                    *projected,
                    f"{plan_s:.0f}",
                ]
            )
            print(f"{preset} on {device.name}: {policy}", flush=True)
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
