"""`nemofp4-plan`: the per-GPU memory plan, the activation-checkpointing policy that fits and the step
cost of a training config, over the same Hydra tree as `nemofp4-train`, for a given world size and
device; `simulate=true` also runs the step on fake tensors over a fake process group and measures it.

    nemofp4-plan experiment=nemotron_h_8b_ue5m3 world_size=64 device=h200 simulate=true
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields, replace

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from nemofp4.cli.errors import HydraApp, run_cli
from nemofp4.cli.train import CONFIG_DIR
from nemofp4.training.config import JobConfig
from nemofp4.training.parallel import AC_AUTO


@dataclass(kw_only=True)
class PlanConfig(JobConfig):
    """A training config plus the machine it is planned for."""

    world_size: int = 8
    """GPUs the run is planned on."""
    device: str = ""
    """A device preset (h100, h200, h100_hbm2e_500w, b200, gb200: nemofp4.planning.devices) for the step-time
    projection and, unless device_memory_gib is given, the memory; empty: no projection."""
    device_memory_gib: float | None = None
    """Memory of one GPU; default: the device preset's, else 80."""
    chunked_head: bool | None = None
    """Plan the chunked LM-head loss (true) or full FP32 logits (false); default: what the config
    trains with (train.head_chunk_tokens > 0)."""
    reserve_gib: float = 4.0
    """Headroom for the CUDA context, communication buffers and fragmentation."""
    mamba_scan: str = "auto"
    """The Mamba scan to plan for: torch, mamba_ssm (the CUDA kernels of the gpu extra), or auto (mamba_ssm
    when it imports here, else torch)."""
    simulate: bool = False
    """Also run the training step at its real widths on fake tensors over a fake process group of
    world_size ranks (FSDP2 only) and print its measured peak beside the plan."""
    efficiency: str = "achieved"
    """The step-time projection: achieved (each kernel class at its measured fraction of peak:
    nemofp4.planning.efficiency, the prediction) or peak (the roofline, a lower bound on the step time)."""
    format: str = "table"
    """How the plan is printed: table (Markdown tables for a reader) or json (one JSON object for sweeps
    and other tools: nemofp4.planning.report.plan_summary)."""


PLAN_FORMATS = ("table", "json")

_PLAN_KEYS = tuple(f.name for f in fields(PlanConfig) if f.name not in {g.name for g in fields(JobConfig)})


def split_plan_config(cfg: DictConfig) -> tuple[JobConfig, dict]:
    """(the training JobConfig, the plan's own options) from a composed `plan` config."""
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)
    container = OmegaConf.to_container(cfg, resolve=True)
    options = {key: container.pop(key) for key in _PLAN_KEYS}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), container)), options


def plan_report(
    job: JobConfig,
    *,
    world_size: int,
    device: str = "",
    device_memory_gib: float | None = None,
    chunked_head: bool | None = None,
    reserve_gib: float = 4.0,
    mamba_scan: str = "auto",
    simulate: bool = False,
    efficiency: str = "achieved",
    format: str = "table",
) -> str:
    """Everything `nemofp4-plan` prints for ``job`` on ``world_size`` GPUs: tables, or with
    ``format='json'`` one JSON object (:func:`nemofp4.planning.report.plan_summary`)."""
    from nemofp4 import planning
    from nemofp4.planning.efficiency import PEAK, get_efficiency
    from nemofp4.planning.report import cost_table, plan_summary, simulation_table

    if format not in PLAN_FORMATS:
        raise ValueError(f"format={format!r}; valid: {', '.join(PLAN_FORMATS)}")

    if simulate and job.distributed.backend != "fsdp":  # before minutes of planning, not after
        raise ValueError(
            f"simulate=true with distributed.backend={job.distributed.backend!r}: the simulation "
            "measures FSDP2 runs; use distributed=fsdp"
        )
    preset = planning.get_device(device) if device else None
    achieved = get_efficiency(efficiency, device.strip().lower()) if device else PEAK
    memory_gib = device_memory_gib if device_memory_gib is not None else (preset.memory_gib if preset else 80.0)
    auto = job.distributed.activation_checkpointing == AC_AUTO
    if auto:  # plan what the trainer's start-up would pick on this device (none while choosing)
        job = replace(job, distributed=replace(job.distributed, activation_checkpointing="none"))
    plan = planning.plan_for_job(
        job,
        world_size=world_size,
        device_memory_gib=memory_gib,
        chunked_head=chunked_head,
        reserve_gib=reserve_gib,
        mamba_scan=mamba_scan,
    )
    recommendation = planning.recommend_checkpointing(
        job, plan, world_size=world_size, reserve_gib=reserve_gib, chunked_head=chunked_head
    )
    if auto and recommendation.chosen is not None:
        job = replace(job, distributed=replace(job.distributed, activation_checkpointing=recommendation.chosen))
        plan = planning.plan_for_job(
            job,
            world_size=world_size,
            device_memory_gib=memory_gib,
            chunked_head=chunked_head,
            reserve_gib=reserve_gib,
            mamba_scan=mamba_scan,
            measured=plan.measured,
        )
    per_node = preset.gpus_per_node if preset else 8
    cost = planning.cost_for_job(job, world_size=world_size, gpus_per_node=per_node, chunked_head=chunked_head)
    sim = None
    if simulate:
        started = time.perf_counter()
        sim = planning.simulate_for_job(job, world_size=world_size, mamba_scan=mamba_scan, chunked_head=chunked_head)
        sim_wall_s = time.perf_counter() - started
    if format == "json":
        summary = plan_summary(
            plan,
            cost,
            preset,
            activation_checkpointing=job.distributed.activation_checkpointing,
            simulated=sim,
            efficiency=achieved,
        )
        return json.dumps(summary, indent=2)
    sections = [plan.format(), recommendation.format()]
    if auto:
        picked = (
            f"picks {recommendation.chosen} at {memory_gib:g} GiB per GPU; the plan above is of that policy"
            if recommendation.chosen
            else f"fails at {memory_gib:g} GiB per GPU: no policy fits"
        )
        sections.append(f"distributed.activation_checkpointing=auto {picked}.")
    sections.append(cost_table(cost, preset, achieved))
    if sim is not None:
        sections.append(simulation_table(sim, plan, world_size=world_size, wall_s=sim_wall_s))
    return "\n\n".join(sections)


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="plan")
def _hydra_main(cfg: DictConfig) -> None:
    job, options = split_plan_config(cfg)
    print(plan_report(job, **options), flush=True)


def register_plan_schema() -> None:
    """The training tree validated against PlanConfig: train.yaml's `job_schema` gains the plan keys."""
    ConfigStore.instance().store(name="job_schema", node=PlanConfig)


def main() -> None:
    register_plan_schema()
    run_cli(_hydra_main, name="nemofp4-plan", app=HydraApp("plan", CONFIG_DIR))


if __name__ == "__main__":
    main()
