"""The FP4 linear's programs, which :class:`nemofp4.quant.QuantLinear` calls: its three GEMMs on FP4
block-quantized operands, as two ``torch.library`` custom ops (forward, backward) joined by
``register_autograd`` (in plain eager, :func:`fp4_linear` runs the same two programs through an
``autograd.Function``, without the dispatcher's custom-op layers; the measured reason is at
:func:`fp4_linear`). The operands come from :mod:`nemofp4.quant.linear_operands`, the state the ops
update from :mod:`nemofp4.quant.linear_state`.

* fprop ``Y = X W^T``: X ``[T, K]`` quantized along K (role ``x``); W ``[N, K]`` along K
  (role ``w``, 16x16 tiles in the NVFP4/UE5M3 recipes).
* dgrad ``dX = dY W``: dY ``[T, N]`` along N (``dy_dgrad``, stochastic rounding in the FP4
  recipes); W^T along N: the fprop tiles transposed when W is 2-D (square tiles make that
  exactly the quantization of W^T), else W^T quantized afresh from the high-precision weight.
* wgrad ``dW = dY^T X``: dY^T ``[N, T]`` and X^T ``[K, T]`` quantized along the tokens (roles
  ``dy_wgrad``, ``x_wgrad``), after an optional 16x16 Hadamard transform along the tokens.
  Tokens (the product of the leading dims) are zero-padded to a multiple of 16 first. Both are
  quantized from the token-major dY and X directly (a ``tokens`` :class:`nemofp4.kernels.OperandRequest`:
  blocks down the columns), without materializing a transpose or the transformed tensor.

Every operand is quantized from the high-precision tensor in the layout of its own GEMM;
quantized data is never re-quantized. X^T is quantized for wgrad already in the forward pass,
so what is saved for backward is its packed FP4 codes and scale codes (4.5 bits per element
instead of 16), plus the 2-D weight's codes or, for 1-D weights, the weight parameter itself.

Stochastic rounding draws from one generator per module, seeded from (seed, rank, step,
module index) by :func:`set_step`, so a resumed run reproduces the same random bits.

The ops never see the module: they receive tensors, plain values (training mode, compute dtype,
which gradients are needed) and the module's :class:`QuantLinearState`, the one mutable object they
update (held references, the SR generator, the last statistics), from which each call builds a
frozen, hashable :class:`QuantCall`. Under ``torch.compile`` each op is one opaque node of the
graph and the state an opaque reference object (an input of the graph, never traced), so a
compiled block is not cut at its FP4 linears and the steps, refreshes, seeds and statistics
compile nothing new. The forward op returns the packed operands saved for backward as outputs, so
its fake implementation gives their shapes (:func:`~nemofp4.quant.linear_operands.saved_shapes`) and the compiled graph plans
their memory.

Tensor legend: T tokens (product of leading dims), K in-features, N out-features,
Tp tokens padded to a multiple of 16.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nemofp4.formats import QuantizedBlocks

from .config import Role
from .gemm import GemmOperand, gemm
from .linear_operands import _Quantizer, gemm_form, packed_weight_saved, saved_shapes
from .linear_state import QuantLinearState

__all__ = ["fp4_linear", "register_ops", "run_inside_for"]


_SAVED_DTYPES = (torch.uint8, torch.uint8, torch.float32, torch.float32)


def _fp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: QuantLinearState,
    training: bool,
    compute_dtype: torch.dtype,
    needs_dx: bool,
    needs_dw: bool,
) -> list[torch.Tensor]:
    """Forward: ``[Y, *X^T's packed tensors (needs_dw), *W's packed tensors (needs_dx, when saved packed)]``."""
    call = state.call(x.device, training=training, compute_dtype=compute_dtype)
    config, backend = call.config, call.backend
    x_TK = x.reshape(-1, weight.shape[1])
    quantize = _Quantizer(call, state, state.sr_generator(x.device) if call.forward_uses_sr else None)

    with_xt = needs_dw and not config.x_wgrad.hadamard
    qx, qxt, qw = quantize.forward_operands(x_TK, weight, with_xt=with_xt, pack_w=needs_dx and config.w.two_d)
    if needs_dw and not with_xt:
        qxt = quantize.tokens(Role.X_WGRAD, x_TK, pack=True)  # after the RHT
    y_TN = gemm(GemmOperand(qx), GemmOperand(qw), mode=config.gemm, compute_dtype=compute_dtype, backend=backend)
    state.capture_gemm("fprop", qx, qw, False, y_TN)
    del qx
    if bias is not None:
        y_TN = y_TN + bias.float()
    out = [y_TN.to(compute_dtype).reshape(*x.shape[:-1], weight.shape[0])]
    # What backward needs, as packed FP4 where the recipe allows (the 1-D weight itself: the op's input)
    if needs_dw:
        out += qxt.tensors()
        state.layouts["xt", x_TK.shape] = qxt.meta()
    if needs_dx and packed_weight_saved(config, backend):
        out += qw.tensors()
        state.layouts["w"] = qw.meta()
    shapes = saved_shapes(config, backend, x_TK, weight, needs_dx, needs_dw)
    if [tuple(t.shape) for t in out[1:]] != shapes:  # what the compiled graph was planned with
        raise AssertionError(f"FP4 linear: saved operands {[tuple(t.shape) for t in out[1:]]}, expected {shapes}")
    # New tensor objects: autograd sets the outputs' grad_fn, and the packed W's may be the step's
    # weight cache's own tensors, which would then keep each micro-batch's graph alive.
    return [t.detach() if t.is_contiguous() else t.contiguous() for t in out]


def _fp4_linear_fake(x, weight, bias, state, training, compute_dtype, needs_dx, needs_dw):
    """The outputs' shapes and dtypes (:func:`saved_shapes`), for ``torch.compile``, which passes the
    module's state wrapped; under a plain ``FakeTensorMode`` (the planner's simulation, with the state
    itself) the op runs as it does for real, on fake tensors."""
    if not hasattr(state, "real_obj"):
        return _fp4_linear(x, weight, bias, state, training, compute_dtype, needs_dx, needs_dw)
    real = state.real_obj
    shapes = saved_shapes(
        real.config, real.kernels_for(x.device), x.reshape(-1, weight.shape[1]), weight, needs_dx, needs_dw
    )
    saved = [x.new_empty(shape, dtype=_SAVED_DTYPES[i % 4]) for i, shape in enumerate(shapes)]
    return [x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=compute_dtype), *saved]


def _fp4_linear_backward(
    dy: torch.Tensor,
    saved: list[torch.Tensor],
    weight: torch.Tensor | None,
    state: QuantLinearState,
    training: bool,
    compute_dtype: torch.dtype,
    x_shape: list[int],
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    needs_dx: bool,
    needs_dw: bool,
    db_dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    """Backward: ``[dX (needs_dx), dW (needs_dw), d bias (db_dtype: the bias's dtype, None: no bias
    gradient)]``; the bias's is here too, so a compiled graph computes it as eager does."""
    call = state.call(dy.device, training=training, compute_dtype=compute_dtype)
    config, backend = call.config, call.backend
    dy_TN = dy.reshape(-1, dy.shape[-1])
    quantize = _Quantizer(call, state, state.sr_generator(dy.device))
    out = []
    if needs_dw:
        layout = state.layouts["xt", torch.Size((dy_TN.shape[0], x_shape[-1]))]
        qxt = gemm_form(QuantizedBlocks.from_tensors(tuple(saved[:4]), layout), config.gemm)
        saved = saved[4:]
    saved_wt = bool(needs_dx and saved) and (config.w.two_d or not quantize.caches_weight)  # W as forward quantized it
    qdyt = None
    if needs_dx and needs_dw and not config.dy_wgrad.hadamard and (saved_wt or config.w.rounding == "rne"):
        # one call for dY and dY^T (W^T, quantized between them otherwise, draws no random bits)
        qdy, qdyt = quantize.pair(Role.DY_DGRAD, Role.DY_WGRAD, dy_TN, pack_tokens=False)
    elif needs_dx:
        qdy = quantize(Role.DY_DGRAD, dy_TN)
    if needs_dx:
        if saved_wt:
            layout = state.layouts["w"]
            wt = GemmOperand(
                gemm_form(QuantizedBlocks.from_tensors(tuple(saved[:4]), layout), config.gemm), transposed=True
            )
        else:
            wt = GemmOperand(quantize.weight(weight.t(), two_d=False, key="wt"))
        dx_TK = gemm(GemmOperand(qdy), wt, mode=config.gemm, compute_dtype=compute_dtype, backend=backend)
        state.capture_gemm("dgrad", qdy, wt.q, wt.transposed, dx_TK)
        del qdy, wt
        out.append(dx_TK.to(x_dtype).reshape(x_shape))
    if needs_dw:
        if qdyt is None:
            qdyt = quantize.tokens(Role.DY_WGRAD, dy_TN)
        dw_NK = gemm(
            GemmOperand(qdyt), GemmOperand(qxt), mode=config.gemm, compute_dtype=compute_dtype, backend=backend
        )
        state.capture_gemm("wgrad", qdyt, qxt, False, dw_NK)
        out.append(dw_NK.to(w_dtype))
    if db_dtype is not None:
        out.append(dy_TN.float().sum(0).to(db_dtype))
    return out


