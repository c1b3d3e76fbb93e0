"""What the trainer takes from whoever builds the job about its plan: the activation-checkpointing
policy ``distributed.activation_checkpointing=auto`` resolves to, and the plan's summary to log.

The planner (:mod:`nemofp4.planning`) sits above training: it runs the trainer's own parallelize and
optimizer. So the trainer never imports it; ``nemofp4-train`` hands it a :class:`JobPlanner`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from nemofp4.evaluation.run_config import read_saved_config
from nemofp4.training.config import JobConfig
from nemofp4.training.parallel import AC_AUTO
from nemofp4.training.run_dir import RUN_CONFIG

log = logging.getLogger("nemofp4")

__all__ = ["JobPlan", "JobPlanner", "recorded_policy", "resolve_activation_checkpointing"]


@dataclass(frozen=True, kw_only=True)
class JobPlan:
    """The policy the plan chose for ``auto`` and why."""

    activation_checkpointing: str
    reason: str
    """One line every rank logs: the recompute share and the memory the policy plans."""
    summary: str = ""
    """The table it was chosen from (rank 0 logs it)."""


class JobPlanner(Protocol):
    def choose(self, cfg: JobConfig, *, world_size: int, device: torch.device) -> JobPlan:
        """The cheapest activation-checkpointing policy that fits this job on ``device`` (the memory
        plan, no simulation); a ValueError naming a world size or micro-batch that fits when none does."""
        ...

    def log_plan(self, cfg: JobConfig, *, world_size: int, device: torch.device, log: logging.Logger) -> None:
        """Log the memory plan of the configured policy (a diagnostic: never raises)."""
        ...


def recorded_policy(run_dir: Path) -> str | None:
    """The policy an earlier start of the run in ``run_dir`` trained with (its resolved config.yaml),
    or None when there is none (a new run, or one recorded before ``auto`` existed as ``auto``)."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        return None
    policy = (read_saved_config(path).get("distributed") or {}).get("activation_checkpointing")
    return None if policy in (None, AC_AUTO) else str(policy)


def log_plan_in_background(
    planner: JobPlanner | None, cfg: JobConfig, *, rank: int, world_size: int, device: torch.device
) -> threading.Thread | None:
    """Rank 0 logs the memory plan of a configured policy (seconds of meta-device tracing at 8B) in a
    thread, while every rank builds, shards and loads: the others never wait for it in a collective.
    (``auto`` logs the plan that chose its policy instead.) The caller joins the thread, if any."""
    if rank != 0 or planner is None or cfg.distributed.activation_checkpointing == AC_AUTO:
        return None
    thread = threading.Thread(
        target=planner.log_plan,
        args=(cfg,),
        name="nemofp4-memory-plan",
        daemon=True,
        kwargs={"world_size": world_size, "device": device, "log": log},
    )
    thread.start()
    return thread


def resolve_activation_checkpointing(
    cfg: JobConfig, planner: JobPlanner | None, *, rank: int, world_size: int, device: torch.device
) -> JobConfig:
    """``cfg`` with ``activation_checkpointing=auto`` replaced by a policy (any other value: ``cfg``).

    Rank 0 decides and broadcasts, so every rank wraps the same blocks: the policy the run recorded
    when it started (a resume keeps it on any device), else the planner's choice for this device.
    Every rank logs the outcome once; when nothing fits, every rank raises the planner's error."""
    if cfg.distributed.activation_checkpointing != AC_AUTO:
        return cfg
    decision: list = [None, "", None]  # policy, reason, error
    if rank == 0:
        recorded = recorded_policy(Path(cfg.run_dir)) if cfg.resume != "none" else None
        if recorded is not None:
            decision[:2] = recorded, f"kept from {Path(cfg.run_dir) / RUN_CONFIG}: the run started with it"
        elif planner is None:
            decision[2] = (
                "distributed.activation_checkpointing=auto needs the job's planner (nemofp4-train passes "
                "one); name a policy instead (none, full, mamba, ...)"
            )
        else:
            try:
                plan = planner.choose(cfg, world_size=world_size, device=device)
                decision[:2] = plan.activation_checkpointing, plan.reason
                if plan.summary:
                    log.info("activation checkpointing plan (nemofp4-plan):\n%s", plan.summary)
            except ValueError as err:
                decision[2] = str(err)
    if world_size > 1:
        dist.broadcast_object_list(decision, src=0)
    policy, reason, error = decision
    if error is not None:
        raise ValueError(error)
    log.info("rank %d: distributed.activation_checkpointing=auto -> %s (%s)", rank, policy, reason)
    return replace(cfg, distributed=replace(cfg.distributed, activation_checkpointing=policy))
