"""The FP4 linear's program, which :class:`nemofp4.quant.QuantLinear` calls: its three GEMMs on FP4
block-quantized operands, as two ``torch.library`` custom ops (forward, backward) joined by
``register_autograd`` (in plain eager, :func:`fp4_linear` runs the same two programs through an
``autograd.Function``, without the dispatcher's custom-op layers):

* fprop ``Y = X W^T``: X ``[T, K]`` quantized along K (role ``x``); W ``[N, K]`` along K
  (role ``w``, 16x16 tiles in the NVFP4/UE5M3 recipes).
* dgrad ``dX = dY W``: dY ``[T, N]`` along N (``dy_dgrad``, stochastic rounding in the FP4
  recipes); W^T along N: the fprop tiles transposed when W is 2-D (square tiles make that
  exactly the quantization of W^T), else W^T quantized afresh from the high-precision weight.
* wgrad ``dW = dY^T X``: dY^T ``[N, T]`` and X^T ``[K, T]`` quantized along the tokens (roles
  ``dy_wgrad``, ``x_wgrad``), after an optional 16x16 Hadamard transform along the tokens.
  Tokens (the product of the leading dims) are zero-padded to a multiple of 16 first. Both are
  quantized from the token-major dY and X directly (:func:`nemofp4.kernels.quantize_tokens_operand`:
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
its fake implementation gives their shapes (:func:`_saved_shapes`) and the compiled graph plans
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
from torch._opaque_base import OpaqueBase

from nemofp4 import kernels
from nemofp4.formats import QuantizedBlocks

from .config import LinearQuantConfig, OperandQuant, Role
from .gemm import GemmOperand, gemm
from .reference import ReferenceState
from .stats import OperandStats, operand_stats

__all__ = ["QuantCall", "QuantLinearState", "fp4_linear", "register_ops", "run_inside_for"]

def _mix_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from a tuple of ints (splitmix64 chained over the values)."""
    mask = (1 << 64) - 1
    state = 0x9E3779B97F4A7C15
    for v in values:
        state = (state ^ (int(v) & mask)) & mask
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        state = z ^ (z >> 31)
    return state >> 1


def _operand(packed: QuantizedBlocks, gemm_mode: str) -> QuantizedBlocks:
    """A saved operand in the form its GEMM reads: the hardware model takes the packed codes."""
    return packed if gemm_mode == "hardware" else packed.unpack()


@dataclass(frozen=True)
class QuantCall:
    """What one call of an FP4 linear computes: a frozen, hashable value built per call from the
    module's settings, so the ops depend on values, not on a module they could mutate."""

    config: LinearQuantConfig
    backend: kernels.Backend
    """the kernels backend the module's setting resolved to for the input's device"""
    training: bool
    """training mode: held references are sampled when due (eval only reads them)"""
    collect_stats: bool
    compute_dtype: torch.dtype

    @property
    def forward_uses_sr(self) -> bool:
        return any(self.config.operand(r).rounding != "rne" for r in (Role.X, Role.W, Role.X_WGRAD))


