"""QuantLinear: a drop-in ``nn.Linear`` whose three GEMMs run on FP4 block-quantized operands.

Forward and backward are one ``autograd.Function``:

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

The autograd Function never sees the module: it receives a frozen, hashable
:class:`QuantCall` (the recipe's :class:`LinearQuantConfig`, the kernel backend resolved for the
input's device, mode, dtype) and the module's :class:`QuantLinearState`, the one mutable object it
updates (held references, the SR generator, the last statistics).

Tensor legend: T tokens (product of leading dims), K in-features, N out-features,
Tp tokens padded to a multiple of 16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nemofp4 import kernels
from nemofp4.formats import QuantizedBlocks

from .config import LinearQuantConfig, OperandQuant, Role
from .gemm import GemmOperand, gemm
from .reference import ReferenceState
from .stats import OperandStats, operand_stats

__all__ = ["FP32Linear", "QuantCall", "QuantLinear", "QuantLinearState"]


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
    module's settings, so the autograd Function depends on values, not on a module it could mutate."""

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


class QuantLinearState:
    """The mutable quantization state of one QuantLinear, the only thing its autograd Function
    updates: the tensor references (:class:`ReferenceState`), the stochastic-rounding generator
    (reseeded from (seed, rank, step, module index) at every step), the last quantization
    statistics, the kernel backend (the setting, and what it resolved to per device), and the test
    seam (``capture``: a list collects every GEMM's operands and product)."""

    def __init__(self, references: ReferenceState, index: int) -> None:
        self.references = references
        self.index = index
        self.backend = "auto"
        """The kernels setting ('auto', 'triton', 'compiled' or 'eager'), stored here only."""
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
        if not self.caches_weight:
            return self(Role.W, w, two_d=two_d, pack=pack)
        cache = self.state.weight_cache
        if key in cache:
            return _operand(cache[key], self.config.gemm)
        q = self(Role.W, w, two_d=two_d, pack=True)
        cache[key] = QuantizedBlocks.from_tensors(q.tensors(), q.meta())
        return q

    def tokens(self, role: Role, x_TD: torch.Tensor, *, pack: bool = False) -> QuantizedBlocks:
        """The wgrad operand of role ``role`` (X^T or dY^T) from the token-major ``x_TD``."""
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
            stats=self.call.collect_stats,
        )
        self.record(role, q, self.held_source(role, source))
        return q

    def record(self, role: Role, q: QuantizedBlocks, held_source) -> None:
        if self.call.collect_stats:
            if callable(held_source):
                held_source = held_source()
            self.state.record(role, q, held_source, backend=self.call.backend)

    def x_and_xt(self, x_TK: torch.Tensor) -> tuple[QuantizedBlocks, QuantizedBlocks]:
        """X for fprop and X^T [K, Tp] for wgrad (packed, it is saved), in one read on CUDA."""
        config = self.config
        amax = self.reference(Role.X, x_TK)
        assert amax is None or self.reference(Role.X_WGRAD, x_TK) is amax  # one shared 'x' reference
        qx, qxt = self.call.backend.quantize_pair(
            x_TK,
            config.x,
            config.x_wgrad,
            tensor_amax=amax,
            generator=self.generator if config.x.rounding != "rne" else None,
            pack_x=self.pack_all,
            pack_xt=True,
            stats=self.call.collect_stats,
        )
        self.record(Role.X, qx, self.held_source(Role.X, x_TK))
        self.record(Role.X_WGRAD, qxt, self.held_source(Role.X_WGRAD, x_TK))
        return qx, qxt

    @property
    def pack_all(self) -> bool:
        """Every operand packed: the backend's hardware GEMM reads packed codes (Triton's does)."""
        return self.config.gemm == "hardware" and self.call.backend.reads_packed_codes