def _fp4_linear_backward_fake(
    dy, saved, weight, state, training, compute_dtype, x_shape, x_dtype, w_dtype, needs_dx, needs_dw, db_dtype
):
    if not hasattr(state, "real_obj"):  # a plain FakeTensorMode: as for real (see _fp4_linear_fake)
        return _fp4_linear_backward(
            dy, saved, weight, state, training, compute_dtype, x_shape, x_dtype, w_dtype, needs_dx, needs_dw, db_dtype
        )
    n, k = dy.shape[-1], x_shape[-1]
    return (
        ([dy.new_empty(x_shape, dtype=x_dtype)] if needs_dx else [])
        + ([dy.new_empty((n, k), dtype=w_dtype)] if needs_dw else [])
        + ([dy.new_empty((n,), dtype=db_dtype)] if db_dtype is not None else [])
    )


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, state, training, compute_dtype, needs_dx, needs_dw = inputs
    one_d = not getattr(state, "real_obj", state).config.w.two_d  # dgrad quantizes W^T afresh (or may)
    ctx.save_for_backward(*output[1:], weight if needs_dx and one_d else None)
    ctx.state, ctx.training, ctx.compute_dtype = state, training, compute_dtype
    ctx.x_shape, ctx.x_dtype, ctx.w_dtype = list(x.shape), x.dtype, weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.needs_dx, ctx.needs_dw = needs_dx, needs_dw