class QuantLinearState(OpaqueBase):
    """The mutable quantization state of one QuantLinear, the only thing its FP4 linear op updates:
    the tensor references (:class:`ReferenceState`), the stochastic-rounding generator (reseeded from
    (seed, rank, step, module index) at every step), the statistics (the switch and the last ones),
    the kernel backend (the setting, and what it resolved to per device), the layouts of the operands
    saved for backward, and the test seam (``capture``: a list collects every GEMM's operands and
    product). To ``torch.compile`` it is an opaque reference object: an input of the graph, read and
    changed only when the op runs, so the steps, refreshes, seeds and statistics compile nothing new."""

    def __init__(self, references: ReferenceState, index: int, config: LinearQuantConfig) -> None:
        self.references = references
        self.index = index
        self.config = config
        self.collect_stats = True
        """Keep the statistics of each quantization (:func:`nemofp4.quant.set_quant_stats`)."""
        self.backend = "auto"
        """The kernels setting ('auto', 'triton', 'native', 'compiled' or 'eager'), stored here only."""
        self._resolved: dict[torch.device, kernels.Backend] = {}
        self.seed = 0
        self.rank = 0
        self.generator: torch.Generator | None = None
        self.generator_seed: int | None = None
        self.stats: dict[str, OperandStats] = {}
        self.capture: list | None = None
        self.weight_cache: dict[str, QuantizedBlocks] | None = None
        """The weight's quantized operands of the current optimizer step ('w' for fprop, 'wt' for the
        dgrad of a 1-D weight), reused by every micro-batch after the first; None: not cached
        (:func:`nemofp4.quant.cached_weights` turns it on for the micro-batches of one step)."""
        self.layouts: dict[tuple, dict] = {}
        """The layout (:meth:`QuantizedBlocks.meta`) of each operand saved for backward, by operand and
        shape: a pure function of the recipe and the shape, so backward rebuilds the operand from it."""

    def call(self, device: torch.device, *, training: bool, compute_dtype: torch.dtype) -> QuantCall:
        """The frozen :class:`QuantCall` of one call on ``device``."""
        return QuantCall(config=self.config, backend=self.kernels_for(device), training=training,
                         collect_stats=self.collect_stats, compute_dtype=compute_dtype)  # fmt: skip

    def set_backend(self, backend: str) -> None:
        self.backend = kernels.check_backend(backend)
        self._resolved = {}

    def kernels_for(self, device: torch.device) -> kernels.Backend:
        """The backend the setting resolves to on ``device``, resolved at the first call there."""
        backend = self._resolved.get(device)
        if backend is None:
            backend = self._resolved[device] = kernels.backend_for(self.backend, device)
        return backend

    def set_step(self, step: int, *, seed: int = 0, rank: int = 0) -> None:
        if self.weight_cache:  # a new step, new weights
            self.weight_cache = {}
        self.references.step = step
        self.seed, self.rank = seed, rank
        self.generator_seed = _mix_seed(seed, rank, step, self.index)
        self.generator = None

    def sr_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            if self.generator_seed is None:
                self.generator_seed = _mix_seed(self.seed, self.rank, 0, self.index)
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.generator_seed)
        return self.generator

    def record(self, role: Role, q: QuantizedBlocks, held_source: torch.Tensor | None, *,
               backend: kernels.Backend) -> None:  # fmt: skip
        # Keep only the block counts and rho (device scalars, read lazily), not the data.
        self.stats[role.value] = operand_stats(q, held_source, backend=backend)

    def capture_gemm(self, name, qa, qb, b_transposed, out) -> None:
        """The test seam at each GEMM (tests set ``QuantLinear._capture = []``)."""
        if self.capture is not None:
            self.capture.append((name, qa, qb, b_transposed, out.detach().clone()))


