"""Per-GPU memory plan of a training config: model state, activations per layer kind, LM head.

Activation costs are measured, not modelled: one block of each distinct (layer kind, recipe) pair
runs forward at the config's real widths and sequence length under ``FakeTensorMode`` (shapes and
dtypes only, no memory or compute), and the bytes of the tensors autograd saves for backward that
are not parameters are summed (``torch.autograd.graph.saved_tensors_hooks``, one count per
storage). FP4 linears are stood in for by a linear that saves what ``QuantLinear`` saves: the
bytes per element of its saved operands are measured by running the real ``QuantLinear`` on small
CPU tensors (its saves are linear in tokens x in_features and in out_features x in_features).

Known limits: the Mamba scan is measured on the pure-PyTorch SSD path (mamba-ssm's fused kernel
saves less, so that is an upper bound); allocator fragmentation, NCCL buffers and the CUDA context
are covered only by the ``reserve_gib`` headroom.
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nemofp4.models import NemotronHConfig
from nemofp4.models.loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from nemofp4.models.nemotron_h.model import Block, RMSNorm
from nemofp4.quant import FP32Linear, LinearQuantConfig, QuantLinear, set_quant_backend
from nemofp4.recipes import Recipe
from nemofp4.recipes.apply import resolve_recipe
from nemofp4.recipes.recipe import HighPrecision, TransformerEngineNVFP4
from nemofp4.training.parallel import DistributedConfig

GIB = 2**30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------ measuring saves
class _SavedBytes:
    """Context that sums the bytes of distinct non-parameter storages autograd saves inside it."""

    def __init__(self, exclude: list[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage()._cdata for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in self._excluded:
            self._seen[storage._cdata] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> _SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode that are still alive (``live``) and
    the most alive at once (``peak``): what the plan's figures are checked against on real tensors.
    Storages of the tensors passed in (inputs, parameters) and their views are not counted."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._existing = {t.untyped_storage().data_ptr() for t in existing}

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or key in self._existing or storage.nbytes() == 0:
            return
        self._seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


@cache
def _fp4_save_coefficients(part: LinearQuantConfig) -> tuple[float, float, float]:
    """(bytes per token x in_feature, bytes per out x in_feature, constant bytes) saved by a real
    ``QuantLinear`` with ``part``, solved from three small CPU runs (tokens a multiple of 16)."""

    def measure(tokens: int, k: int, n: int) -> int:
        linear = nn.Linear(k, n, bias=False)
        QuantLinear.from_linear(linear, part, index=0)
        set_quant_backend(linear, "eager")  # the saves of every backend; no compile for a measurement
        x = torch.randn(tokens, k, requires_grad=True)
        with warnings.catch_warnings(), _SavedBytes(exclude=[linear.weight, x]) as saved:
            warnings.simplefilter("ignore")  # no step is set: current scaling, the same saves
            linear(x)
        return saved.bytes

    base, more_tokens, more_out = measure(64, 64, 64), measure(128, 64, 64), measure(64, 64, 128)
    per_xk = (more_tokens - base) / (64 * 64)
    per_nk = (more_out - base) / (64 * 64)
    return per_xk, per_nk, base - per_xk * 64 * 64 - per_nk * 64 * 64


class _FP4SavesFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, nbytes: int, keep_weight: bool):
        saved = [torch.empty(nbytes, dtype=torch.uint8, device=x.device)]
        ctx.save_for_backward(*saved, *([weight] if keep_weight else []))
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):  # never run: the plan measures forward only
        raise NotImplementedError


class _FP4Saves(nn.Module):
    """Stands in for ``QuantLinear`` under FakeTensorMode: same output shape, same saved bytes."""

    def __init__(self, linear: nn.Linear, coefficients: tuple[float, float, float]) -> None:
        super().__init__()
        self.weight = linear.weight
        self.coefficients = coefficients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_xk, per_nk, constant = self.coefficients
        n, k = self.weight.shape
        tokens = math.prod(x.shape[:-1])
        padded = -(-tokens // 16) * 16
        nbytes = round(per_xk * padded * k + per_nk * n * k + constant)
        return _FP4SavesFunction.apply(x, self.weight, nbytes, per_nk == 0)


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _emulated_part(part) -> LinearQuantConfig | None:
    """The LinearQuantConfig whose saves a linear's part is planned with (TE's NVFP4 as emulated NVFP4)."""
    if isinstance(part, LinearQuantConfig):
        return part
    if isinstance(part, TransformerEngineNVFP4):
        from nemofp4.recipes import get_recipe

        return next(p for p in get_recipe("nvfp4").parts.values() if isinstance(p, LinearQuantConfig))
    return None


@dataclass(frozen=True, kw_only=True)
class LayerKindCost:
    """Saved bytes of one block kind under one recipe selection, for one micro-batch."""

    kind: str
    fp4_linears: int
    fp4_parts: str
    """Recipe parts of the FP4 linears ('' when none)."""
    count: int
    saved_bytes: int
    """Saved for backward by the block, without activation checkpointing."""
    input_bytes: int
    """What activation checkpointing keeps instead: the block's input."""


