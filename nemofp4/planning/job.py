"""The plan, the simulation and the step cost of a composed training config (a ``JobConfig``): what
``nemofp4-plan`` prints and the trainer logs at start-up."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from nemofp4.kernels import gpu_quantizer
from nemofp4.models.loss import DEFAULT_CHUNK_TOKENS

from .cost import StepCost, step_cost
from .memory import GIB, MemoryPlan, candidate_policies, plan_memory
from .simulate import SimulatedMemory, simulate_memory

__all__ = [
    "Recommendation",
    "StartupPlanner",
    "choose_checkpointing",
    "cost_for_job",
    "device_memory_gib",
    "log_plan",
    "plan_for_job",
    "recommend_checkpointing",
    "simulate_for_job",
]


def _job(cfg, world_size: int) -> dict:
    from nemofp4.training.config import compute_budget

    dist_cfg = cfg.distributed
    budget = compute_budget(cfg.train, world_size)  # names the world sizes that divide the batch when this one does not
    return dict(
        recipe=cfg.recipe,
        grad_accum=budget.grad_accum,
        compute_dtype=dist_cfg.param_dtype if dist_cfg.backend == "fsdp" else cfg.train.dtype,
        head_precision=cfg.model.head_precision,
        keep_head_gathered=bool(getattr(dist_cfg, "keep_head_gathered", False)),
        quantizer=gpu_quantizer(cfg.train.kernels),  # the path kernels resolves for a CUDA job
    )


def _head_chunk_tokens(cfg, chunked_head: bool | None) -> int:
    """The head loss's chunk: the config's (``train.head_chunk_tokens``, 0: full logits) unless
    ``chunked_head`` says otherwise (true: the config's chunk, else 1024)."""
    chunk = cfg.train.head_chunk_tokens
    if chunked_head is not None:
        chunk = (chunk or DEFAULT_CHUNK_TOKENS) if chunked_head else 0
    return chunk


def plan_for_job(
    cfg,
    *,
    world_size: int,
    device_memory_gib: float,
    chunked_head: bool | None = None,
    reserve_gib: float = 4.0,
    mamba_scan: str = "auto",
    activation_checkpointing: str | None = None,
    measured=None,
) -> MemoryPlan:
    """:func:`~nemofp4.planning.memory.plan_memory` for a composed training config on ``world_size``
    GPUs; ``chunked_head`` defaults to what the config trains with (``train.head_chunk_tokens > 0``)."""
    job = _job(cfg, world_size)
    chunk = _head_chunk_tokens(cfg, chunked_head)
    return plan_memory(
        cfg.model,
        job["recipe"],
        cfg.distributed,
        world_size=world_size,
        seq_len=cfg.train.seq_len,
        micro_batch=cfg.train.micro_batch,
        grad_accum=job["grad_accum"],
        device_memory_gib=device_memory_gib,
        compute_dtype=job["compute_dtype"],
        activation_checkpointing=activation_checkpointing,
        head_chunk_tokens=chunk,
        head_precision=job["head_precision"],
        keep_head_gathered=job["keep_head_gathered"],
        mamba_scan=mamba_scan,
        quantizer=job["quantizer"],
        reserve_gib=reserve_gib,
        measured=measured,
        weight_cache=cfg.train.weight_cache,
    )


def simulate_for_job(
    cfg, *, world_size: int, mamba_scan: str = "auto", chunked_head: bool | None = None
) -> SimulatedMemory:
    """:func:`~nemofp4.planning.simulate.simulate_memory` of a composed training config (``chunked_head``:
    as for :func:`plan_for_job`)."""
    job = _job(cfg, world_size)
    return simulate_memory(
        cfg.model,
        job["recipe"],
        cfg.distributed,
        world_size=world_size,
        seq_len=cfg.train.seq_len,
        micro_batch=cfg.train.micro_batch,
        grad_accum=job["grad_accum"],
        compute_dtype=job["compute_dtype"],
        head_chunk_tokens=_head_chunk_tokens(cfg, chunked_head),
        optim=cfg.optim,
        mamba_scan=mamba_scan,
        quantizer=job["quantizer"],
        weight_cache=cfg.train.weight_cache,
    )


def cost_for_job(
    cfg,
    *,
    world_size: int,
    gpus_per_node: int = 8,
    policies: tuple[str, ...] = (),
    head_precision: str | None = None,
    chunked_head: bool | None = None,
) -> StepCost:
    """:func:`~nemofp4.planning.cost.step_cost` of a composed training config (``head_precision``
    overrides the config's ``model.head_precision``; ``chunked_head``: as for
    :func:`plan_for_job`)."""
    job = _job(cfg, world_size)
    if head_precision is not None:
        job["head_precision"] = head_precision
    return step_cost(
        cfg.model,
        job["recipe"],
        cfg.distributed,
        world_size=world_size,
        seq_len=cfg.train.seq_len,
        micro_batch=cfg.train.micro_batch,
        grad_accum=job["grad_accum"],
        head_chunk_tokens=_head_chunk_tokens(cfg, chunked_head),
        head_precision=job["head_precision"],
        keep_head_gathered=job["keep_head_gathered"],
        gpus_per_node=gpus_per_node,
        compute_dtype=job["compute_dtype"],
        policies=policies,
        weight_cache=cfg.train.weight_cache,
        optimizer="foreach" if cfg.optim.foreach else "for_loop",
    )


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """Every candidate checkpointing policy's peak and recompute cost, and the cheapest that fits."""

    rows: tuple[tuple[str, int, float, bool], ...]
    """(policy, total bytes per GPU, recompute FLOPs as a fraction of the step's, fits)."""
    chosen: str | None
    device_bytes: int

    def format(self) -> str:
        lines = ["| activation checkpointing | recompute | GiB per GPU | fits |", "|---|---|---|---|"]
        lines += [
            f"| {p} | +{f * 100:.1f}% FLOPs | {b / GIB:.2f} | {'yes' if ok else 'no'} |" for p, b, f, ok in self.rows
        ]
        at = f"{self.device_bytes / GIB:.0f} GiB"
        if self.chosen is None:
            lines += [
                "",
                f"Recommendation: does not fit at {at} under any checkpointing policy; use more GPUs, "
                "distributed.gradient_sync=per_micro_batch or a smaller train.micro_batch.",
            ]
        elif self.chosen == "none":
            lines += [
                "",
                f"Recommendation: fits at {at} without activation checkpointing "
                "(distributed.activation_checkpointing=none), no recompute.",
            ]
        else:
            fraction = next(f for p, _, f, _ in self.rows if p == self.chosen)
            lines += [
                "",
                f"Recommendation: fits at {at} {_policy_words(self.chosen)} "
                f"(distributed.activation_checkpointing={self.chosen}), +{fraction * 100:.0f}% FLOPs.",
            ]
        return "\n".join(lines)


def _policy_words(policy: str) -> str:
    if policy == "none":
        return "without activation checkpointing"
    if policy == "full":
        return "with checkpointing on every block"
    if policy.startswith("every_"):
        k = int(policy.removeprefix("every_"))
        suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
        return f"with checkpointing on every {k}{suffix} block"
    kinds = [{"mamba": "Mamba", "attention": "attention", "mlp": "MLP"}[k] for k in policy.split("+")]
    return f"with checkpointing on the {' and '.join(kinds)} blocks only"


def recommend_checkpointing(
    cfg, plan: MemoryPlan, *, world_size: int, reserve_gib: float = 4.0, chunked_head: bool | None = None
) -> Recommendation:
    """The plan of every :func:`~nemofp4.planning.memory.candidate_policies` policy (from ``plan``'s
    measurements: no new ones), and the one with the fewest recompute FLOPs that fits the device."""
    job = _job(cfg, world_size)
    policies = candidate_policies(cfg.model)
    cost = cost_for_job(cfg, world_size=world_size, policies=tuple(policies), chunked_head=chunked_head)
    base = cost.total_flops - cost.flops["recompute"]
    rows = []
    for policy in policies:
        other = plan_memory(
            cfg.model,
            job["recipe"],
            cfg.distributed,
            world_size=world_size,
            seq_len=cfg.train.seq_len,
            micro_batch=cfg.train.micro_batch,
            grad_accum=job["grad_accum"],
            device_memory_gib=plan.device_bytes / GIB,
            activation_checkpointing=policy,
            keep_head_gathered=job["keep_head_gathered"],
            mamba_scan=plan.mamba_scan,
            quantizer=plan.quantizer,
            reserve_gib=reserve_gib,
            measured=plan.measured,
            weight_cache=cfg.train.weight_cache,
        )
        rows.append((policy, other.total_bytes, cost.recompute_by_policy[policy] / base, other.fits))
    rows.sort(key=lambda r: r[2])
    chosen = next((p for p, _, _, ok in rows if ok), None)
    return Recommendation(rows=tuple(rows), chosen=chosen, device_bytes=plan.device_bytes)


def log_plan(cfg, *, world_size: int, device: torch.device, log) -> MemoryPlan | None:
    """At the start of a GPU run: log the plan for this job on this device, and warn when it does not
    fit. CPU runs have no device budget to plan against and skip it."""
    if device.type != "cuda":
        return None
    try:
        plan = plan_for_job(
            cfg, world_size=world_size, device_memory_gib=torch.cuda.get_device_properties(device).total_memory / GIB
        )
        # the policy to suggest, from the plan's measurements (no new ones)
        recommendation = None if plan.fits else recommend_checkpointing(cfg, plan, world_size=world_size)
    except Exception as exc:  # a diagnostic: never the reason a run does not start
        log.warning("no memory plan for this run (%s: %s)", type(exc).__name__, exc)
        return None
    log.info("memory plan (nemofp4-plan):\n%s", plan.format())
    if recommendation is not None:
        if recommendation.chosen is not None:
            advice = recommendation.format().splitlines()[-1].removeprefix("Recommendation: ")
        else:
            advice = (
                "no checkpointing policy fits; consider distributed.gradient_sync=per_micro_batch, a smaller "
                "train.micro_batch or more GPUs"
            )
        log.warning(
            "the memory plan needs %.1f GiB per GPU, more than this device's %.1f GiB; %s",
            plan.total_bytes / GIB,
            plan.device_bytes / GIB,
            advice,
        )
    return plan


def device_memory_gib(cfg, device: torch.device) -> float:
    """The memory per device a start-up plan fits in: ``distributed.device_memory_gib`` when set, else a
    CUDA device's total (``torch.cuda.mem_get_info``); a CPU has none to read."""
    if cfg.distributed.device_memory_gib:
        return float(cfg.distributed.device_memory_gib)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1] / GIB
    raise ValueError(
        f"distributed.activation_checkpointing=auto on a {device.type} device needs the memory to plan "
        "against: set distributed.device_memory_gib (e.g. 80 for an H100 80GB)"
    )


