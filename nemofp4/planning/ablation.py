"""The NVFP4 recipe's ablation projected by the step-cost model: the recipe as Transformer Engine
runs it (RHT on the wgrad operands, the BF16 tail), without the RHT, with every eligible linear in
FP4, and both, as the model body's throughput on one device (what docs/planning.md tabulates)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .cost import Projection
from .devices import Device
from .efficiency import PEAK, Efficiency

__all__ = ["ABLATION_VARIANTS", "Ablation", "AblationRow", "recipe_ablation"]

ABLATION_VARIANTS: tuple[tuple[str, dict[str, object]], ...] = (
    ("the recipe: RHT on wgrad, BF16 tail", {}),
    ("without the RHT", {"disable_rht": True}),
    ("all eligible linears in FP4", {"num_bf16_last_layers": 0}),
    ("both changes", {"disable_rht": True, "num_bf16_last_layers": 0}),
)
"""(label, the recipe knobs that make it) of each variant; ``nvfp4_te`` and ``nvfp4`` take both knobs."""


@dataclass(frozen=True, kw_only=True)
class AblationRow:
    label: str
    knobs: dict[str, object]
    fp4_linears: int
    hadamard_flops: float
    """The random Hadamard transform's FLOPs per step and rank."""
    projection: Projection

    @property
    def gemm_s(self) -> float:
        return self.projection.compute_s["linear GEMMs"] + self.projection.compute_s["recompute"]


@dataclass(frozen=True, kw_only=True)
class Ablation:
    """The variants of one recipe on one device and layout, the first the recipe itself."""

    recipe: str
    device: Device
    world_size: int
    layout: str
    rows: tuple[AblationRow, ...]
    tokens: int = 0
    """This rank's tokens per optimizer step."""
    efficiency: Efficiency = PEAK

    def shares(self) -> dict[str, float]:
        """Of the body time the recipe saves or loses against both changes together: each change's
        share alone and what is left (their interaction)."""
        base, rht, tail, both = (r.projection.body_s for r in self.rows)

        def change(t: float) -> float:  # sums of the same passes in another order differ in the last bits
            return 0.0 if abs(base - t) < 1e-9 * base else base - t

        total = change(both)
        if total == 0:
            return {}
        interaction = total - change(rht) - change(tail)
        interaction = 0.0 if abs(interaction) < 1e-9 * base else interaction
        return {
            "without the RHT": change(rht) / total,
            "all eligible linears in FP4": change(tail) / total,
            "interaction": interaction / total,
        }

    def format(self) -> str:
        native = "native FP4 GEMMs" if self.recipe == "nvfp4_te" else "emulated: BF16 GEMMs and the quantizer"
        how = "the roofline, plan.efficiency=peak" if self.efficiency is PEAK else "achieved efficiency"
        lines = [
            f"{self.recipe} ablation on {self.device.name} at world {self.world_size} ({self.layout}; {native}; "
            f"{how}), per rank and optimizer step ({self.tokens:,} tokens):",
            "",
            "| variant | FP4 linears | linear GEMMs s | attention + scan s | quantization s | RHT TFLOP | "
            "of it RHT s | body s | body tokens/s per GPU | step s | tokens/s per GPU | vs the recipe |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        base = self.rows[0].projection.step_s
        for r in self.rows:
            p = r.projection
            other = p.compute_s["attention"] + p.compute_s["SSD scan"]
            lines.append(
                f"| {r.label} | {r.fp4_linears} | {r.gemm_s:.3f} | {other:.3f} | {p.quant_s:.3f} | "
                f"{r.hadamard_flops / 1e12:.2f} | {p.hadamard_s:.3f} | {p.body_s:.3f} | {p.body_tokens_per_s:,.0f} | "
                f"{p.step_s:.3f} | {self.tokens / p.step_s:,.0f} | {base / p.step_s:.3f}x |"
            )
        shares = self.shares()
        if shares:
            lines += [
                "",
                "Share of the body-time difference between the recipe and both changes: "
                + ", ".join(f"{name} {share * 100:.1f}%" for name, share in shares.items())
                + ".",
            ]
        return "\n".join(lines)


def recipe_ablation(
    cfg, *, device: Device, world_size: int, recipe: str | None = None, efficiency: Efficiency = PEAK
) -> Ablation:
    """The :data:`ABLATION_VARIANTS` of ``recipe`` (default: ``nvfp4_te`` on a device with FP4 tensor
    cores, else the emulated ``nvfp4``) for the composed training config ``cfg`` (its precision node is
    replaced; its model, batch and parallelism kept), projected on ``device`` in the configured layout
    at ``efficiency`` (:func:`~nemofp4.planning.efficiency.get_efficiency`; default the roofline)."""
    from nemofp4.recipes import is_quantized, precision_config

    from .job import cost_for_job
    from .layers import linear_specs

    recipe = recipe or ("nvfp4_te" if device.fp4_tflops else "nvfp4")
    if cfg.distributed.activation_checkpointing == "auto":  # what the preset's start-up picks on this device
        from .job import choose_checkpointing

        policy, _ = choose_checkpointing(
            cfg,
            world_size=world_size,
            memory_gib=device.memory_gib,
            reserve_gib=cfg.distributed.memory_reserve_gib,
            mamba_scan="mamba_ssm",
        )
        cfg = dataclasses.replace(
            cfg, distributed=dataclasses.replace(cfg.distributed, activation_checkpointing=policy)
        )
    rows = []
    for label, knobs in ABLATION_VARIANTS:
        job = dataclasses.replace(cfg, precision=precision_config(recipe, **knobs))
        cost = cost_for_job(job, world_size=world_size, gpus_per_node=device.gpus_per_node)
        fp4 = sum(is_quantized(s.part) for s in linear_specs(job.model, job.recipe))
        rows.append(
            AblationRow(
                label=label,
                knobs=knobs,
                fp4_linears=fp4,
                hadamard_flops=sum(p.count * p.hadamard_flops for p in cost.quant_passes),
                projection=cost.project(device, cost.configured, efficiency),
            )
        )
    return Ablation(
        recipe=recipe,
        device=device,
        world_size=world_size,
        layout=rows[0].projection.layout,
        rows=tuple(rows),
        tokens=cost.tokens,
        efficiency=efficiency,
    )