def _backward(ctx, grads):
    return _backward_with(_OPS.backward, ctx, grads)


def _backward_with(backward: Callable, ctx, grads) -> tuple:
    """The inputs' gradients, from ``backward`` (the backward op, or its program called directly)."""
    dy = grads[0]  # the saved operands' outputs get none
    *saved, weight = ctx.saved_tensors
    db_dtype = ctx.bias_dtype if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
    grads = backward(
        dy,
        saved,
        weight,
        ctx.state,
        ctx.training,
        ctx.compute_dtype,
        ctx.x_shape,
        ctx.x_dtype,
        ctx.w_dtype,
        ctx.needs_dx,
        ctx.needs_dw,
        db_dtype,
    )
    dx = grads.pop(0) if ctx.needs_dx else None
    dw = grads.pop(0) if ctx.needs_dw else None
    db = grads.pop(0) if db_dtype is not None else None
    return dx, dw, db, None, None, None, None, None


def _forward_flops(x_shape, weight_shape, *args, **kwargs) -> int:
    """The fprop GEMM's FLOPs (2 T K N), as ``FlopCounterMode`` counts an ``nn.Linear``'s."""
    n, k = weight_shape
    return 2 * math.prod(x_shape[:-1]) * k * n


def _backward_flops(
    dy_shape,
    saved,
    weight,
    state,
    training,
    compute_dtype,
    x_shape,
    x_dtype,
    w_dtype,
    needs_dx,
    needs_dw,
    db_dtype,
    **kwargs,
) -> int:
    """The dgrad and wgrad GEMMs' FLOPs (2 T K N each, where needed)."""
    return (int(needs_dx) + int(needs_dw)) * 2 * math.prod(dy_shape[:-1]) * x_shape[-1] * dy_shape[-1]


@dataclass(frozen=True)
class _Ops:
    forward: Callable
    backward: Callable


def _below_autograd(impl: Callable) -> Callable:
    """``impl`` run below autograd whoever calls it (the eager dispatcher does so already, a compiled
    graph does not), so the quantizers it calls compile for one dispatch state and never again."""

    @functools.wraps(impl)
    def run(*args):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return impl(*args)

    return run


_OPS: _Ops | None = None


class _EagerFP4Linear(torch.autograd.Function):
    """The FP4 linear in plain eager PyTorch: the ops' forward and backward programs, called as an
    ``autograd.Function`` without the dispatcher's custom-op layers (argument checks, output
    flattening, a second op for backward), whose fixed cost per call weighs on a CPU step's small
    linears (``scripts/bench/bench_recipes.py --linears`` times both paths). The same programs, saved operands and
    context as the ops, which stay the path wherever something must see them: ``torch.compile``,
    dispatch modes (fake tensors, FLOP counters, memory trackers), tensor subclasses."""

    @staticmethod
    def forward(ctx, *inputs):
        with torch._C._AutoDispatchBelowADInplaceOrView():  # as the ops run it (see _below_autograd)
            out = _fp4_linear(*inputs)
        _setup_context(ctx, inputs, out)
        ctx.mark_non_differentiable(*out[1:])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        # only the program below autograd: reading the saved tensors may recompute a checkpointed
        # forward, which must record as usual
        return _backward_with(_below_autograd(_fp4_linear_backward), ctx, grads)