def _with_policy(cfg, policy: str):
    return replace(cfg, distributed=replace(cfg.distributed, activation_checkpointing=policy))


def _what_fits(cfg, plan: MemoryPlan, *, world_size: int, reserve_gib: float) -> str:
    """Where this job fits when it does not at ``world_size``: the smallest larger world size that
    divides the batch (the same measurements), and the largest smaller micro-batch (measured again)."""
    from nemofp4.training.config import compute_budget

    def fits(job, world, measured=None) -> bool:
        base = plan_for_job(
            job,
            world_size=world,
            device_memory_gib=plan.device_bytes / GIB,
            reserve_gib=reserve_gib,
            activation_checkpointing="full",
            mamba_scan=plan.mamba_scan,
            measured=measured,
        )
        return recommend_checkpointing(job, base, world_size=world, reserve_gib=reserve_gib).chosen is not None

    def valid(train, world) -> bool:
        try:
            compute_budget(train, world)
        except ValueError:
            return False
        return True

    train = cfg.train
    advice = []
    worlds = [w for w in range(world_size + 1, train.global_batch // train.micro_batch + 1) if valid(train, w)]
    world = next((w for w in worlds if fits(cfg, w, plan.measured)), None)
    if world is not None:
        advice.append(f"{world} GPUs (the smallest world size that divides train.global_batch and fits)")
    for micro in range(train.micro_batch - 1, 0, -1):
        smaller = replace(cfg, train=replace(train, micro_batch=micro))
        if valid(smaller.train, world_size) and fits(smaller, world_size):
            advice.append(f"train.micro_batch={micro} on {world_size} GPUs (the largest that fits)")
            break
    return (
        ("it fits on " + " or with ".join(advice))
        if advice
        else "no larger world size or smaller micro-batch fits either"
    )


def choose_checkpointing(
    cfg, *, world_size: int, memory_gib: float, reserve_gib: float, mamba_scan: str = "auto"
) -> tuple[str, Recommendation]:
    """The activation-checkpointing policy with the fewest recompute FLOPs whose memory plan fits
    ``memory_gib`` per GPU with ``reserve_gib`` kept free, and the table it was chosen from. The plan
    measures one block of each kind at the real widths (no simulation of the step). When nothing fits:
    a ValueError naming the smallest world size and the largest micro-batch that do."""
    cfg = _with_policy(cfg, "none")  # the policy is what is being chosen; the cost model needs a concrete one
    plan = plan_for_job(
        cfg, world_size=world_size, device_memory_gib=memory_gib, reserve_gib=reserve_gib, mamba_scan=mamba_scan
    )
    recommendation = recommend_checkpointing(cfg, plan, world_size=world_size, reserve_gib=reserve_gib)
    if recommendation.chosen is None:
        smallest = min(total for _, total, _, _ in recommendation.rows)
        raise ValueError(
            f"distributed.activation_checkpointing=auto: no policy fits {memory_gib:g} GiB per GPU "
            f"(distributed.memory_reserve_gib={reserve_gib:g} kept free) on {world_size} GPUs at "
            f"train.micro_batch={cfg.train.micro_batch}: the smallest needs {smallest / GIB:.2f} GiB; "
            f"{_what_fits(cfg, plan, world_size=world_size, reserve_gib=reserve_gib)}"
        )
    return recommendation.chosen, recommendation


class StartupPlanner:
    """The trainer's :class:`~nemofp4.training.job_plan.JobPlanner`, which nemofp4-train hands it."""

    def choose(self, cfg, *, world_size: int, device: torch.device):
        from nemofp4.training.job_plan import JobPlan

        started = time.perf_counter()
        memory, reserve = device_memory_gib(cfg, device), cfg.distributed.memory_reserve_gib
        policy, recommendation = choose_checkpointing(
            cfg,
            world_size=world_size,
            memory_gib=memory,
            reserve_gib=reserve,
            mamba_scan="auto" if device.type == "cuda" else "torch",
        )
        _, total, recompute, _ = next(r for r in recommendation.rows if r[0] == policy)
        reason = (
            f"+{recompute * 100:.1f}% FLOPs of recompute; plans {total / GIB:.2f} of {memory:.2f} GiB per device "
            f"with {reserve:g} GiB reserve on {world_size} ranks; planned in {time.perf_counter() - started:.1f} s"
        )
        return JobPlan(activation_checkpointing=policy, reason=reason, summary=recommendation.format())

    def log_plan(self, cfg, *, world_size: int, device: torch.device, log) -> None:
        log_plan(cfg, world_size=world_size, device=device, log=log)
