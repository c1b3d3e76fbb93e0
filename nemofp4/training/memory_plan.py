"""Moved to :mod:`nemofp4.planning` (the plan, its simulation and the step-cost model are one
component of their own); these names stay importable from here."""

from nemofp4.planning.job import log_plan, plan_for_job
from nemofp4.planning.measure import LiveTensorBytes
from nemofp4.planning.memory import MemoryPlan, plan_memory

__all__ = ["LiveTensorBytes", "MemoryPlan", "log_plan", "plan_for_job", "plan_memory"]