def measure_layer_costs(model: NemotronHConfig, recipe: Recipe, *, seq_len: int, micro_batch: int,
                        dtype: torch.dtype) -> list[LayerKindCost]:
    """One :class:`LayerKindCost` per distinct (block kind, FP4 linears) of the model under ``recipe``."""
    parts = _linear_parts(model, recipe)
    groups: dict[tuple, list[int]] = {}
    for i, layer_type in enumerate(model.layer_types):
        selection = tuple(sorted((name.split(".", 2)[2], part_name) for name, (part_name, part) in parts.items()
                                 if name.startswith(f"layers.{i}.") and _emulated_part(part) is not None))
        groups.setdefault((layer_type.block_type, selection), []).append(i)
    costs = []
    for (kind, selection), layers in groups.items():
        i = layers[0]
        coefficients = {name: _fp4_save_coefficients(_emulated_part(parts[f"layers.{i}.{name}"][1]))
                        for name, _ in selection}
        with _fake_mode():
            block = Block(model, i, device="cpu", dtype=dtype)
            for name, _ in selection:
                mixer_child = name.split(".", 1)[1]
                linear = getattr(block.mixer, mixer_child)
                setattr(block.mixer, mixer_child, _FP4Saves(linear, coefficients[name]))
            x = torch.empty(micro_batch, seq_len, model.hidden_size, dtype=dtype, requires_grad=True)
            with _SavedBytes(exclude=list(block.parameters())) as saved:
                block(x)
        costs.append(LayerKindCost(kind=kind, fp4_linears=len(selection), fp4_parts=",".join(sorted({p for _, p in selection})),
                                   count=len(layers), saved_bytes=saved.bytes,
                                   input_bytes=x.numel() * x.element_size()))  # fmt: skip
    return costs


def _linear_parts(model: NemotronHConfig, recipe: Recipe) -> dict:
    from nemofp4.models import build_model

    meta = build_model(model, device="meta")
    return {fqn: ((recipe.rules[i].part, recipe.parts[recipe.rules[i].part]) if i is not None
                  else ("(no rule)", HighPrecision(compute="model")))
            for fqn, _, i in resolve_recipe(meta, recipe)}  # fmt: skip


