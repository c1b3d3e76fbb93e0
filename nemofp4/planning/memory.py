"""The per-GPU memory plan of a training config: measured block and head costs, FSDP2's buffers by
formula, evaluated at every moment of the step where the peak can fall.

What one block, the head loss and the optimizer step keep alive is measured at the config's real
widths on fake tensors (:mod:`nemofp4.planning.measure`): the saves autograd keeps, the quantizer's
and the scan's temporaries, the backward's gradients. What FSDP2 holds is exact arithmetic on the
parameter shapes: FP32 master shards, AdamW's two moments, the gathered groups (the current one, the
one prefetched, the root), the FP32 gradient accumulators kept between micro-batches without
gradient sync, the sharded gradients and the reduce-scatter input in flight. The plan adds them up
at each candidate moment (each block's forward and backward, the head's, the embedding's backward,
the optimizer step, in the first, a middle and the last micro-batch) and reports the largest, item
by item as :mod:`nemofp4.planning.simulate` measures the whole step; a test holds the two within 10%.

Not counted: the CUDA context, NCCL's own buffers and allocator fragmentation (``reserve_gib``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from nemofp4.models import NemotronHConfig
from nemofp4.models.loss import DEFAULT_CHUNK_TOKENS, head_parameter_dtype
from nemofp4.recipes import Recipe, runs_in_transformer_engine
from nemofp4.training.parallel import AC_BLOCK_TYPES, DistributedConfig, ac_policy, checkpointed_blocks

from .measure import (
    BlockMeasure,
    HeadMeasure,
    measure_blocks,
    measure_head,
    measure_optimizer_step,
    sharded_numel,
)
from .standins import mamba_scan_path

__all__ = ["CATEGORIES", "Measured", "MemoryPlan", "Moment", "candidate_policies", "measure", "plan_memory"]

GIB = 2**30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

CATEGORIES = {
    "parameters": "FP32 master weights (this rank's shards)",
    "gathered parameters": "unsharded at the compute dtype: root, current and prefetched group, all-gather buffers",
    "gradients": "FP32 sharded gradients and the unsharded accumulators kept between micro-batches",
    "optimizer state": "AdamW's two FP32 moments (and the step's intermediates)",
    "activations": "kept by forward for backward (each checkpointed block: its input)",
    "temporaries": "made by backward: gradients, recompute, quantizer and scan buffers, head chunks",
    "communication buffers": "gradient reduce-scatter input in flight (FP32)",
}
"""The plan's items (the simulation's, from FSDPMemTracker's categories) and what each counts."""


