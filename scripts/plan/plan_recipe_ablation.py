"""The NVFP4 recipe's ablation projected by the step-cost model: the recipe, without the RHT, with all
eligible linears in FP4, and both, as the model body's throughput per GPU on each device.

    python scripts/plan/plan_recipe_ablation.py --experiment nemotron_h_8b_nvfp4 --world-size 64 --devices gb200 b200 h200

A formula (the step-cost model of nemofp4/planning/cost.py at each kernel class's achieved fraction of
the devices' peak numbers, nemofp4/planning/efficiency.py; --efficiency peak: the roofline), not a measurement:
native FP4 GEMMs (Transformer Engine's nvfp4_te) where the device has FP4 tensor cores, the emulated
nvfp4 elsewhere. Arithmetic only: no GPU, no Transformer Engine, a few seconds.
"""

from __future__ import annotations

import argparse

from nemofp4 import planning
from nemofp4.cli.train import compose_job_config
from nemofp4.planning.ablation import recipe_ablation
from nemofp4.planning.efficiency import EFFICIENCY_MODES, get_efficiency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="nemotron_h_8b_nvfp4")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--devices", nargs="+", default=["gb200", "b200", "h200"])
    parser.add_argument("--recipe", default=None, help="nvfp4_te or nvfp4 (default: nvfp4_te where the device has FP4)")
    parser.add_argument("--overrides", nargs="*", default=[], help="extra Hydra overrides")
    parser.add_argument(
        "--efficiency",
        default="achieved",
        choices=EFFICIENCY_MODES,
        help="achieved (the prediction) or peak (the roofline, a lower bound on the step time)",
    )
    args = parser.parse_args()
    job = compose_job_config([f"experiment={args.experiment}", *args.overrides])
    for name in args.devices:
        ablation = recipe_ablation(
            job,
            device=planning.get_device(name),
            world_size=args.world_size,
            recipe=args.recipe,
            efficiency=get_efficiency(args.efficiency, name.strip().lower()),
        )
        print(ablation.format(), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
