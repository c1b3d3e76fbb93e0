"""`nemofp4-plan`: the per-GPU memory plan of a training config, over the same Hydra tree as
`nemofp4-train`, for a given world size and device memory.

    nemofp4-plan experiment=nemotron_h_8b_ue5m3 world_size=32 device_memory_gib=80
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from nemofp4.cli.errors import HydraApp, run_cli
from nemofp4.cli.train import CONFIG_DIR
from nemofp4.training.config import JobConfig


@dataclass(kw_only=True)
class PlanConfig(JobConfig):
    """A training config plus the machine it is planned for."""

    world_size: int = 8
    """GPUs the run is planned on."""
    device_memory_gib: float = 80.0
    """Memory of one GPU."""
    chunked_head: bool | None = None
    """Plan the chunked LM-head loss (true) or full FP32 logits (false); default: what the config
    trains with (train.head_chunk_tokens > 0)."""
    reserve_gib: float = 4.0
    """Headroom for the CUDA context, communication buffers and fragmentation."""


_PLAN_KEYS = tuple(f.name for f in fields(PlanConfig) if f.name not in {g.name for g in fields(JobConfig)})


def split_plan_config(cfg: DictConfig) -> tuple[JobConfig, dict]:
    """(the training JobConfig, the plan's own options) from a composed `plan` config."""
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)
    container = OmegaConf.to_container(cfg, resolve=True)
    options = {key: container.pop(key) for key in _PLAN_KEYS}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), container)), options


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="plan")
def _hydra_main(cfg: DictConfig) -> None:
    from nemofp4.training.memory_plan import plan_for_job

    job, options = split_plan_config(cfg)
    print(plan_for_job(job, **options).format(), flush=True)


def register_plan_schema() -> None:
    """The training tree validated against PlanConfig: train.yaml's `job_schema` gains the plan keys."""
    ConfigStore.instance().store(name="job_schema", node=PlanConfig)


def main() -> None:
    register_plan_schema()
    run_cli(_hydra_main, name="nemofp4-plan", app=HydraApp("plan", CONFIG_DIR))


if __name__ == "__main__":
    main()