@dataclass(frozen=True, kw_only=True)
class Moment:
    """The bytes alive at one moment of the step, by :data:`CATEGORIES`."""

    phase: str
    """'forward', 'backward' or 'optimizer step'."""
    group: str
    """The FSDP group running: 'layers.<i>', 'lm_head' (with the final norm), 'loss' (the full logits'
    cross-entropy, outside the head), 'root' (the embedding), or '' (the optimizer step)."""
    micro_batch: str
    """'first', 'middle', 'last' or 'only' (no gradient accumulation)."""
    items: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.items.values())

    def describe(self) -> str:
        where = f" of {self.group}" if self.group else ""
        return f"{self.phase}{where}, {self.micro_batch} micro-batch"


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Per-GPU bytes at the plan's peak moment, item by item, plus the headroom kept in reserve."""

    peak: Moment
    moments: tuple[Moment, ...]
    layers: tuple[BlockMeasure, ...]
    head: HeadMeasure
    activation_checkpointing: str
    activations_after_forward: int
    """Bytes saved for backward at the end of one micro-batch's forward (blocks, head and loss)."""
    reserve_bytes: int
    device_bytes: int
    mamba_scan: str
    quantizer: str
    measured: Measured
    """The measurements behind it, for planning other policies or world sizes of the same job."""
    weight_cache_bytes: int = 0
    """The step's cached FP4 weight operands (``train.weight_cache``), counted from the first
    micro-batch on: W as made in forward (activations), a 1-D weight's W^T in backward (temporaries)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def rows(self) -> tuple[tuple[str, int, str], ...]:
        """(item, bytes, what it counts) at the peak, the reserve last; they sum to ``total_bytes``."""
        rows = tuple((name, self.peak.items[name], how) for name, how in CATEGORIES.items())
        return rows + (("reserve", self.reserve_bytes, "CUDA context, NCCL buffers, fragmentation"),)

    @property
    def total_bytes(self) -> int:
        return self.peak.total + self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_bytes

    def moment(self, phase: str, group: str, micro_batch: str) -> Moment | None:
        return next((m for m in self.moments if (m.phase, m.group, m.micro_batch) == (phase, group, micro_batch)), None)

    def format(self) -> str:
        lines = [
            "| layer kind | quantized linears (part) | layers | saved per layer, no AC (GiB) | kept per layer with AC (GiB) |",
            "|---|---|---|---|---|",
        ]
        for c in self.layers:
            quantized = f"{c.quantized_linears} ({c.quantized_parts})" if c.quantized_linears else "0"
            lines.append(
                f"| {c.kind} | {quantized} | {c.count} | {c.saved_bytes / GIB:.3f} | {c.input_bytes / GIB:.3f} |"
            )
        lines += ["", f"| item | GiB per GPU | counted as (peak: {self.peak.describe()}) |", "|---|---|---|"]
        lines += [f"| {name} | {nbytes / GIB:.2f} | {how} |" for name, nbytes, how in self.rows]
        lines.append(f"| **total** | **{self.total_bytes / GIB:.2f}** | |")
        lines += [
            "",
            f"Mamba scan: {self.mamba_scan} ({_SCAN_NOTE[self.mamba_scan]}); emulated quantizer: {self.quantizer}.",
        ]
        if self.weight_cache_bytes:
            lines.append(
                f"FP4 weights quantized once per step (train.weight_cache): {self.weight_cache_bytes / GIB:.2f} GiB "
                "of packed operands held through the step."
            )
        lines += list(self.notes)
        verdict = "fits" if self.fits else "does not fit"
        lines += [
            "",
            f"{self.total_bytes / GIB:.2f} GiB of {self.device_bytes / GIB:.2f} GiB per GPU "
            f"(activation checkpointing {self.activation_checkpointing}): {verdict}",
        ]
        return "\n".join(lines)


_SCAN_NOTE = {
    "torch": "the pure-PyTorch SSD scan, what CPU runs and CUDA runs without mamba-ssm use",
    "mamba_ssm": "mamba-ssm's and causal-conv1d's CUDA kernels, measured by stand-ins that save what they save",
}


# ------------------------------------------------------------------------------------ FSDP arithmetic
@dataclass(frozen=True)
class _Group:
    name: str
    numel: int
    gathered_bytes: int
    """Bytes of the group's unsharded parameters at its gathered dtype."""
    shapes: tuple[tuple[int, ...], ...]


def _groups(model: NemotronHConfig, *, compute_bytes: int, head_bytes: int) -> list[_Group]:
    """FSDP2's groups in forward order: the blocks, the LM head (its own group), the root."""
    from nemofp4.models import build_model

    meta = build_model(model, device="meta")

    def group(name, modules, nbytes):
        params = [p for m in modules for p in m.parameters()]
        numel = sum(p.numel() for p in params)
        return _Group(name, numel, numel * nbytes, tuple(tuple(p.shape) for p in params))

    groups = [group(f"layers.{i}", [b], compute_bytes) for i, b in enumerate(meta.layers)]
    if not model.tie_word_embeddings:
        groups.append(group("lm_head", [meta.lm_head], head_bytes))
    groups.append(group("root", [meta.embeddings, meta.norm_f], compute_bytes))
    return groups


