"""The training step of a job, run at its real widths on fake tensors over a fake process group, and
its per-GPU memory peak measured by FSDP2's memory tracker.

Nothing is allocated and nothing is computed: ``FakeTensorMode`` gives every tensor its shape,
dtype and storage size only, and ``torch.testing``'s fake process group (backend ``fake``) lets
FSDP2 issue its collectives for ``world_size`` ranks from this one process. What runs is the
trainer's own code: the model built on meta, the recipe applied, activation checkpointing and
FSDP2/HSDP wrapped by :func:`nemofp4.training.parallel.parallelize` (with the GPU mixed-precision
policy), the chunked head loss through the head's FSDP forward method, forward and backward of
the micro-batches and one AdamW step. ``FSDPMemTracker`` attributes every storage alive at the peak
to parameters, gradients, optimizer state, activations, temporaries or communication buffers.

Cheap enough for the 8B on a laptop CPU because only what differs is run: with gradient
accumulation the first micro-batch, one of the middle ones and the last (the others repeat the
middle one), the Triton quantizer's glue with its kernels' fake implementations (what a GPU run
executes, one op per quantization), and no weight initialization (values are fake).
The optimizer state exists before the measured step, as in every step after the first.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nemofp4.models import NemotronHConfig, build_model, lm_loss, param_groups
from nemofp4.quant import (
    cached_weights,
    run_inside_for,
    set_held_reference_reduce_group,
    set_quant_backend,
    set_quant_stats,
    set_step,
)
from nemofp4.recipes import Recipe, apply_recipe
from nemofp4.training.optim import OptimConfig, build_optimizer
from nemofp4.training.parallel import DistributedConfig, parallelize, set_gradient_sync

from .launches import op_bytes
from .measure import gpu_quantizer_path, warm_format_tables
from .memory import CATEGORIES
from .standins import mamba_kernel_standins, mamba_scan_path
from .te_linear import te_linear_standins

__all__ = ["SimulatedMemory", "simulate_memory"]

GIB = 2**30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_TRACKER_CATEGORIES = {
    "Sharded Param": "parameters",
    "Buffer": "parameters",
    "Unsharded Param": "gathered parameters",
    "All Gather": "gathered parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "OptState": "optimizer state",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "Reduce Scatter": "communication buffers",
}
"""FSDPMemTracker's categories -> the plan's (:data:`nemofp4.planning.memory.CATEGORIES`). Gathered
parameters and the all-gather buffers are one item: the tracker names a gathered group's storage
either way depending on when the group was gathered."""


@dataclass(frozen=True, kw_only=True)
class SimulatedMemory:
    """The per-GPU peak of one simulated training step, by category."""

    categories: dict[str, int]
    """Bytes alive at the peak, by :data:`nemofp4.planning.memory.CATEGORIES`."""
    tracker: dict[str, int]
    """The same by FSDPMemTracker's own categories."""
    peak_phase: str
    """Where the peak happened: 'forward', 'backward' or 'optimizer step'."""
    peak_group: str
    """The FSDP group running at the peak: 'layers.<i>', 'lm_head' (the final norm, head and loss),
    'root' (the embedding) or '' (the optimizer step)."""
    peak_micro_batch: str
    """'first', 'middle', 'last' or 'only'."""
    peak_module: str
    """The innermost module running at the peak."""
    micro_batches: int
    """Micro-batches run (of the step's grad_accum)."""
    collectives: dict[str, float]
    """Bytes this rank sends per optimizer step by collective ('all-gather', 'reduce-scatter',
    'all-reduce'; ring algorithms), counted as FSDP2 issues them and scaled from the micro-batches run
    to the step's (the ones not run repeat the middle one)."""
    fsdp_copies: dict[str, float]
    """HBM bytes per optimizer step of FSDP2's copy-out of each all-gather into the parameters and copy-in of the
    gradients into each reduce-scatter (``all-gather copy-out``, ``reduce-scatter copy-in``), read and written as
    their ops' schemas say, scaled as :attr:`collectives`."""
    mamba_scan: str
    wall_s: float
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def peak_bytes(self) -> int:
        return sum(self.categories.values())