class _QuantLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: QuantCall, state: QuantLinearState):
        config = call.config
        backend, compute_dtype = call.backend, call.compute_dtype
        in_features = weight.shape[1]
        x_TK = x.reshape(-1, in_features)
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        quantize = _Quantizer(call, state, state.sr_generator(x.device) if call.forward_uses_sr else None)

        if needs_dw and not config.x_wgrad.hadamard:
            qx, qxt = quantize.x_and_xt(x_TK)
        else:
            qx = quantize(Role.X, x_TK)
            qxt = quantize.tokens(Role.X_WGRAD, x_TK, pack=True) if needs_dw else None  # after the RHT
        qw = quantize.weight(weight, pack=needs_dx and config.w.two_d)
        y_TN = gemm(GemmOperand(qx), GemmOperand(qw), mode=config.gemm, compute_dtype=compute_dtype, backend=backend)
        state.capture_gemm("fprop", qx, qw, False, y_TN)
        del qx
        if bias is not None:
            y_TN = y_TN + bias.float()
        y = y_TN.to(compute_dtype).reshape(*x.shape[:-1], weight.shape[0])

        # What backward needs, saved as packed FP4 where the recipe allows.
        saved: list[torch.Tensor] = []
        ctx.xt_meta = ctx.w_meta = None
        if needs_dw:
            saved += qxt.tensors()
            ctx.xt_meta = qxt.meta()
        if needs_dx:
            # 16x16 tiles: W^T's quantization is this one, transposed (a cached 1-D one is packed too)
            if config.w.two_d if quantize.caches_weight else qw.codes is not None:
                saved += qw.tensors()
                ctx.w_meta = qw.meta()
            else:
                saved.append(weight)
        ctx.save_for_backward(*saved)
        ctx.call, ctx.state = call, state
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        call: QuantCall = ctx.call
        state: QuantLinearState = ctx.state
        config, backend, compute_dtype = call.config, call.backend, call.compute_dtype
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        saved = list(ctx.saved_tensors)
        if needs_dw:
            qxt = _operand(QuantizedBlocks.from_tensors(tuple(saved[:4]), ctx.xt_meta), config.gemm)
            saved = saved[4:]
        out_features = dy.shape[-1]
        dy_TN = dy.reshape(-1, out_features)
        quantize = _Quantizer(call, state, state.sr_generator(dy.device))
        dx = dw = db = None

        if needs_dx:
            qdy = quantize(Role.DY_DGRAD, dy_TN)
            if ctx.w_meta is not None:
                wt = GemmOperand(_operand(QuantizedBlocks.from_tensors(tuple(saved[:4]), ctx.w_meta), config.gemm), transposed=True)
            else:
                wt = GemmOperand(quantize.weight(saved[0].t(), two_d=False, key="wt"))
            dx_TK = gemm(GemmOperand(qdy), wt, mode=config.gemm, compute_dtype=compute_dtype, backend=backend)
            state.capture_gemm("dgrad", qdy, wt.q, wt.transposed, dx_TK)
            del qdy, wt
            dx = dx_TK.to(ctx.x_dtype).reshape(ctx.x_shape)
        if needs_dw:
            qdyt = quantize.tokens(Role.DY_WGRAD, dy_TN)
            dw_NK = gemm(GemmOperand(qdyt), GemmOperand(qxt), mode=config.gemm, compute_dtype=compute_dtype, backend=backend)
            state.capture_gemm("wgrad", qdyt, qxt, False, dw_NK)
            dw = dw_NK.to(ctx.w_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy_TN.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None


def _quant_linear(layer: QuantLinear, x: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """Freeze the layer's settings into a :class:`QuantCall` and run the autograd Function on values."""
    call = QuantCall(config=layer.quant_config, backend=layer.quant_state.kernels_for(x.device),
                     training=layer.training, collect_stats=layer.collect_stats, compute_dtype=compute_dtype)  # fmt: skip
    return _QuantLinearFunction.apply(x, layer.weight, layer.bias, call, layer.quant_state)


@functools.cache
def _opaque_quant_linear():
    """The FP4 linear as one opaque call for a compiled model (``distributed.compile``): dynamo
    does not trace the quantization bookkeeping (held references, generators, statistics), whose
    Python state would recompile the block again and again; the quantizer compiles itself.
    Built at first use: ``torch.compiler.disable`` imports dynamo, which imports triton, and the
    first triton import must come after ``TRITON_INTERPRET`` is set where it is used."""
    return torch.compiler.disable(_quant_linear)


class QuantLinear(nn.Linear):
    """``nn.Linear`` with emulated FP4 fprop, dgrad and wgrad GEMMs (see the module docstring).

    Usually made by :func:`nemofp4.recipes.apply_recipe` as a class swap of an existing
    ``nn.Linear`` (:meth:`from_linear`: no reallocation, same parameter objects, works on the
    meta device). Inputs may have any leading dims. It computes in the input dtype, or in the
    autocast dtype when autocast is on (BF16 on GPU); the block-quantized operands are exact
    in either, and products accumulate in FP32.
    """

    quant_config: LinearQuantConfig
    quant_index: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        config: LinearQuantConfig,
        index: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_quant(config, index)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: LinearQuantConfig, *, index: int = 0) -> QuantLinear:
        """Turn ``linear`` into a QuantLinear in place (class swap) and return it."""
        if type(linear) is not nn.Linear:
            raise ValueError(f"QuantLinear.from_linear needs a plain nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        linear._setup_quant(config, index)
        return linear

    def _setup_quant(self, config: LinearQuantConfig, index: int) -> None:
        if not isinstance(config, LinearQuantConfig):
            raise ValueError(f"config must be a LinearQuantConfig, got {type(config).__name__}")
        self.quant_config = config
        self.quant_index = index
        references = ReferenceState({ref: config.reference_interval(ref) for ref in config.reference_roles()})
        self.quant_state = QuantLinearState(references, index)
        self.collect_stats = True

    @property
    def quant_backend(self) -> str:
        """The kernels setting: 'auto', 'triton', 'compiled' or 'eager' (kept in :attr:`quant_state`)."""
        return self.quant_state.backend

    @quant_backend.setter
    def quant_backend(self, backend: str) -> None:
        self.quant_state.set_backend(backend)

    # ----------------------------------------------------------------- step, seeds, references
    def set_step(self, step: int, *, seed: int = 0, rank: int = 0) -> None:
        """Enter optimizer step ``step`` (1-based): drives reference refresh and reseeds SR."""
        self.quant_state.set_step(step, seed=seed, rank=rank)

    @property
    def references(self) -> ReferenceState:
        return self.quant_state.references

    # ----------------------------------------------------------------- module state
    def get_extra_state(self) -> dict[str, torch.Tensor]:
        """The held references (:meth:`ReferenceState.state_dict`), as the module's extra state: the
        model's state dict carries them, under the module's own name, through FSDP2, DeepSpeed,
        activation checkpointing and ``torch.compile`` (``get_model_state_dict`` drops the wrappers'
        segments), replicated like every unsharded tensor; weights-only consumers drop them
        (:func:`nemofp4.quant.without_quant_state`). The SR generators are not state: they are
        reseeded from (seed, rank, step, module index) every step; neither are the statistics."""
        return self.references.state_dict(device=self.weight.device)

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.references.load_state_dict(state, device=self.weight.device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:  # fmt: skip
        """A state without held references (the weights alone: a transformers import, a checkpoint
        written before references were module state) is a complete one: the module keeps what it holds
        (a fresh one: nothing, sampled at first use)."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)  # fmt: skip
        key = prefix + torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
        if key in missing_keys:
            missing_keys.remove(key)

    # ----------------------------------------------------------------- statistics and test hooks
    @property
    def _stats(self) -> dict[str, OperandStats]:
        return self.quant_state.stats

    @_stats.setter
    def _stats(self, value: dict[str, OperandStats]) -> None:
        self.quant_state.stats = value

    @property
    def _capture(self) -> list | None:
        """Test hook: set a list to collect every GEMM (name, operands, product)."""
        return self.quant_state.capture

    @_capture.setter
    def _capture(self, value: list | None) -> None:
        self.quant_state.capture = value

    def quant_stats(self) -> dict[str, float]:
        """Fractions of the last quantization of each role, and rho = current / held amax for roles with
        a held reference (:mod:`nemofp4.quant.stats`): '<role>/<stat>' -> value."""
        return {f"{role}/{k}": v for role, s in self._stats.items() for k, v in s.read().items()}

    # ----------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            compute_dtype = torch.get_autocast_dtype(device_type)
        else:
            compute_dtype = x.dtype
        with torch.autocast(device_type, enabled=False):
            return _opaque_quant_linear()(self, x, compute_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quant=[{self.quant_config.summary()}]"


class FP32Linear(nn.Linear):
    """``nn.Linear`` that computes in float32 even under autocast (the LM head of FP4 recipes).

    Output is float32, which is what the loss wants. With FSDP2 mixed precision the weight
    may arrive in BF16; it is upcast here, so keep the LM head's params in FP32 for a true
    FP32 head.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP32Linear:
        if type(linear) is not nn.Linear:
            raise ValueError(f"FP32Linear.from_linear needs a plain nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)