def _shard_bytes(group: _Group, shards: int) -> int:
    return 4 * sum(sharded_numel(s, shards) for s in group.shapes)


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What a plan measures once for a model, recipe and micro-batch (every policy and world size
    reuses it): the blocks, the head, FSDP's groups and AdamW's step intermediates per state byte."""

    blocks: list[BlockMeasure]
    head: HeadMeasure
    groups: list[_Group]
    optimizer_step_per_byte: float
    fp32_head_part: bool
    chunk_tokens: int


def measure(
    model: NemotronHConfig,
    recipe: Recipe,
    *,
    seq_len: int,
    micro_batch: int,
    compute_dtype: str = "bfloat16",
    head_chunk_tokens: int = 0,
    head_precision: str = "fp32",
    mamba_scan: str = "torch",
    quantizer: str = "triton",
    fsdp: bool = True,
) -> Measured:
    """The measurements :func:`plan_memory` adds up (see the module docstring); ``fsdp``: under FSDP2,
    whose mixed-precision policies cast each group's inputs."""
    from .layers import head_is_fp32_part

    if compute_dtype not in _DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r}; valid: {tuple(_DTYPES)}")
    dtype = _DTYPES[compute_dtype]
    fp32_part = head_is_fp32_part(model, recipe)
    head_dtype = head_parameter_dtype(head_precision, fp32_part=fp32_part, compute_dtype=dtype)  # its gathered dtype
    blocks = measure_blocks(
        model,
        recipe,
        seq_len=seq_len,
        micro_batch=micro_batch,
        dtype=dtype,
        quantizer=quantizer,
        mamba_ssm=mamba_scan_path(mamba_scan) == "mamba_ssm",
    )
    head = measure_head(
        model,
        seq_len=seq_len,
        micro_batch=micro_batch,
        dtype=dtype,
        head_weight_dtype=head_dtype,
        chunk_tokens=head_chunk_tokens,
        fp32_head=fp32_part,
        fsdp=fsdp,
    )
    shapes = [(4096,), (256, 64), (3, 17)]
    step = measure_optimizer_step(shapes) / (4 * sum(math.prod(s) for s in shapes))
    return Measured(
        blocks=blocks,
        head=head,
        groups=_groups(model, compute_bytes=dtype.itemsize, head_bytes=head_dtype.itemsize),
        optimizer_step_per_byte=step,
        fp32_head_part=fp32_part,
        chunk_tokens=head_chunk_tokens,
    )


