"""Kernels one block launches and the bytes its elementwise kernels move, and the bytes of the optimizer step,
counted from our code path.

One block of the model is built at its real widths on the meta device and run forward and backward under
a dispatch mode that records every ATen op (nothing is allocated or computed). Each op is one kernel on a
GPU except those that only make a view or allocate (:data:`NO_KERNEL`); the GEMMs (``mm`` and its kin) and
the attention kernel are counted apart, as the step-cost model times them by FLOPs. Attention runs as a
stand-in counted as one forward and one backward kernel (on meta, SDPA decomposes into its math path; on a
GPU it is one fused kernel each way). The Mamba mixer runs its GPU path with the planner's stand-ins for
mamba-ssm's scan and causal-conv1d (:mod:`nemofp4.planning.standins`), counted as the kernels the real ops
launch (:data:`~nemofp4.planning.standins.SCAN_KERNELS`, :data:`~nemofp4.planning.standins.CONV_KERNELS`;
timed by FLOPs as the SSD scan). A recipe's quantizer kernels are costed as passes over memory
(:class:`nemofp4.planning.cost.QuantPass`): the block is counted in the compute dtype.

Eager PyTorch launches every op; ``torch.compile`` fuses the elementwise ops between two GEMM or attention
kernels into (about) one kernel, so the compiled count takes each such run of ops as one kernel. The bytes
of the eager elementwise ops are what each op's schema says it reads and writes (:func:`op_bytes`).

The optimizer step (gradient clipping and AdamW) is counted the same way over FP32 tensors on meta
(:func:`optimizer_step_bytes`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nemofp4.models import NemotronHConfig

__all__ = [
    "ADAMW_IMPLEMENTATIONS",
    "BlockLaunches",
    "NO_KERNEL",
    "count_block_launches",
    "op_bytes",
    "optimizer_step_bytes",
]

NO_KERNEL = frozenset(
    {
        "alias",
        "as_strided",
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "expand",
        "lift_fresh",
        "new_empty",
        "new_empty_strided",
        "permute",
        "scalar_tensor",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unflatten",
        "unsafe_split",
        "unsqueeze",
        "view",
        "_unsafe_view",
        "_reshape_alias",
    }
)
"""ATen ops that launch no kernel: views, and allocations the caching allocator serves."""
GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul"})


@dataclass(frozen=True)
class BlockLaunches:
    """One block's forward and backward for one micro-batch."""

    eager_kernels: int
    """Kernels eager PyTorch launches (GEMMs and attention included)."""
    compiled_kernels: int
    """Kernels with every run of elementwise ops between GEMM and attention kernels fused into one."""
    gemm_kernels: int
    attention_kernels: int
    scan_kernels: int
    """mamba-ssm's and causal-conv1d's kernels."""
    eager_elementwise_bytes: float
    """Bytes the eager elementwise kernels read and write."""
    forward_eager_elementwise_bytes: float
    """Of those, the forward's (what a recompute repeats)."""
    forward_eager_kernels: int
    """Of :attr:`eager_kernels`, the forward's (what a recompute launches again)."""
    forward_compiled_kernels: int
    """Of :attr:`compiled_kernels`, the forward's."""


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def op_bytes(func, args: tuple, kwargs: dict, out) -> float:
    """HBM bytes one ATen op moves, from its schema: every tensor argument read (but an ``out=`` argument),
    every argument it mutates written, and every return that is not an alias of an argument written."""
    read = written = 0.0
    bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    for arg in func._schema.arguments:
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(bound.get(arg.name)))
        mutated = arg.alias_info is not None and arg.alias_info.is_write
        read += 0.0 if mutated and arg.kwarg_only else nbytes
        written += nbytes if mutated else 0.0
    outs = (out,) if len(func._schema.returns) == 1 else out or ()  # one return may be a list of tensors
    for ret, value in zip(func._schema.returns, outs):
        if ret.alias_info is None:
            written += sum(t.numel() * t.element_size() for t in _tensors(value))
    return read + written


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.ops: list[tuple[str, str, float]] = []  # (kind, phase, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        on_device = any(t.device.type != "cpu" for t in _tensors((args, kwargs, out)))
        if name in NO_KERNEL or not on_device:  # a view, an allocation, or host work (a CPU step count)
            return out
        kind = "gemm" if name in GEMM_OPS else "elementwise"
        self.ops.append((kind, self.phase, op_bytes(func, args, kwargs, out)))
        return out


class _AttentionStandIn(torch.autograd.Function):
    """Causal attention as one forward and one backward kernel, recorded in the active :class:`_Counter`."""

    @staticmethod
    def forward(ctx, counter, q, k, v):
        ctx.counter = counter
        ctx.save_for_backward(k, v)
        counter.ops.append(("attention", counter.phase, 0.0))
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        k, v = ctx.saved_tensors
        ctx.counter.ops.append(("attention", "backward", 0.0))
        return None, torch.empty_like(grad), torch.empty_like(k), torch.empty_like(v)


