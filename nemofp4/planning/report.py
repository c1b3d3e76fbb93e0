"""Tables of a step cost and of a simulation beside the plan, as `nemofp4-plan` prints them."""

from __future__ import annotations

from nemofp4.quant import TE_RECIPES

from .cost import ROLES, StepCost
from .devices import Device
from .efficiency import PEAK, Efficiency
from .memory import CATEGORIES, GIB, MemoryPlan
from .simulate import SimulatedMemory

__all__ = ["cost_table", "plan_summary", "simulation_table"]

_PRECISION = {"bf16": "BF16", "fp32": "FP32", "tf32": "TF32", "fp8": "FP8", "fp4": "FP4"}


def cost_table(cost: StepCost, device: Device | None, efficiency: Efficiency = PEAK) -> str:
    """FLOPs by component, quantizer traffic by operand role and collective bytes per rank and step;
    with a device, the projected step time, MFU and model-body throughput of each layout."""
    lines = [
        f"Step cost per rank and optimizer step ({cost.tokens:,} tokens per rank):",
        "",
        "| component | TFLOP | GEMMs in |",
        "|---|---|---|",
    ]
    for name, flops in cost.flops.items():
        precision = _PRECISION[cost.precision[name]]
        native = ", ".join(
            f"{_PRECISION[TE_RECIPES[recipe].gemm]} (Transformer Engine's {recipe}, "
            f"{te_flops / max(flops, 1) * 100:.0f}%)"
            for recipe, te_flops in cost.native_flops.get(name, {}).items()
        )
        if native:
            precision = f"{native} where the device runs it, else {precision}"
        lines.append(f"| {name} | {flops / 1e12:,.1f} | {precision} |")
    lines.append(f"| **total** | **{cost.total_flops / 1e12:,.1f}** | |")
    traffic = dict.fromkeys(ROLES, 0.0)
    for p in cost.quant_passes:
        if not (p.tn_only and device is not None and device.fp8_gemm_any_layout):  # no FP8 transposes there
            traffic[p.role] += p.count * p.nbytes
    rht = sum(p.count * p.hadamard_flops for p in cost.quant_passes)
    by_role = ", ".join(f"{role} {nbytes / 1e9:,.0f}" for role, nbytes in traffic.items() if nbytes)
    lines.append(
        f"| quantization passes (amax, cast) | {sum(traffic.values()) / 1e9:,.1f} GB of HBM traffic"
        f"{f' ({by_role})' if by_role else ''} | memory-bound |"
    )
    if rht:
        lines.append(
            f"| random Hadamard transform (wgrad operands) | {rht / 1e12:,.2f} | BF16, in the quantization passes |"
        )
    lines.append(f"| model FLOPs (the trainer's MFU numerator) | {cost.model_flops / 1e12:,.1f} | |")
    layouts = list(cost.collectives)
    names = sorted(
        {c for layout in layouts for c in cost.collectives[layout]},
        key=("all-gather", "reduce-scatter", "all-reduce").index,
    )
    header = " | ".join(f"{layout} GB" + (" (configured)" if layout == cost.configured else "") for layout in layouts)
    lines += ["", f"| collective | {header} |", "|---|" + "---|" * len(layouts)]
    for name in names:
        row = " | ".join(f"{cost.collectives[layout].get(name, 0.0) / 1e9:,.1f}" for layout in layouts)
        lines.append(f"| {name} | {row} |")
    if device is not None:
        how = (
            "peak numbers, a lower bound on the step time (plan.efficiency=peak)"
            if efficiency is PEAK
            else "each kernel class at its measured fraction of peak (plan.efficiency=achieved; docs/planning.md)"
        )
        lines += [
            "",
            f"Projected on {device.name} ({how}; {device.source}):",
            "",
            "| layout | compute s | quantization s | communication s | of it exposed s | step s | MFU "
            "| tokens/s per GPU | model body tokens/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for layout in layouts:
            p = cost.project(device, layout, efficiency)
            lines.append(
                f"| {layout} | {sum(p.compute_s.values()):.2f} | {p.quant_s:.2f} | {p.comm_s:.2f} | "
                f"{p.exposed_comm_s:.2f} | {p.step_s:.2f} | {p.mfu * 100:.1f}% | {cost.tokens / p.step_s:,.0f} | "
                f"{p.body_tokens_per_s:,.0f} |"
            )
        for recipe in cost.native_by_recipe():
            if not device.runs(recipe):
                lines += [
                    "",
                    f"{device.name} does not run Transformer Engine's {recipe}, which needs "
                    f"{TE_RECIPES[recipe].needs}: its GEMMs are costed at the BF16 peak.",
                ]
    return "\n".join(lines)


def plan_summary(
    plan: MemoryPlan,
    cost: StepCost,
    device: Device | None,
    *,
    activation_checkpointing: str,
    simulated: SimulatedMemory | None = None,
    efficiency: Efficiency = PEAK,
) -> dict:
    """The plan as one JSON-ready dict (``nemofp4-plan format=json``), for sweeps and tools that read a plan
    without parsing its tables. The projection is the configured layout's; its keys are null without a
    device. Bytes are per GPU at the plan's peak."""
    out: dict = {
        "world_size": cost.world_size,
        "device": device.name if device else None,
        "layout": cost.configured,
        "tokens_per_step_per_gpu": cost.tokens,
        "step_s": None,
        "tokens_per_s_per_gpu": None,
        "body_tokens_per_s_per_gpu": None,
        "mfu": None,
    }
    if device is not None:
        p = cost.project(device, cost.configured, efficiency)
        out.update(
            step_s=p.step_s,
            tokens_per_s_per_gpu=cost.tokens / p.step_s,
            body_tokens_per_s_per_gpu=p.body_tokens_per_s,
            mfu=p.mfu,
            seconds={
                **p.compute_s,
                "quantization": p.quant_s,
                "communication": p.comm_s,
                "exposed communication": p.exposed_comm_s,
            },
        )
    out["flops"] = {**cost.flops, "model": cost.model_flops}
    out["memory"] = {
        "fits": plan.fits,
        "total_bytes": plan.total_bytes,
        "device_bytes": plan.device_bytes,
        "activation_checkpointing": activation_checkpointing,
        "peak": plan.peak.describe(),
        "items": {name: nbytes for name, nbytes, _ in plan.rows},
    }
    if simulated is not None:
        out["simulated"] = {"peak_bytes": simulated.peak_bytes, "items": dict(simulated.categories)}
    return out


def simulation_table(sim: SimulatedMemory, plan: MemoryPlan, *, world_size: int, wall_s: float) -> str:
    """The simulated peak item by item beside the plan at the same moment of the step."""
    same = plan.moment(sim.peak_phase, sim.peak_group, sim.peak_micro_batch)
    where = (
        f"{sim.peak_phase}"
        + (f" of {sim.peak_group}" if sim.peak_group else "")
        + f", {sim.peak_micro_batch} micro-batch"
    )
    lines = [
        f"Simulated: the training step on fake tensors, FSDP2 over a fake process group of {world_size} ranks, "
        f"FSDPMemTracker ({sim.micro_batches} micro-batch(es) run, Mamba scan {sim.mamba_scan}, {wall_s:.0f} s). "
        f"Peak in {where}.",
        "",
        "| item | simulated GiB | planned GiB (same moment) | planned - simulated |",
        "|---|---|---|---|",
    ]
    for name in CATEGORIES:
        simulated = sim.categories[name]
        planned = same.items[name] if same else 0
        diff = (
            f"{(planned - simulated) / simulated * 100:+.1f}%"
            if simulated
            else f"{(planned - simulated) / GIB:+.2f} GiB"
        )
        lines.append(f"| {name} | {simulated / GIB:.2f} | {planned / GIB:.2f} | {diff} |")
    planned_total = same.total if same else 0
    lines.append(
        f"| **total** | **{sim.peak_bytes / GIB:.2f}** | **{planned_total / GIB:.2f}** | "
        f"{(planned_total - sim.peak_bytes) / sim.peak_bytes * 100:+.1f}% |"
    )
    lines += [
        "",
        f"Simulated peak + {plan.reserve_bytes / GIB:.0f} GiB reserve: "
        f"{(sim.peak_bytes + plan.reserve_bytes) / GIB:.2f} GiB of {plan.device_bytes / GIB:.2f} GiB: "
        f"{'fits' if sim.peak_bytes + plan.reserve_bytes <= plan.device_bytes else 'does not fit'}",
    ]
    return "\n".join(lines)