def _tracker_class():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    class _PhaseTracker(FSDPMemTracker):
        """FSDPMemTracker that keeps the global peak only (not every module's, which it updates at every
        op: most of its cost), records where the peak happened, and counts FSDP2's gradient accumulators."""

        peak_phase, peak_group, peak_module, peak_micro_batch = "forward", "", "", "only"
        micro_batch = "only"

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig_post_backward):
            # Workaround for a torch limitation: the tracker attributes the unsharded parameters' ``.grad``
            # only; the FP32 accumulators FSDP2 keeps between micro-batches without gradient sync
            # (``FSDPParam.unsharded_accumulated_grad``) would be counted as backward temporaries.
            tracked = super()._fsdp_param_group_post_backward(fsdp_mod, orig_post_backward)

            def post_backward(*args, **kwargs):
                tracked(*args, **kwargs)
                group = fsdp_mod._get_fsdp_state()._fsdp_param_group
                for fsdp_param in group.fsdp_params if group else ():
                    if fsdp_param.unsharded_accumulated_grad is not None:
                        self._update_and_maybe_create_winfos(
                            fsdp_param.unsharded_accumulated_grad, _FSDPRefType.UNSHARDED_GRAD
                        )

            return post_backward

        def _update_peak_stats(self, peak_state) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                    self._peak_mem[dev] = dev_snap["Total"]
                    self._peak_mem_snap[dev] = dict(dev_snap)
                    self.peak_phase = (
                        "optimizer step" if self._in_opt else ("backward" if self._mod_tracker.is_bw else "forward")
                    )
                    self.peak_module = max(self._mod_tracker.parents, key=len, default="")
                    self.peak_group = "" if self._in_opt else _group_of(self._mod_tracker.parents)
                    self.peak_micro_batch = self.micro_batch

    return _PhaseTracker


def _group_of(modules: set[str]) -> str:
    """The FSDP group of the innermost running modules (by name): 'loss' outside every module."""
    if not modules or modules <= {"Global"}:
        return "loss"
    for name in sorted(modules, key=len, reverse=True):
        parts = name.split(".")
        if "layers" in parts:
            return ".".join(parts[parts.index("layers") :][:2])
        if "lm_head" in parts or "norm_f" in parts:
            return "lm_head"
        if "embeddings" in parts:
            return "root"
    return "root"


def _micro_batch_kind(index: int, grad_accum: int) -> str:
    if grad_accum == 1:
        return "only"
    return "first" if index == 0 else ("last" if index == grad_accum - 1 else "middle")


def _distinct_micro_batches(grad_accum: int) -> list[int]:
    """The micro-batches whose memory differs: the first (no gradient accumulator exists yet), one
    in the middle (every accumulator exists; all the others repeat it) and the last (gradients are
    reduced; with per-micro-batch reduction it repeats the middle one)."""
    return sorted({0, min(1, grad_accum - 1), grad_accum - 1})


@contextlib.contextmanager
def _head_loss_through_call(model: nn.Module):
    """Workaround for a torch limitation: FSDPMemTracker instruments FSDP2's pre/post-forward *hooks*,
    but a method registered with ``register_fsdp_forward_method`` (our chunked head loss,
    ``training.parallel.attach_head_loss``) calls ``FSDPState._pre_forward`` directly, so the tracker
    never sees the head unshard and fails with a KeyError in its pre-backward. During the simulation
    the head's loss method runs as the head module's ``__call__`` with the loss as its forward: the
    same FSDP pre/post-forward (all-gather, reshard, backward hooks), now through the hooks."""
    from nemofp4.models.loss import HEAD_LOSS_METHOD, head_cross_entropy

    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, HEAD_LOSS_METHOD):
        yield
        return

    def loss_via_call(hidden, labels, **kwargs):
        head.forward = functools.partial(head_cross_entropy, head)
        try:
            return head(hidden, labels, **kwargs)
        finally:
            del head.forward

    registered = getattr(head, HEAD_LOSS_METHOD)
    setattr(head, HEAD_LOSS_METHOD, loss_via_call)
    try:
        yield
    finally:
        setattr(head, HEAD_LOSS_METHOD, registered)