class _Quantizer:
    """Quantizes the operands of one forward/backward call, resolving each tensor reference once."""

    def __init__(self, call: QuantCall, state: QuantLinearState, generator: torch.Generator | None) -> None:
        self.call = call
        self.state = state
        self.config = call.config
        self.generator = generator
        self.references: dict[str, torch.Tensor] = {}

    def reference(self, role: Role, x: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """The tensor reference of ``role`` (None: the quantizer measures it); ``x`` is the tensor it
        is the amax of, or a function that makes it (read only when an amax is measured here)."""
        op: OperandQuant = self.config.operand(role)
        if not op.uses_tensor_reference:
            return None
        ref = LinearQuantConfig.reference_of(role, op)
        if ref not in self.references:
            self.references[ref] = self.state.references.get(ref, x, training=self.call.training,
                                                             backend=self.call.backend)  # fmt: skip
        return self.references[ref]

    def held_source(self, role: Role, x):
        """``x`` (a tensor, or a function making it) when ``role`` is quantized with a held reference
        (for the staleness statistic), else None."""
        op: OperandQuant = self.config.operand(role)
        held = op.uses_tensor_reference and self.state.references.is_held(LinearQuantConfig.reference_of(role, op))
        return x if held else None

    def __call__(self, role: Role, x: torch.Tensor, *, two_d: bool | None = None, pack: bool = False) -> QuantizedBlocks:
        op: OperandQuant = self.config.operand(role)
        q = self.call.backend.quantize(
            x,
            op,
            tensor_amax=self.reference(role, x),
            generator=self.generator if op.rounding != "rne" else None,
            two_d=two_d,
            pack=pack or self.pack_all,
            stats=self.call.collect_stats,
        )
        self.record(role, q, self.held_source(role, x))
        return q

    @property
    def caches_weight(self) -> bool:
        """Whether the weight's operands come from the step's cache: in training, when the trainer
        keeps one, and only for a round-to-nearest weight, whose quantization draws no random bits
        (so reusing it skips nothing the generator would have drawn)."""
        return self.state.weight_cache is not None and self.call.training and self.config.w.rounding == "rne"

    def weight(self, w: torch.Tensor, *, two_d: bool | None = None, pack: bool = False,
               key: str = "w") -> QuantizedBlocks:  # fmt: skip
        """W (``key`` 'w') or W^T ('wt'), quantized with role ``w``; while :attr:`caches_weight`, once
        per optimizer step: the cache keeps the packed codes only (4.5 bits per element, held until
        the step ends), and later uses decode them (exactly) for their GEMM."""
        cached = self.cached_weight(key)
        if cached is not None:
            return cached
        q = self(Role.W, w, two_d=two_d, pack=pack or self.caches_weight)
        self.cache_weight(key, q)
        return q

    def cached_weight(self, key: str) -> QuantizedBlocks | None:
        """The step's cached ``key`` operand (:meth:`weight`), decoded for its GEMM; None: not cached."""
        packed = self.state.weight_cache.get(key) if self.caches_weight else None
        return None if packed is None else _operand(packed, self.config.gemm)

    def cache_weight(self, key: str, q: QuantizedBlocks) -> None:
        """Keep the packed form of a freshly quantized weight operand while :attr:`caches_weight`."""
        if self.caches_weight:
            self.state.weight_cache[key] = QuantizedBlocks.from_tensors(q.tensors(), q.meta())

    def forward_operands(self, x_TK: torch.Tensor, w: torch.Tensor, *, with_xt: bool,
                         pack_w: bool) -> tuple[QuantizedBlocks, QuantizedBlocks | None, QuantizedBlocks]:  # fmt: skip
        """X, X^T for wgrad (``with_xt``, else None; its packed form alone, which backward decodes) and W
        (:meth:`weight`): one backend call for the three (one compiled graph on CPU), or X and X^T
        alone when the step's cache holds W."""
        cached = self.cached_weight("w")
        if cached is not None:
            if with_xt:
                return *self.pair(Role.X, Role.X_WGRAD, x_TK, pack_tokens=True), cached
            return self(Role.X, x_TK), None, cached
        config = self.config
        x_amax = self.reference(Role.X, x_TK)
        assert not with_xt or self.reference(Role.X_WGRAD, x_TK) is x_amax  # one shared reference
        qx, qxt, qw = self.call.backend.quantize_forward(
            x_TK,
            w,
            config.x,
            config.x_wgrad if with_xt else None,
            config.w,
            x_amax=x_amax,
            w_amax=self.reference(Role.W, w),
            generator=self.generator,  # None unless the forward rounds stochastically
            pack_x=self.pack_all,
            values_xt=False,
            pack_w=pack_w or self.caches_weight or self.pack_all,
            stats=self.call.collect_stats,
        )
        self.record(Role.X, qx, self.held_source(Role.X, x_TK))
        if with_xt:
            self.record(Role.X_WGRAD, qxt, self.held_source(Role.X_WGRAD, x_TK))
        self.record(Role.W, qw, self.held_source(Role.W, w))
        self.cache_weight("w", qw)
        return qx, qxt, qw

    def tokens(self, role: Role, x_TD: torch.Tensor, *, pack: bool = False) -> QuantizedBlocks:
        """The wgrad operand of role ``role`` (X^T or dY^T) from the token-major ``x_TD``; with ``pack``
        its packed form alone (an operand saved for backward)."""
        op: OperandQuant = self.config.operand(role)
        if op.hadamard:  # its reference is the amax of the transformed tensor: made only if measured here
            def source():
                return self.call.backend.hadamard_transform(kernels.tokens_transposed(x_TD))
        else:
            source = x_TD
        q = self.call.backend.quantize_tokens(
            x_TD,
            op,
            tensor_amax=self.reference(role, source),
            generator=self.generator if op.rounding != "rne" else None,
            pack=pack or self.pack_all,
            values=not pack,
            stats=self.call.collect_stats,
        )
        self.record(role, q, self.held_source(role, source))
        return q

    def record(self, role: Role, q: QuantizedBlocks, held_source) -> None:
        if self.call.collect_stats:
            if callable(held_source):
                held_source = held_source()
            self.state.record(role, q, held_source, backend=self.call.backend)

    def pair(self, role: Role, tokens_role: Role, x_TD: torch.Tensor, *,
             pack_tokens: bool) -> tuple[QuantizedBlocks, QuantizedBlocks]:  # fmt: skip
        """``role`` along the last dim of ``x_TD`` and ``tokens_role``, its wgrad operand [D, Tp] along
        the tokens (X and X^T, or dY and dY^T), sharing one tensor reference: one compiled call on
        CPU, one read on CUDA. ``role``'s random bits are drawn first, as two calls would draw them.
        With ``pack_tokens`` the tokens operand comes in its packed form alone (X^T, saved for backward)."""
        config = self.config
        op, tokens_op = config.operand(role), config.operand(tokens_role)
        amax = self.reference(role, x_TD)
        assert amax is None or self.reference(tokens_role, x_TD) is amax  # one shared reference
        q, qt = self.call.backend.quantize_pair(
            x_TD,
            op,
            tokens_op,
            tensor_amax=amax,
            generator=self.generator if op.rounding != "rne" or tokens_op.rounding != "rne" else None,
            pack_x=self.pack_all,
            pack_xt=pack_tokens or self.pack_all,
            values_xt=not pack_tokens,
            stats=self.call.collect_stats,
        )
        self.record(role, q, self.held_source(role, x_TD))
        self.record(tokens_role, qt, self.held_source(tokens_role, x_TD))
        return q, qt

    @property
    def pack_all(self) -> bool:
        """Every operand packed: the backend's hardware GEMM reads packed codes (Triton's does)."""
        return self.config.gemm == "hardware" and self.call.backend.reads_packed_codes


def _saves_packed_weight(config: LinearQuantConfig, backend: kernels.Backend) -> bool:
    """Whether dgrad may take W^T from the packed fprop W saved for backward (fixed by the recipe and the
    backend, so the op's outputs are): 16x16 tiles, whose transpose is W^T's quantization, or a
    hardware GEMM that reads packed codes. A cached 1-D weight quantizes W^T afresh instead."""
    return config.w.two_d or (config.gemm == "hardware" and backend.reads_packed_codes)


def _packed_shapes(spec: OperandQuant, rows, cols, *, two_d: bool) -> list[tuple]:
    """The shapes of a packed operand's tensors (:meth:`QuantizedBlocks.tensors`: codes, scale codes,
    tensor scale, tensor amax) for a [rows, cols] operand quantized along ``cols`` (``two_d``: in
    tiles), as the quantizers lay them out: padded to the block, two FP4 codes or one FP8 code a byte,
    no block scales for per-tensor scaling."""
    b = spec.block_size
    rows_p, cols_p = rows + (-rows % b if two_d else 0), cols + -cols % b
    codes = (rows_p, cols_p if spec.is_fp8 else cols_p // 2)
    scales = (0,) if spec.format.per_tensor else (rows_p // (b if two_d else 1), cols_p // b)
    return [codes, scales, (), ()]


def _saved_shapes(config: LinearQuantConfig, backend: kernels.Backend, x_TK: torch.Tensor, weight: torch.Tensor,
                  needs_dx: bool, needs_dw: bool) -> list[tuple]:  # fmt: skip
    """The shapes of the operands the forward op returns for backward: X^T [K, tokens padded to 16]
    along the tokens, and the packed W where it is saved (:func:`_saves_packed_weight`)."""
    shapes = []
    if needs_dw:
        tokens = x_TK.shape[0] + -x_TK.shape[0] % kernels.TOKEN_MULTIPLE
        shapes += _packed_shapes(config.x_wgrad, x_TK.shape[1], tokens, two_d=False)
    if needs_dx and _saves_packed_weight(config, backend):
        shapes += _packed_shapes(config.w, *weight.shape, two_d=config.w.two_d)
    return shapes


_SAVED_DTYPES = (torch.uint8, torch.uint8, torch.float32, torch.float32)


def _fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: QuantLinearState,
                training: bool, compute_dtype: torch.dtype, needs_dx: bool, needs_dw: bool) -> list[torch.Tensor]:  # fmt: skip
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
    if needs_dx and _saves_packed_weight(config, backend):
        out += qw.tensors()
        state.layouts["w"] = qw.meta()
    shapes = _saved_shapes(config, backend, x_TK, weight, needs_dx, needs_dw)
    if [tuple(t.shape) for t in out[1:]] != shapes:  # what the compiled graph was planned with
        raise AssertionError(f"FP4 linear: saved operands {[tuple(t.shape) for t in out[1:]]}, expected {shapes}")
    # New tensor objects: autograd sets the outputs' grad_fn, and the packed W's may be the step's
    # weight cache's own tensors, which would then keep each micro-batch's graph alive.
    return [t.detach() if t.is_contiguous() else t.contiguous() for t in out]


def _fp4_linear_fake(x, weight, bias, state, training, compute_dtype, needs_dx, needs_dw):
    """The outputs' shapes and dtypes (:func:`_saved_shapes`), for ``torch.compile``, which passes the
    module's state wrapped; under a plain ``FakeTensorMode`` (the planner's simulation, with the state
    itself) the op runs as it does for real, on fake tensors."""
    if not hasattr(state, "real_obj"):
        return _fp4_linear(x, weight, bias, state, training, compute_dtype, needs_dx, needs_dw)
    real = state.real_obj
    shapes = _saved_shapes(real.config, real.kernels_for(x.device), x.reshape(-1, weight.shape[1]), weight, needs_dx,
                           needs_dw)  # fmt: skip
    saved = [x.new_empty(shape, dtype=_SAVED_DTYPES[i % 4]) for i, shape in enumerate(shapes)]
    return [x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=compute_dtype), *saved]


def _fp4_linear_backward(dy: torch.Tensor, saved: list[torch.Tensor], weight: torch.Tensor | None,
                         state: QuantLinearState, training: bool, compute_dtype: torch.dtype, x_shape: list[int],
                         x_dtype: torch.dtype, w_dtype: torch.dtype, needs_dx: bool, needs_dw: bool,
                         db_dtype: torch.dtype | None) -> list[torch.Tensor]:  # fmt: skip
    """Backward: ``[dX (needs_dx), dW (needs_dw), d bias (db_dtype: the bias's dtype, None: no bias
    gradient)]``; the bias's is here too, so a compiled graph computes it as eager does."""
    call = state.call(dy.device, training=training, compute_dtype=compute_dtype)
    config, backend = call.config, call.backend
    dy_TN = dy.reshape(-1, dy.shape[-1])
    quantize = _Quantizer(call, state, state.sr_generator(dy.device))
    out = []
    if needs_dw:
        layout = state.layouts["xt", torch.Size((dy_TN.shape[0], x_shape[-1]))]
        qxt = _operand(QuantizedBlocks.from_tensors(tuple(saved[:4]), layout), config.gemm)
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
            wt = GemmOperand(_operand(QuantizedBlocks.from_tensors(tuple(saved[:4]), layout), config.gemm), transposed=True)
        else:
            wt = GemmOperand(quantize.weight(weight.t(), two_d=False, key="wt"))
        dx_TK = gemm(GemmOperand(qdy), wt, mode=config.gemm, compute_dtype=compute_dtype, backend=backend)
        state.capture_gemm("dgrad", qdy, wt.q, wt.transposed, dx_TK)
        del qdy, wt
        out.append(dx_TK.to(x_dtype).reshape(x_shape))
    if needs_dw:
        if qdyt is None:
            qdyt = quantize.tokens(Role.DY_WGRAD, dy_TN)
        dw_NK = gemm(GemmOperand(qdyt), GemmOperand(qxt), mode=config.gemm, compute_dtype=compute_dtype, backend=backend)
        state.capture_gemm("wgrad", qdyt, qxt, False, dw_NK)
        out.append(dw_NK.to(w_dtype))
    if db_dtype is not None:
        out.append(dy_TN.float().sum(0).to(db_dtype))
    return out


def _fp4_linear_backward_fake(dy, saved, weight, state, training, compute_dtype, x_shape, x_dtype, w_dtype,
                              needs_dx, needs_dw, db_dtype):  # fmt: skip
    if not hasattr(state, "real_obj"):  # a plain FakeTensorMode: as for real (see _fp4_linear_fake)
        return _fp4_linear_backward(dy, saved, weight, state, training, compute_dtype, x_shape, x_dtype, w_dtype,
                                    needs_dx, needs_dw, db_dtype)  # fmt: skip
    n, k = dy.shape[-1], x_shape[-1]
    return ([dy.new_empty(x_shape, dtype=x_dtype)] if needs_dx else []) + (
        [dy.new_empty((n, k), dtype=w_dtype)] if needs_dw else []) + (
        [dy.new_empty((n,), dtype=db_dtype)] if db_dtype is not None else [])


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
    grads = backward(dy, saved, weight, ctx.state, ctx.training, ctx.compute_dtype, ctx.x_shape, ctx.x_dtype,
                     ctx.w_dtype, ctx.needs_dx, ctx.needs_dw, db_dtype)  # fmt: skip
    dx = grads.pop(0) if ctx.needs_dx else None
    dw = grads.pop(0) if ctx.needs_dw else None
    db = grads.pop(0) if db_dtype is not None else None
    return dx, dw, db, None, None, None, None, None


def _forward_flops(x_shape, weight_shape, *args, **kwargs) -> int:
    """The fprop GEMM's FLOPs (2 T K N), as ``FlopCounterMode`` counts an ``nn.Linear``'s."""
    n, k = weight_shape
    return 2 * math.prod(x_shape[:-1]) * k * n


def _backward_flops(dy_shape, saved, weight, state, training, compute_dtype, x_shape, x_dtype, w_dtype, needs_dx,
                    needs_dw, db_dtype, **kwargs) -> int:  # fmt: skip
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
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors))  # fmt: skip


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: QuantLinearState,
               training: bool, compute_dtype: torch.dtype, needs_dx: bool, needs_dw: bool) -> torch.Tensor:  # fmt: skip
    """``Y``: the FP4 linear's forward, with its backward joined for autograd: the custom op
    ``nemofp4::fp4_linear``, or in plain eager its programs without the op (:class:`_EagerFP4Linear`)."""
    args = (x, weight, bias, state, training, compute_dtype, needs_dx, needs_dw)
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
        "nemofp4::fp4_linear", _below_autograd(_fp4_linear), mutates_args=(),
        schema=f"(Tensor x, Tensor weight, Tensor? bias, {state_type} state, bool training, ScalarType compute_dtype, "
               "bool needs_dx, bool needs_dw) -> Tensor[]",
    )  # fmt: skip
    forward.register_fake(_fp4_linear_fake)
    backward = torch.library.custom_op(
        "nemofp4::fp4_linear_backward", _below_autograd(_fp4_linear_backward), mutates_args=(),
        schema=f"(Tensor dy, Tensor[] saved, Tensor? weight, {state_type} state, bool training, "
               "ScalarType compute_dtype, SymInt[] x_shape, ScalarType x_dtype, ScalarType w_dtype, bool needs_dx, "
               "bool needs_dw, ScalarType? db_dtype) -> Tensor[]",
    )  # fmt: skip
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
