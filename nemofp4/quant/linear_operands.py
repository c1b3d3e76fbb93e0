"""The operands of one FP4 linear call: quantized with the module's references, generator and
kernels, the step's weight cache, and the shapes of what the forward saves for backward.

:class:`_Quantizer` builds the :class:`~nemofp4.kernels.OperandRequest`s of the operands a GEMM
needs (X along K and X^T along the tokens, W or W^T, dY and dY^T) and quantizes each group with one
backend call (one compiled graph on CPU, one fused launch for an X / X^T pair on CUDA), resolving
each tensor reference once and recording the statistics. Every operand is quantized from the
high-precision tensor in the layout of its own GEMM; quantized data is never re-quantized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemofp4 import kernels
from nemofp4.formats import QuantizedBlocks
from nemofp4.kernels import OperandRequest

from .config import LinearQuantConfig, OperandQuant, Role
from .linear_state import QuantCall, QuantLinearState

__all__ = ["gemm_form", "packed_weight_saved", "saved_shapes"]


def gemm_form(packed: QuantizedBlocks, gemm_mode: str) -> QuantizedBlocks:
    """A saved operand in the form its GEMM reads: the hardware model takes the packed codes."""
    return packed if gemm_mode == "hardware" else packed.unpack()


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
            self.references[ref] = self.state.references.get(
                ref, x, training=self.call.training, backend=self.call.backend
            )
        return self.references[ref]

    def held_source(self, role: Role, x):
        """``x`` (a tensor, or a function making it) when ``role`` is quantized with a held reference
        (for the staleness statistic), else None."""
        op: OperandQuant = self.config.operand(role)
        held = op.uses_tensor_reference and self.state.references.is_held(LinearQuantConfig.reference_of(role, op))
        return x if held else None

    def quantize(self, *requests: OperandRequest) -> tuple[QuantizedBlocks, ...]:
        """The requests as one backend call (stochastic ones draw from the call's generator, in order)."""
        return self.call.backend.quantize(*requests, generator=self.generator, stats=self.call.collect_stats)

    def __call__(
        self, role: Role, x: torch.Tensor, *, two_d: bool | None = None, pack: bool = False
    ) -> QuantizedBlocks:
        """``role``'s operand ``x`` along its last dim (or in tiles)."""
        (q,) = self.quantize(
            OperandRequest(
                x,
                self.config.operand(role),
                two_d=two_d,
                pack=pack or self.pack_all,
                tensor_amax=self.reference(role, x),
            )
        )
        self.record(role, q, self.held_source(role, x))
        return q

    @property
    def caches_weight(self) -> bool:
        """Whether the weight's operands come from the step's cache: in training, when the trainer
        keeps one, and only for a round-to-nearest weight, whose quantization draws no random bits
        (so reusing it skips nothing the generator would have drawn)."""
        return self.state.weight_cache is not None and self.call.training and self.config.w.rounding == "rne"

    def weight(
        self, w: torch.Tensor, *, two_d: bool | None = None, pack: bool = False, key: str = "w"
    ) -> QuantizedBlocks:
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
        return None if packed is None else gemm_form(packed, self.config.gemm)

    def cache_weight(self, key: str, q: QuantizedBlocks) -> None:
        """Keep the packed form of a freshly quantized weight operand while :attr:`caches_weight`."""
        if self.caches_weight:
            self.state.weight_cache[key] = QuantizedBlocks.from_tensors(q.tensors(), q.meta())

    def forward_operands(
        self, x_TK: torch.Tensor, w: torch.Tensor, *, with_xt: bool, pack_w: bool
    ) -> tuple[QuantizedBlocks, QuantizedBlocks | None, QuantizedBlocks]:
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
        requests = [OperandRequest(x_TK, config.x, pack=self.pack_all, tensor_amax=x_amax)]
        if with_xt:
            requests += [
                OperandRequest(x_TK, config.x_wgrad, layout="tokens", pack=True, values=False, tensor_amax=x_amax)
            ]
        requests += [
            OperandRequest(
                w, config.w, pack=pack_w or self.caches_weight or self.pack_all, tensor_amax=self.reference(Role.W, w)
            )
        ]
        qx, *qxt, qw = self.quantize(*requests)
        qxt = qxt[0] if with_xt else None
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
        (q,) = self.quantize(
            OperandRequest(
                x_TD,
                op,
                layout="tokens",
                pack=pack or self.pack_all,
                values=not pack,
                tensor_amax=self.reference(role, source),
            )
        )
        self.record(role, q, self.held_source(role, source))
        return q

    def record(self, role: Role, q: QuantizedBlocks, held_source) -> None:
        if self.call.collect_stats:
            if callable(held_source):
                held_source = held_source()
            self.state.record(role, q, held_source, backend=self.call.backend)

    def pair(
        self, role: Role, tokens_role: Role, x_TD: torch.Tensor, *, pack_tokens: bool
    ) -> tuple[QuantizedBlocks, QuantizedBlocks]:
        """``role`` along the last dim of ``x_TD`` and ``tokens_role``, its wgrad operand [D, Tp] along
        the tokens (X and X^T, or dY and dY^T), sharing one tensor reference: one compiled call on
        CPU, one read on CUDA. ``role``'s random bits are drawn first, as two calls would draw them.
        With ``pack_tokens`` the tokens operand comes in its packed form alone (X^T, saved for backward)."""
        config = self.config
        amax = self.reference(role, x_TD)
        assert amax is None or self.reference(tokens_role, x_TD) is amax  # one shared reference
        requests = kernels.x_and_tokens(
            x_TD,
            config.operand(role),
            config.operand(tokens_role),
            tensor_amax=amax,
            pack_x=self.pack_all,
            pack_xt=pack_tokens or self.pack_all,
            values_xt=not pack_tokens,
        )
        q, qt = self.quantize(*requests)
        self.record(role, q, self.held_source(role, x_TD))
        self.record(tokens_role, qt, self.held_source(tokens_role, x_TD))
        return q, qt

    @property
    def pack_all(self) -> bool:
        """Every operand packed: the backend's hardware GEMM reads packed codes (Triton's does)."""
        return self.config.gemm == "hardware" and self.call.backend.reads_packed_codes


def packed_weight_saved(config: LinearQuantConfig, backend: kernels.Backend) -> bool:
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


def saved_shapes(
    config: LinearQuantConfig,
    backend: kernels.Backend,
    x_TK: torch.Tensor,
    weight: torch.Tensor,
    needs_dx: bool,
    needs_dw: bool,
) -> list[tuple]:
    """The shapes of the operands the forward op returns for backward: X^T [K, tokens padded to 16]
    along the tokens, and the packed W where it is saved (:func:`packed_weight_saved`)."""
    shapes = []
    if needs_dw:
        tokens = x_TK.shape[0] + -x_TK.shape[0] % kernels.TOKEN_MULTIPLE
        shapes += _packed_shapes(config.x_wgrad, x_TK.shape[1], tokens, two_d=False)
    if needs_dx and packed_weight_saved(config, backend):
        shapes += _packed_shapes(config.w, *weight.shape, two_d=config.w.two_d)
    return shapes