class _CopyBytes(TorchDispatchMode):
    """Counts the HBM bytes of FSDP2's copy ops around its collectives into a :class:`_CollectiveBytes`: its
    copy-out and copy-in ops, and the casts and adds its post-backward hook makes of kept gradients (found by the
    hook's ``record_function`` scopes, which dispatch as ops)."""

    _OPS = {"split_with_sizes_copy": "all-gather copy-out", "chunk_cat": "reduce-scatter copy-in"}
    _ACCUMULATE_SCOPES = ("FSDP::post_backward_accumulate", "FSDP::post_backward_reshard")
    _ACCUMULATE_OPS = ("_to_copy", "add_")

    def __init__(self, counts: _CollectiveBytes) -> None:
        super().__init__()
        self.counts = counts
        self.scopes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = func.overloadpacket.__name__
        if op == "_record_function_enter_new":
            self.scopes.append(args[0])
        elif op == "_record_function_exit" and self.scopes:
            self.scopes.pop()
        elif func.namespace == "fsdp" and op in self._OPS:
            self._add(self._OPS[op], op_bytes(func, args, kwargs, out))
        elif op in self._ACCUMULATE_OPS and any(s.startswith(self._ACCUMULATE_SCOPES) for s in self.scopes):
            self._add("gradient accumulation", op_bytes(func, args, kwargs, out))
        return out

    def _add(self, name: str, nbytes: float) -> None:
        by = self.counts.copies.setdefault(self.counts.kind, {})
        by[name] = by.get(name, 0.0) + nbytes


