"""Planning a training run before it is paid for: its per-GPU memory (measured at the real widths and
by FSDP2's arithmetic, or simulated end to end on fake tensors over a fake process group), the
activation-checkpointing policy that fits, and the step's FLOPs, bytes and projected time.

Used by ``nemofp4-plan`` and by the trainer's start-up log; see docs/planning.md.
"""

from .cost import COMPONENTS, Projection, StepCost, step_cost
from .devices import DEVICES, Device, get_device
from .job import (
    Recommendation,
    StartupPlanner,
    choose_checkpointing,
    cost_for_job,
    log_plan,
    plan_for_job,
    recommend_checkpointing,
    simulate_for_job,
)
from .memory import CATEGORIES, MemoryPlan, Moment, candidate_policies, plan_memory
from .simulate import SimulatedMemory, simulate_memory
from .standins import MAMBA_SCANS, mamba_scan_path

__all__ = [
    "CATEGORIES",
    "COMPONENTS",
    "DEVICES",
    "MAMBA_SCANS",
    "Device",
    "MemoryPlan",
    "Moment",
    "Projection",
    "Recommendation",
    "SimulatedMemory",
    "StartupPlanner",
    "StepCost",
    "candidate_policies",
    "choose_checkpointing",
    "cost_for_job",
    "get_device",
    "log_plan",
    "mamba_scan_path",
    "plan_for_job",
    "plan_memory",
    "recommend_checkpointing",
    "simulate_for_job",
    "simulate_memory",
    "step_cost",
]