def plan_memory(
    model: NemotronHConfig,
    recipe: Recipe,
    dist_cfg: DistributedConfig,
    *,
    world_size: int,
    seq_len: int,
    micro_batch: int,
    grad_accum: int,
    device_memory_gib: float,
    compute_dtype: str = "bfloat16",
    activation_checkpointing: str | bool | None = None,
    chunked_head: bool = False,
    head_chunk_tokens: int | None = None,
    head_precision: str = "fp32",
    keep_head_gathered: bool = False,
    mamba_scan: str = "torch",
    quantizer: str = "triton",
    reserve_gib: float = 4.0,
    measured: Measured | None = None,
    weight_cache: bool = True,
) -> MemoryPlan:
    """The per-GPU memory of training ``model`` under ``recipe`` and ``dist_cfg`` on ``world_size`` GPUs.

    ``activation_checkpointing`` defaults to the config's policy; ``compute_dtype`` is the dtype blocks
    compute in (FSDP2's ``param_dtype`` on GPU). The LM-head loss is chunked in ``head_chunk_tokens``
    (``chunked_head=True``: 1024) or computed on full FP32 logits; ``head_precision`` (fp32, tf32, bf16)
    sets the head's gathered dtype; ``keep_head_gathered`` keeps it gathered from forward to backward
    (which follow each other: no change at the peak). ``mamba_scan`` and ``quantizer`` are the paths the
    run takes (:func:`nemofp4.planning.standins.mamba_scan_path`, :func:`~nemofp4.planning.measure.gpu_quantizer_path`).
    ``measured`` reuses the measurements (:func:`measure`) of an earlier plan of the same model and batch.
    ``weight_cache``: with gradient accumulation, each FP4 weight's packed operands are kept from its
    first use in the step to the optimizer step (``train.weight_cache``).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; must be >= 1")
    policy = ac_policy(
        dist_cfg.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    )
    chunk = head_chunk_tokens if head_chunk_tokens is not None else (DEFAULT_CHUNK_TOKENS if chunked_head else 0)
    scan = mamba_scan_path(mamba_scan)
    if measured is None:
        measured = measure(
            model,
            recipe,
            seq_len=seq_len,
            micro_batch=micro_batch,
            compute_dtype=compute_dtype,
            head_chunk_tokens=chunk,
            head_precision=head_precision,
            mamba_scan=scan,
            quantizer=quantizer,
            fsdp=dist_cfg.backend == "fsdp",
        )
    blocks, head = measured.blocks, measured.head
    moments = _moments(
        model,
        dist_cfg,
        policy,
        measured,
        world_size=world_size,
        grad_accum=grad_accum,
        tokens=micro_batch * seq_len,
        keep_head_gathered=keep_head_gathered,
    )
    cache = _weight_cache(model, recipe) if weight_cache and grad_accum > 1 else None
    if cache is not None:
        moments = [_with_weight_cache(m, *cache) for m in moments]
    peak = max(moments, key=lambda m: m.total)
    by_layer = {i: b for b in blocks for i in b.layers}
    chosen = checkpointed_blocks(policy, [t.block_type for t in model.layer_types])
    after_forward = sum(by_layer[i].kept(c) for i, c in enumerate(chosen)) + head.saved_bytes
    notes = ()
    emulated = {p.precision for p in recipe.parts.values() if p.kind == "fp4"}
    if quantizer == "triton" and "fp4" in emulated:
        notes += (
            "FP4 operands are quantized by the Triton kernels of a CUDA run (their buffers, from the kernels' "
            "fake implementations); train.kernels=eager plans the torch program's.",
        )
    if "fp8" in emulated:
        notes += (
            "Emulated FP8 operands are quantized by the torch program (the Triton kernels have no FP8 payloads).",
        )
    te_recipes = sorted({p.te_recipe for p in recipe.parts.values() if runs_in_transformer_engine(p)})
    if te_recipes:
        notes += (
            f"Transformer Engine's linears ({', '.join(te_recipes)}) are measured by stand-ins that keep what "
            "te.Linear keeps under FSDP2 (nemofp4/planning/te_linear.py).",
        )
    return MemoryPlan(
        peak=peak,
        moments=tuple(moments),
        layers=tuple(blocks),
        head=head,
        activation_checkpointing=policy,
        activations_after_forward=after_forward,
        reserve_bytes=int(reserve_gib * GIB),
        weight_cache_bytes=sum(map(sum, cache)) if cache else 0,
        device_bytes=int(device_memory_gib * GIB),
        mamba_scan=scan,
        quantizer=quantizer,
        measured=measured,
        notes=notes,
    )


def _weight_cache(model: NemotronHConfig, recipe: Recipe) -> tuple[list[int], list[int]]:
    """Per block: the bytes of its FP4 weights' cached fprop operands (made in forward) and of the
    dgrad operands of 1-D weights (made in backward)."""
    from .layers import cached_weight_bytes, linear_specs

    made_in_forward, made_in_backward = [0] * model.num_layers, [0] * model.num_layers
    for spec in linear_specs(model, recipe):
        if spec.layer is not None:
            fprop, dgrad = cached_weight_bytes(spec)
            made_in_forward[spec.layer] += fprop
            made_in_backward[spec.layer] += dgrad
    return made_in_forward, made_in_backward


def _with_weight_cache(m: Moment, made_in_forward: list[int], made_in_backward: list[int]) -> Moment:
    """``m`` with the cached weight operands alive then: none before a block's first forward in the
    step or after the last backward; a 1-D weight's W^T from its block's first backward."""
    if m.phase == "optimizer step":
        return m
    first = m.micro_batch == "first"
    layer = int(m.group.split(".")[1]) if m.group.startswith("layers.") else None
    if m.phase == "forward":
        w = sum(made_in_forward[: layer + 1]) if first and layer is not None else sum(made_in_forward)
        wt = 0 if first else sum(made_in_backward)
    else:
        w = sum(made_in_forward)
        start = layer if layer is not None else (0 if m.group == "root" else len(made_in_backward))
        wt = sum(made_in_backward[start:]) if first else sum(made_in_backward)
    items = dict(m.items)
    items["activations"] += w
    items["temporaries"] += wt
    return replace(m, items=items)


def _moments(
    model, dist_cfg, policy, measured: Measured, *, world_size, grad_accum, tokens, keep_head_gathered: bool = False
) -> list[Moment]:
    blocks, head, groups, chunked = measured.blocks, measured.head, measured.groups, measured.chunk_tokens > 0
    backend = dist_cfg.backend
    by_layer = {i: b for b in blocks for i in b.layers}
    chosen = checkpointed_blocks(policy, [t.block_type for t in model.layer_types])
    kept = [by_layer[i].kept(c) for i, c in enumerate(chosen)]
    layers = [g for g in groups if g.name.startswith("layers.")]
    head_group = next((g for g in groups if g.name == "lm_head"), None)
    root = groups[-1]
    fsdp = backend in ("fsdp", "deepspeed_zero3")
    shards = (
        world_size // dist_cfg.replicate_degree
        if backend == "fsdp"
        else (world_size if backend == "deepspeed_zero3" else 1)
    )
    param_shards = shards
    grad_shards = world_size if backend in ("deepspeed_zero2", "deepspeed_zero3") else shards
    optim_shards = world_size if dist_cfg.engine == "deepspeed" else shards
    sharded = {g.name: _shard_bytes(g, param_shards) for g in groups}
    params = sum(sharded.values())
    optim = 2 * sum(_shard_bytes(g, optim_shards) for g in groups)
    ids = tokens * 8
    accumulate = backend == "fsdp" and dist_cfg.gradient_sync == "per_step" and grad_accum > 1
    per_micro = backend == "fsdp" and dist_cfg.gradient_sync == "per_micro_batch"
    # the micro-batches whose memory differs (the others repeat the middle one), named as the simulation names them
    kinds = ["only"] if grad_accum == 1 else (["first", "middle", "last"] if grad_accum > 2 else ["first", "last"])
    backward_order = ([head_group] if head_group else []) + layers[::-1] + [root]

    shard = {g.name: _shard_bytes(g, grad_shards) for g in groups}
    accum = {g.name: 4 * g.numel for g in groups}

    def grads(kind: str, done: set[str]) -> int:
        if not fsdp and backend != "deepspeed_zero2":  # replicated or ZeRO-1 gradients: full FP32 .grad
            return 4 * sum(g.numel for g in groups if g.name in done or kind in ("middle", "last"))
        if accumulate:
            if kind == "first":
                return sum(accum[n] for n in done)
            if kind == "middle":
                return sum(accum.values())
            return sum(accum[n] for n in accum if n not in done) + sum(shard[n] for n in done)
        if kind in ("middle", "last"):  # reduced every micro-batch: every sharded gradient exists after the first
            return sum(shard.values())
        return sum(shard[n] for n in done)

    def reduce_buffer(kind: str, previous: str | None) -> int:
        syncs = kind in ("last", "only") or per_micro
        if backend != "fsdp" or not syncs or previous is None:
            return 0
        return 4 * next(g.numel for g in groups if g.name == previous)

    def moment(phase, group, kind, *, gathered, grads_, act, temp, comm, opt_extra=0):
        items = {
            "parameters": params,
            "gathered parameters": gathered,
            "gradients": grads_,
            "optimizer state": optim + opt_extra,
            "activations": act,
            "temporaries": temp,
            "communication buffers": comm,
        }
        return Moment(phase=phase, group=group, micro_batch=kind, items=items)

    # groups not resharded after forward stay gathered until their backward is done
    # (distributed.reshard_after_forward=false: every group; keep_head_gathered: the head)
    keeps = set()
    if backend == "fsdp":
        keeps = {
            g.name for g in groups if not dist_cfg.reshard_after_forward or (g.name == "lm_head" and keep_head_gathered)
        }

    def gathered(*names: str, buffers: tuple[str, ...] = (), kept: tuple[str, ...] = ()) -> int:
        """The groups ``names`` unsharded, the all-gather buffers of ``buffers`` (a prefetch of a kept
        group gathers nothing), and of the groups ``kept`` those that stayed gathered since forward."""
        if not fsdp:
            return 0
        unsharded = set(names) | (set(kept) & keeps)
        return sum(g.gathered_bytes for g in groups if g.name in unsharded) + sum(
            g.gathered_bytes for g in groups if g.name in buffers
        )

    def gathered_again(*names: str) -> tuple[str, ...]:  # the groups backward all-gathers again
        return tuple(n for n in names if n not in keeps)

    names = [g.name for g in layers]
    out = []
    for kind in kinds:
        # forward: the root gathered throughout, each group with its all-gather buffer while it runs
        for i, g in enumerate(layers):
            fwd = by_layer[i].forward_peak[chosen[i]]
            out.append(
                moment(
                    "forward",
                    g.name,
                    kind,
                    gathered=gathered("root", g.name, buffers=(g.name,), kept=names[:i]),
                    grads_=grads(kind, set()),
                    act=sum(kept[:i]) + fwd + ids,
                    temp=0,
                    comm=0,
                )
            )
        # the full logits' head runs inside the model's forward (the root still gathered); the chunked loss
        # after it returned (the root resharded)
        root_too = ("root",) if not chunked else ()
        if head_group:
            out.append(
                moment(
                    "forward",
                    "lm_head",
                    kind,
                    gathered=gathered("lm_head", *root_too, buffers=("lm_head",), kept=("root", *names)),
                    grads_=grads(kind, set()),
                    act=sum(kept) + head.head_forward_peak + ids,
                    temp=0,
                    comm=0,
                )
            )
        if not chunked:  # the cross-entropy on the full logits, after the model's forward returned
            out.append(
                moment(
                    "forward",
                    "loss",
                    kind,
                    gathered=gathered(kept=("root", *names, "lm_head")),
                    grads_=grads(kind, set()),
                    act=sum(kept) + head.forward_peak + ids,
                    temp=0,
                    comm=0,
                )
            )
        done: set[str] = set()
        previous = None
        for g in backward_order:
            if g.name == "lm_head":
                if not chunked:  # the cross-entropy's backward, before the head (and the root) gather again
                    act, temp = head.loss_backward_peak
                    out.append(
                        moment(
                            "backward",
                            "loss",
                            kind,
                            gathered=gathered(kept=("root", *names, "lm_head")),
                            grads_=grads(kind, done),
                            act=sum(kept) + act + ids,
                            temp=temp,
                            comm=0,
                        )
                    )
                act, temp = head.backward_peak
                last = (f"layers.{len(layers) - 1}",) if not chunked and layers else ()
                out.append(
                    moment(
                        "backward",
                        "lm_head",
                        kind,
                        gathered=gathered(
                            "lm_head",
                            *root_too,
                            buffers=gathered_again("root") if chunked else gathered_again(*last),
                            kept=("root", *names),
                        ),
                        grads_=grads(kind, done),
                        act=sum(kept) + act + ids,
                        temp=temp,
                        comm=0,
                    )
                )
            elif g.name == "root":
                embedding_grad = model.vocab_size * model.hidden_size * (root.gathered_bytes // max(root.numel, 1))
                out.append(
                    moment(
                        "backward",
                        "root",
                        kind,
                        gathered=gathered("root"),
                        grads_=grads(kind, done),
                        act=ids,
                        temp=embedding_grad,
                        comm=reduce_buffer(kind, previous),
                    )
                )
            else:
                i = int(g.name.split(".")[1])
                act, temp = by_layer[i].backward_peak[chosen[i]]
                if not head_group and i == len(layers) - 1:
                    act += head.saved_bytes
                prefetch = (f"layers.{i - 1}",) if i > 0 else ()
                out.append(
                    moment(
                        "backward",
                        g.name,
                        kind,
                        gathered=gathered("root", g.name, buffers=gathered_again(*prefetch), kept=names[:i]),
                        grads_=grads(kind, done),
                        act=sum(kept[:i]) + act + ids,
                        temp=temp,
                        comm=reduce_buffer(kind, previous),
                    )
                )
            done.add(g.name)
            previous = g.name
    step_extra = int(measured.optimizer_step_per_byte * sum(_shard_bytes(g, optim_shards) for g in groups))
    out.append(
        moment(
            "optimizer step",
            "",
            kinds[-1],
            gathered=0,
            grads_=grads(kinds[-1], {g.name for g in groups}),
            act=0,
            temp=0,
            comm=0,
            opt_extra=step_extra,
        )
    )
    return out


def candidate_policies(model: NemotronHConfig) -> list[str]:
    """The activation-checkpointing policies a recommendation chooses from: none, each present block
    type and each pair, every 2nd, 3rd and 4th block, full."""
    present = [t for t in AC_BLOCK_TYPES if t in {lt.block_type for lt in model.layer_types}]
    singles = list(present)
    pairs = ["+".join(p) for i, a in enumerate(present) for p in [(a, b) for b in present[i + 1 :]]]
    return ["none", *singles, *pairs, "every_4", "every_3", "every_2", "full"]