class _AttentionAsOneKernel(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :class:`_AttentionStandIn` (on meta it would decompose into
    its math path, many kernels a GPU does not run)."""

    def __init__(self, counter: _Counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            return _AttentionStandIn.apply(self.counter, q, k, v)
        return func(*args, **(kwargs or {}))


class _Launches(torch.autograd.Function):
    """Records a CUDA op's kernels in the active :class:`_Counter`, passing a tensor through: ``forward`` of
    them as it runs, ``backward`` of them as the gradient reaches it."""

    @staticmethod
    def forward(ctx, counter, forward: int, backward: int, x):
        ctx.counter, ctx.backward = counter, backward
        counter.ops += [("scan", counter.phase, 0.0)] * forward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.counter.ops += [("scan", "backward", 0.0)] * ctx.backward
        return None, None, None, grad


@contextlib.contextmanager
def _mamba_kernels_counted(counter: _Counter):
    """Inside :func:`~nemofp4.planning.standins.mamba_kernel_standins`: the scan's and the conv's stand-ins
    record the kernels the real ops launch, the forward's before the op, the backward's where its gradient
    arrives."""
    from nemofp4.models.nemotron_h import model as mixer_module

    from .standins import CONV_KERNELS, SCAN_KERNELS

    def counted(op, kernels):
        def call(x, *args, **kwargs):
            out = op(_Launches.apply(counter, kernels.forward, 0, x), *args, **kwargs)
            if isinstance(out, tuple):
                return (_Launches.apply(counter, 0, kernels.backward, out[0]), *out[1:])
            return _Launches.apply(counter, 0, kernels.backward, out)

        return call

    saved = mixer_module.ssd_scan, mixer_module.causal_depthwise_conv1d
    mixer_module.ssd_scan = counted(saved[0], SCAN_KERNELS)
    mixer_module.causal_depthwise_conv1d = counted(saved[1], CONV_KERNELS)
    try:
        yield
    finally:
        mixer_module.ssd_scan, mixer_module.causal_depthwise_conv1d = saved


_CACHE: dict[tuple, BlockLaunches] = {}


def _count(
    model: NemotronHConfig, block_type: str, micro_batch: int, seq_len: int, dtype: torch.dtype
) -> BlockLaunches:
    from nemofp4.models.nemotron_h.model import Block

    index = next(i for i, t in enumerate(model.layer_types) if t.block_type == block_type)
    block = Block(model, index, device="meta", dtype=dtype)
    x = torch.empty(micro_batch, seq_len, model.hidden_size, device="meta", dtype=dtype, requires_grad=True)
    counter = _Counter()
    from .standins import mamba_kernel_standins

    with mamba_kernel_standins(True), _mamba_kernels_counted(counter), _AttentionAsOneKernel(counter), counter:
        y = block(x)
        counter.phase = "backward"
        y.backward(torch.empty_like(y))
    ops = counter.ops

    def fused(ops: list) -> int:
        """Kernels with every run of elementwise ops between GEMM and attention kernels fused into one."""
        return sum(
            1 for i, (kind, *_) in enumerate(ops) if kind != "elementwise" or i == 0 or ops[i - 1][0] != "elementwise"
        )

    forward = [op for op in ops if op[1] == "forward"]
    elementwise = [(phase, nbytes) for kind, phase, nbytes in ops if kind == "elementwise"]
    return BlockLaunches(
        eager_kernels=len(ops),
        compiled_kernels=fused(ops),
        forward_eager_kernels=len(forward),
        forward_compiled_kernels=fused(forward),
        gemm_kernels=sum(kind == "gemm" for kind, *_ in ops),
        attention_kernels=sum(kind == "attention" for kind, *_ in ops),
        scan_kernels=sum(kind == "scan" for kind, *_ in ops),
        eager_elementwise_bytes=sum(b for _, b in elementwise),
        forward_eager_elementwise_bytes=sum(b for p, b in elementwise if p == "forward"),
    )


def count_block_launches(
    model: NemotronHConfig, block_type: str, *, micro_batch: int, seq_len: int, compute_dtype: str = "bfloat16"
) -> BlockLaunches:
    """The launches of one ``block_type`` block of ``model`` (its first in the pattern), forward and backward of
    one micro-batch of ``micro_batch`` x ``seq_len`` tokens, in ``compute_dtype``. Cached."""
    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else torch.float32
    key = (repr(model), block_type, micro_batch, seq_len, dtype)
    if key not in _CACHE:
        _CACHE[key] = _count(model, block_type, micro_batch, seq_len, dtype)
    return _CACHE[key]


ADAMW_IMPLEMENTATIONS = ("foreach", "for_loop", "fused")
"""How ``torch.optim.AdamW`` runs its step: ``foreach`` (its multi-tensor ops, one kernel per op over every
tensor: our trainer's ``optim.foreach=true`` and TorchTitan's default), ``for_loop`` (the same ops tensor by
tensor) or ``fused`` (one kernel reading each state once: ``fused=True``, and the fused Adam of Megatron and
Transformer Engine)."""


@functools.cache
def optimizer_step_bytes(implementation: str) -> float:
    """HBM bytes per FP32 parameter of the optimizer step as our trainer runs it: ``clip_grad_norm_`` (the
    gradient's norm, then the gradient scaled by the clip coefficient) and AdamW's update in ``implementation``
    (:data:`ADAMW_IMPLEMENTATIONS`), counted op by op on the meta device as torch runs them."""
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(f"AdamW implementation {implementation!r}; valid: {', '.join(ADAMW_IMPLEMENTATIONS)}")
    from torch.optim.adamw import adamw

    shapes = ((1 << 20, 3), (1 << 20,))  # two tensors of unequal size, large enough that per-tensor scalars vanish
    params = [torch.empty(shape, device="meta") for shape in shapes]
    grads, exp_avgs, exp_avg_sqs = ([torch.empty_like(p) for p in params] for _ in range(3))
    for p, g in zip(params, grads):
        p.grad = g
    fused = implementation == "fused"
    steps = [torch.ones((), device="meta" if fused else "cpu") for _ in params]  # where torch keeps them
    counter = _Counter()
    with counter:
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # the same bytes tensor by tensor as foreach
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=implementation == "foreach",
            fused=fused,
            amsgrad=False,
            beta1=0.9,
            beta2=0.95,
            lr=1e-3,
            weight_decay=0.1,
            eps=1e-8,
            maximize=False,
        )
    return sum(nbytes for *_, nbytes in counter.ops) / sum(p.numel() for p in params)