def measure_head_cost(model: NemotronHConfig, recipe: Recipe, *, seq_len: int, micro_batch: int, dtype: torch.dtype,
                      chunked: bool, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[int, int]:
    """(bytes saved by embedding + final norm + LM head + loss, the loss backward's largest transient)."""
    _, head_part = _linear_parts(model, recipe).get("lm_head", ("", None))
    fp32_head = isinstance(head_part, HighPrecision) and head_part.compute == "fp32"
    tokens = micro_batch * seq_len
    with _fake_mode():
        embeddings = nn.Embedding(model.vocab_size, model.hidden_size, device="cpu", dtype=dtype)
        norm = RMSNorm(model.hidden_size, model.norm_eps, device="cpu", dtype=dtype)
        head = nn.Linear(model.hidden_size, model.vocab_size, bias=False, device="cpu", dtype=dtype)
        if fp32_head:
            FP32Linear.from_linear(head)
        ids = torch.empty(micro_batch, seq_len, dtype=torch.long)
        labels = torch.empty(micro_batch, seq_len, dtype=torch.long)
        params = [*embeddings.parameters(), *norm.parameters(), *head.parameters()]
        with _SavedBytes(exclude=params) as saved:
            h = embeddings(ids)
            h = h.detach().requires_grad_()  # the blocks sit between; their saves are counted per layer
            h = norm(h)
            if chunked:
                chunked_cross_entropy(h, head.weight, labels, chunk_tokens=chunk_tokens)
            else:
                logits = head(h).float()
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    # backward: the logits' gradient (plain) or one chunk's logits and gradient (chunked)
    transient = (min(chunk_tokens, tokens) if chunked else tokens) * model.vocab_size * 4 * (2 if chunked else 1)
    return saved.bytes, transient


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Per-GPU bytes by component; ``rows`` sum to ``total_bytes``."""

    rows: tuple[tuple[str, int, str], ...]
    """(component, bytes, how it is counted)."""
    layers: tuple[LayerKindCost, ...]
    activation_checkpointing: bool
    activations_after_forward: int
    """Bytes saved for backward at the end of one micro-batch's forward (layers + head)."""
    device_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b, _ in self.rows)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_bytes

    def format(self) -> str:
        lines = ["| layer kind | FP4 linears (part) | layers | saved per layer, no AC (GiB) | kept per layer with AC (GiB) |",
                 "|---|---|---|---|---|"]  # fmt: skip
        for c in self.layers:
            fp4 = f"{c.fp4_linears} ({c.fp4_parts})" if c.fp4_linears else "0"
            lines.append(f"| {c.kind} | {fp4} | {c.count} | {c.saved_bytes / GIB:.3f} | {c.input_bytes / GIB:.3f} |")
        lines += ["", "| component | GiB per GPU | counted as |", "|---|---|---|"]
        lines += [f"| {name} | {nbytes / GIB:.2f} | {how} |" for name, nbytes, how in self.rows]
        lines.append(f"| **total** | **{self.total_bytes / GIB:.2f}** | |")
        verdict = "fits" if self.fits else "does not fit"
        ac = "on" if self.activation_checkpointing else "off"
        lines += ["", f"{self.total_bytes / GIB:.2f} GiB of {self.device_bytes / GIB:.2f} GiB per GPU "
                      f"(activation checkpointing {ac}): {verdict}"]  # fmt: skip
        return "\n".join(lines)