def _plain_eager(*tensors: torch.Tensor | None) -> bool:
    """Whether a call may skip the ops: eager (not traced), no dispatch mode or functorch transform
    on, plain tensors (or parameters)."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._are_functorch_transforms_active()
        and all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
    )


def fp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: QuantLinearState,
    training: bool,
    compute_dtype: torch.dtype,
    needs_dx: bool,
    needs_dw: bool,
) -> torch.Tensor:
    """``Y``: the FP4 linear's forward, with its backward joined for autograd: the custom op
    ``nemofp4::fp4_linear``, or in plain eager its programs without the op (:class:`_EagerFP4Linear`)."""
    args = (x, weight, bias, state, training, compute_dtype, needs_dx, needs_dw)
    # Two paths, one program, for a measured reason: one ue5m3 QuantLinear 512 -> 512, native CPU
    # quantizer, one thread, forward + backward, the two paths interleaved 600 times in one process
    # (the 2-core VM, 2026-12-06): at 16 tokens 1.53 ms through the autograd.Function against 1.74 ms
    # through the custom ops (best of each; medians 5.87 / 6.34 ms under load), +0.2-0.5 ms a call,
    # and 1062 against 1575 Python calls per forward + backward; at 256 tokens +0.6-0.7 ms. A CPU
    # step's small linears pay that on every call; scripts/bench/bench_recipes.py --linears times both.
    if _plain_eager(x, weight, bias):
        return _EagerFP4Linear.apply(*args)[0]
    return register_ops().forward(*args)[0]


def register_ops() -> _Ops:
    """The FP4 linear as two custom ops, registered when the first QuantLinear is made (not at import:
    ``torch.library`` imports dynamo, which imports triton, and the first triton import must come
    after ``TRITON_INTERPRET`` is set where it is used; nor inside a compiled region). Each op has
    a FLOP formula (its GEMMs), since ``FlopCounterMode`` does not see the GEMMs inside an op."""
    global _OPS
    if _OPS is not None:
        return _OPS
    from torch._library.opaque_object import register_opaque_type
    from torch.utils.flop_counter import register_flop_formula

    register_opaque_type(QuantLinearState, typ="reference", guard_fn=lambda state: [state.config])
    state_type = f"{QuantLinearState.__module__}.{QuantLinearState.__qualname__}"
    forward = torch.library.custom_op(
        "nemofp4::fp4_linear",
        _below_autograd(_fp4_linear),
        mutates_args=(),
        schema=f"(Tensor x, Tensor weight, Tensor? bias, {state_type} state, bool training, ScalarType compute_dtype, "
        "bool needs_dx, bool needs_dw) -> Tensor[]",
    )
    forward.register_fake(_fp4_linear_fake)
    backward = torch.library.custom_op(
        "nemofp4::fp4_linear_backward",
        _below_autograd(_fp4_linear_backward),
        mutates_args=(),
        schema=f"(Tensor dy, Tensor[] saved, Tensor? weight, {state_type} state, bool training, "
        "ScalarType compute_dtype, SymInt[] x_shape, ScalarType x_dtype, ScalarType w_dtype, bool needs_dx, "
        "bool needs_dw, ScalarType? db_dtype) -> Tensor[]",
    )
    backward.register_fake(_fp4_linear_backward_fake)
    forward.register_autograd(_backward, setup_context=_setup_context)
    register_flop_formula(torch.ops.nemofp4.fp4_linear)(_forward_flops)
    register_flop_formula(torch.ops.nemofp4.fp4_linear_backward)(_backward_flops)
    _OPS = _Ops(forward=forward, backward=backward)
    return _OPS


def run_inside_for(mode_type: type) -> None:
    """Under a dispatch mode of exactly ``mode_type`` (a memory tracker), the FP4 linear's ops run
    their program with the mode on, so it sees every op inside (their temporaries), as it sees an
    ``nn.Linear``'s, instead of one op and its outputs."""
    ops = register_ops()
    for op, impl in ((ops.forward, _fp4_linear), (ops.backward, _fp4_linear_backward)):
        op.register_torch_dispatch(mode_type, _with_mode_on(_below_autograd(impl)))


def _with_mode_on(impl: Callable) -> Callable:
    def rule(mode, func, types, args, kwargs):
        with mode:
            return impl(*args, **kwargs)

    return rule