class _CollectiveBytes:
    """Counts the bytes of FSDP2's collectives (``all_gather_single``, ``reduce_scatter_single``,
    ``all_reduce`` of ``torch.distributed``) per micro-batch kind, as one rank sends them in a ring, and (with
    :class:`_CopyBytes`) the bytes of its copies around them."""

    _CALLS = {"all_gather_single": "all-gather", "reduce_scatter_single": "reduce-scatter", "all_reduce": "all-reduce"}

    def __init__(self) -> None:
        self.kind = "only"
        self.bytes: dict[str, dict[str, float]] = {}
        self.copies: dict[str, dict[str, float]] = {}

    def _counted(self, name: str, call):
        collective = self._CALLS[name]

        def counted(*args, **kwargs):
            tensor = kwargs.get("output", kwargs.get("tensor", args[0] if args else None))
            if collective == "reduce-scatter":
                tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            ranks = dist.get_world_size(kwargs.get("group"))
            factor = (2 if collective == "all-reduce" else 1) * (ranks - 1) / ranks
            by = self.bytes.setdefault(self.kind, {})
            by[collective] = by.get(collective, 0.0) + factor * tensor.numel() * tensor.element_size()
            return call(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def counting(self):
        saved = {name: getattr(dist, name) for name in self._CALLS}
        for name, call in saved.items():
            setattr(dist, name, self._counted(name, call))
        try:
            with _CopyBytes(self):
                yield self
        finally:
            for name, call in saved.items():
                setattr(dist, name, call)

    @staticmethod
    def per_step(counted: dict[str, dict[str, float]], grad_accum: int) -> dict[str, float]:
        """``counted`` (by micro-batch kind) over the step's micro-batches (the ones not run repeat the middle)."""
        repeats = {"first": 1, "middle": max(grad_accum - 2, 0), "last": 1, "only": 1}
        out: dict[str, float] = {}
        for kind, by in counted.items():
            for name, nbytes in by.items():
                out[name] = out.get(name, 0.0) + nbytes * repeats[kind]
        return out


@contextlib.contextmanager
def _fake_process_group(world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError(
            "the memory simulation creates its own fake process group; run it in a process "
            "without one (nemofp4-plan simulate=true)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def simulate_memory(
    model: NemotronHConfig,
    recipe: Recipe,
    dist_cfg: DistributedConfig,
    *,
    world_size: int,
    seq_len: int,
    micro_batch: int,
    grad_accum: int,
    compute_dtype: str = "bfloat16",
    head_chunk_tokens: int = 0,
    optim: OptimConfig | None = None,
    mamba_scan: str = "torch",
    quantizer: str = "triton",
    weight_cache: bool = True,
) -> SimulatedMemory:
    """Run one training step of ``model`` under ``recipe`` and ``dist_cfg`` as rank 0 of ``world_size``
    on fake tensors and return its per-GPU memory peak (see the module docstring).

    ``compute_dtype`` is the GPU run's (``distributed.param_dtype`` under FSDP, else ``train.dtype``):
    bfloat16 runs under autocast with FSDP2's BF16 mixed precision. ``mamba_scan``: ``torch`` or
    ``mamba_ssm`` (the CUDA kernels' stand-ins, :mod:`nemofp4.planning.standins`). ``quantizer``: the
    FP4 quantizer path of the GPU run, ``triton`` (``train.kernels`` auto/triton on CUDA) or ``eager``.
    ``weight_cache``: the micro-batches run inside :func:`nemofp4.quant.cached_weights`, as the trainer's.
    """
    if quantizer not in ("triton", "eager"):
        raise ValueError(f"quantizer={quantizer!r}; valid: triton, eager")
    if dist_cfg.backend != "fsdp":
        raise ValueError(
            f"distributed.backend={dist_cfg.backend!r}: the simulation measures FSDP2 runs "
            "(distributed=fsdp); FSDPMemTracker needs FSDP2, DeepSpeed's engine does not run on "
            "fake tensors"
        )
    if compute_dtype not in _DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r}; valid: {tuple(_DTYPES)}")
    scan = mamba_scan_path(mamba_scan)
    started = time.perf_counter()
    from torch._subclasses.fake_tensor import FakeTensorMode

    warm_format_tables(recipe)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fake_process_group(world_size))
        net = build_model(model, device="meta")
        with te_linear_standins(recipe.needs_transformer_engine):
            apply_recipe(net, recipe, log=False)
        set_quant_backend(net, quantizer)
        # the device mesh reads host data: it is built outside the fake mode, on the meta model
        net = parallelize(net, dist_cfg, device_type="cpu", mixed_precision=compute_dtype == "bfloat16")
        fake = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        net.to_empty(device="cpu")
        if world_size > 1 and dist_cfg.reduce_references:
            set_held_reference_reduce_group(net, dist.group.WORLD)
        optimizer = build_optimizer(optim or OptimConfig(), param_groups(net, (optim or OptimConfig()).weight_decay))
        for p in net.parameters():  # the state of every step after the first
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        tracker = _tracker_class()(net, optimizer)
        run_inside_for(type(tracker))  # the FP4 linears' temporaries too
        stack.enter_context(mamba_kernel_standins(scan == "mamba_ssm"))
        stack.enter_context(gpu_quantizer_path(quantizer))
        stack.enter_context(_head_loss_through_call(net))
        autocast = (
            (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
            if compute_dtype == "bfloat16"
            else contextlib.nullcontext
        )
        micro_batches = _distinct_micro_batches(grad_accum)
        collectives = stack.enter_context(_CollectiveBytes().counting())
        tracker.track_inputs((ids,))
        stack.enter_context(tracker)
        set_step(net, 1, seed=0, rank=0)
        set_quant_stats(net, False)  # statistics are kept on logging steps only
        with cached_weights(net, enabled=weight_cache and grad_accum > 1):  # freed before the optimizer step
            for i, micro in enumerate(micro_batches):
                if i:
                    # Workaround for a torch limitation: FSDPMemTracker refuses a second forward of the root
                    # module in one tracking ("multiple iterative calls"); its per-module statistics are
                    # cleared between micro-batches, the global peak it keeps is not.
                    tracker.reset_mod_stats()
                set_gradient_sync(net, dist_cfg, micro_batch=micro, grad_accum=grad_accum)
                collectives.kind = _micro_batch_kind(micro, grad_accum)
                tracker.micro_batch = collectives.kind
                with autocast():
                    loss = lm_loss(net, ids, ids, head_chunk_tokens=head_chunk_tokens)
                (loss / (grad_accum * world_size)).backward()
                del loss
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        del fake
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    raw = {str(getattr(k, "value", k)): v for k, v in peak.items() if str(getattr(k, "value", k)) != "Total"}
    categories = dict.fromkeys(CATEGORIES, 0)
    for name, nbytes in raw.items():
        categories[_TRACKER_CATEGORIES[name]] += nbytes
    return SimulatedMemory(
        categories=categories,
        tracker=raw,
        peak_phase=tracker.peak_phase,
        peak_group=tracker.peak_group,
        peak_micro_batch=tracker.peak_micro_batch,
        peak_module=tracker.peak_module,
        micro_batches=len(micro_batches),
        collectives=collectives.per_step(collectives.bytes, grad_accum),
        fsdp_copies=collectives.per_step(collectives.copies, grad_accum),
        mamba_scan=scan,
        wall_s=time.perf_counter() - started,
    )