def plan_memory(model: NemotronHConfig, recipe: Recipe, dist_cfg: DistributedConfig, *, world_size: int, seq_len: int,
                micro_batch: int, grad_accum: int, device_memory_gib: float, compute_dtype: str = "bfloat16",
                activation_checkpointing: bool | None = None, chunked_head: bool = False,
                reserve_gib: float = 4.0) -> MemoryPlan:
    """The per-GPU memory of training ``model`` under ``recipe`` and ``dist_cfg`` on ``world_size`` GPUs.

    ``activation_checkpointing`` defaults to the config's; ``compute_dtype`` is the dtype blocks
    compute in (FSDP2's ``param_dtype`` on GPU). ``reserve_gib`` stands for the CUDA context,
    communication buffers and fragmentation.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; must be >= 1")
    if compute_dtype not in _DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r}; valid: {tuple(_DTYPES)}")
    dtype = _DTYPES[compute_dtype]
    ac = dist_cfg.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    n = model.num_parameters()
    backend = dist_cfg.backend
    shard = world_size // dist_cfg.replicate_degree if backend == "fsdp" else 1
    param_shard, grad_shard, optim_shard = {
        "none": (1, 1, 1), "fsdp": (shard, shard, shard), "deepspeed_zero1": (1, 1, world_size),
        "deepspeed_zero2": (1, world_size, world_size), "deepspeed_zero3": (world_size, world_size, world_size),
    }[backend]  # fmt: skip
    reduce_bytes = _DTYPES[dist_cfg.reduce_dtype].itemsize
    rows: list[tuple[str, int, str]] = [
        ("parameters (FP32 master)", 4 * n // param_shard, f"{n / 1e9:.3f}B x 4 B / {param_shard}"),
        ("gradients (FP32)", 4 * n // grad_shard, f"x 4 B / {grad_shard}"),
        ("optimizer state (AdamW, 2 x FP32)", 8 * n // optim_shard, f"x 8 B / {optim_shard}"),
    ]
    layers = measure_layer_costs(model, recipe, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype)
    block_params = _largest_block_parameters(model)
    if backend in ("fsdp", "deepspeed_zero3"):
        gathered = 2 * block_params * dtype.itemsize + 2 * model.vocab_size * model.hidden_size * 4
        rows.append(("gathered parameters", gathered,
                     "2 blocks (current + prefetched) at compute dtype, embeddings + head in FP32"))  # fmt: skip
    if backend == "fsdp" and dist_cfg.gradient_sync == "per_step" and grad_accum > 1:
        rows.append(("unsharded gradient accumulators", n * reduce_bytes,
                     f"gradient_sync=per_step with {grad_accum} micro-batches: every parameter's gradient, "
                     "unsharded, until the last micro-batch"))  # fmt: skip
    if ac:
        layer_bytes = sum(c.input_bytes * c.count for c in layers)
        how = "each block's input (activation checkpointing)"
    else:
        layer_bytes = sum(c.saved_bytes * c.count for c in layers)
        how = "saves of every block, measured (see table)"
    head_saved, head_transient = measure_head_cost(model, recipe, seq_len=seq_len, micro_batch=micro_batch,
                                                   dtype=dtype, chunked=chunked_head)  # fmt: skip
    rows.append(("activations: blocks", layer_bytes, how))
    rows.append(("activations: embeddings, final norm, LM head + loss", head_saved,
                 "measured, " + ("chunked loss" if chunked_head else "full FP32 logits")))  # fmt: skip
    recompute = max(c.saved_bytes for c in layers) if ac else 0
    working = max(head_transient, recompute + 2 * micro_batch * seq_len * model.hidden_size * 4)
    rows.append(("backward working memory", working,
                 "largest of: loss gradient over the vocabulary; one block recomputed + its input gradients"))
    rows.append(("reserve", int(reserve_gib * GIB), "CUDA context, communication buffers, fragmentation"))
    return MemoryPlan(rows=tuple(rows), layers=tuple(layers), activation_checkpointing=ac,
                      activations_after_forward=layer_bytes + head_saved,
                      device_bytes=int(device_memory_gib * GIB))  # fmt: skip


def _largest_block_parameters(model: NemotronHConfig) -> int:
    with torch.device("meta"):
        kinds = {t.block_type: i for i, t in enumerate(model.layer_types)}
        return max(sum(p.numel() for p in Block(model, i).parameters()) for i in kinds.values())


def plan_for_job(cfg, *, world_size: int, device_memory_gib: float, chunked_head: bool | None = None,
                 reserve_gib: float = 4.0) -> MemoryPlan:
    """:func:`plan_memory` for a composed training config (a ``JobConfig``) on ``world_size`` GPUs;
    ``chunked_head`` defaults to what the config trains with (``train.head_chunk_tokens > 0``)."""
    if chunked_head is None:
        chunked_head = cfg.train.head_chunk_tokens > 0
    from nemofp4.recipes import recipe_from_config
    from nemofp4.training.config import compute_budget

    dist_cfg = cfg.distributed
    budget = compute_budget(cfg.train, world_size)
    compute_dtype = dist_cfg.param_dtype if dist_cfg.backend == "fsdp" else cfg.train.dtype
    return plan_memory(cfg.model, recipe_from_config(cfg.precision), dist_cfg, world_size=world_size,
                       seq_len=cfg.train.seq_len, micro_batch=cfg.train.micro_batch, grad_accum=budget.grad_accum,
                       device_memory_gib=device_memory_gib, compute_dtype=compute_dtype, chunked_head=chunked_head,
                       reserve_gib=reserve_gib)  # fmt: skip


def log_plan(cfg, *, world_size: int, device: torch.device, log) -> MemoryPlan | None:
    """At the start of a GPU run: log the plan for this job on this device, and warn when it does not
    fit. CPU runs have no device budget to plan against and skip it."""
    if device.type != "cuda":
        return None
    try:
        plan = plan_for_job(cfg, world_size=world_size,
                            device_memory_gib=torch.cuda.get_device_properties(device).total_memory / GIB)  # fmt: skip
    except Exception as exc:  # a diagnostic: never the reason a run does not start
        log.warning("no memory plan for this run (%s: %s)", type(exc).__name__, exc)
        return None
    log.info("memory plan (nemofp4-plan):\n%s", plan.format())
    if not plan.fits:
        log.warning("the memory plan needs %.1f GiB per GPU, more than this device's %.1f GiB; consider "
                    "distributed.activation_checkpointing=true, a smaller train.micro_batch or more GPUs",
                    plan.total_bytes / GIB, plan.device_bytes / GIB)  # fmt: skip
    return plan
