"""The kernel backends: one object per path, resolved once from the ``kernels`` knob and a device.

A :class:`Backend` does the five things a quantized linear asks of the kernels: quantize an
operand, quantize the token-major wgrad operand (and the X / X^T pair that shares one tensor
reference, and the forward's X, X^T and W together), measure an amax, apply the wgrad Hadamard
transform, and run the hardware GEMM model.
Four implementations, with the same numerics:

* :class:`EagerBackend`: the torch program (:mod:`nemofp4.kernels.program`) op by op;
* :class:`CompiledBackend`: the same program compiled by Inductor (C++ on CPU). A spec whose build
  fails warns once, naming the spec, and runs eagerly from then on; every other spec still compiles;
* :class:`NativeBackend`: on CPU, the native kernel of :mod:`nemofp4.kernels.native` for the
  operands it covers (checked bit for bit against the program), the compiled program for the rest;
* :class:`TritonBackend`: the fused Triton kernels (CUDA, or Triton's CPU interpreter in tests), the
  torch program for block sizes they have no kernel for.

:func:`backend_for` turns the knob (``auto | triton | native | compiled | eager``, the trainer's
``train.kernels``, the evaluator's ``kernels``) and a device into one of the four; a QuantLinear
calls it once per device and keeps the result (:meth:`nemofp4.quant.QuantLinearState.kernels_for`).
An explicit ``native`` that cannot run here (no C++ compiler, the build failed) is an error naming
the cause; ``auto`` then falls back to the compiled program (or, without a compiler, the eager one)
with one warning naming it.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import warnings
from typing import Protocol

import torch

from nemofp4.formats import QuantizedBlocks, amax, quantize_blocks, wgrad_hadamard_transform
from nemofp4.formats.spec import BlockSpec

from . import native, program
from .program import cpu_compile_available, tokens_transposed
from .quantize import SUPPORTED_BLOCK_SIZES

__all__ = [
    "BACKENDS",
    "Backend",
    "CompiledBackend",
    "EagerBackend",
    "NativeBackend",
    "TritonBackend",
    "backend_for",
    "check_backend",
    "describe",
    "resolve_backend",
    "triton_available",
]

BACKENDS = ("auto", "triton", "native", "compiled", "eager")


class Backend(Protocol):
    """What a quantized linear asks of the kernels. ``options`` of the quantizers: ``tensor_amax``
    (None: measured here), ``generator`` (stochastic rounding), ``two_d`` (override of the spec's,
    :meth:`quantize` only), ``pack`` (add the packed codes), ``values`` (False: the packed form
    alone, for an operand only saved for backward; ``values_xt`` for X^T in :meth:`quantize_pair` and
    :meth:`quantize_forward`) and ``stats`` (keep the block counts);
    see :func:`nemofp4.kernels.program.quantize_operand`, whose results every backend returns."""

    name: str
    """'eager', 'compiled' or 'triton'."""
    reads_packed_codes: bool
    """Its hardware GEMM reads packed FP4 codes (so its operands are always packed)."""

    def quantize(self, x: torch.Tensor, spec: BlockSpec, **options) -> QuantizedBlocks: ...

    def quantize_tokens(self, x_TD: torch.Tensor, spec: BlockSpec, **options) -> QuantizedBlocks: ...

    def quantize_pair(self, x_TK: torch.Tensor, spec_x: BlockSpec, spec_xt: BlockSpec, *, pack_x: bool = False,
                      pack_xt: bool = True, values_xt: bool = True,
                      **options) -> tuple[QuantizedBlocks, QuantizedBlocks]: ...  # fmt: skip

    def quantize_forward(self, x_TK: torch.Tensor, weight: torch.Tensor, spec_x: BlockSpec, spec_xt: BlockSpec | None,
                         spec_w: BlockSpec, *, x_amax: torch.Tensor | None = None,
                         w_amax: torch.Tensor | None = None, pack_x: bool = False, pack_xt: bool = True,
                         values_xt: bool = True, pack_w: bool = False,
                         **options) -> tuple[QuantizedBlocks, QuantizedBlocks | None, QuantizedBlocks]: ...  # fmt: skip

    def amax(self, x: torch.Tensor) -> torch.Tensor: ...

    def hadamard_transform(self, x: torch.Tensor) -> torch.Tensor: ...

    def gemm_hardware(self, a: QuantizedBlocks, b: QuantizedBlocks, **options) -> torch.Tensor: ...


class EagerBackend:
    """The torch quantization program run op by op (the reference's numerics, bit for bit)."""

    name = "eager"
    reads_packed_codes = False
    _compiled = False
    _native = False

    def __repr__(self) -> str:
        return f"<{self.name} FP4 kernels>"

    def quantize(self, x, spec, **options):
        """``x`` [rows, cols] quantized along its last dim (or in tiles) as ``spec`` says."""
        return program.quantize_operand(x, spec, compiled=self._compiled, native=self._native, **options)

    def quantize_tokens(self, x_TD, spec, **options):
        """The wgrad operand of a token-major ``x_TD`` [T, D]: its transpose [D, Tp] (tokens padded to
        16) quantized along the tokens, after ``spec.hadamard``'s transform."""
        return program.quantize_tokens_operand(x_TD, spec, compiled=self._compiled, native=self._native, **options)

    def quantize_pair(self, x_TK, spec_x, spec_xt, *, pack_x=False, pack_xt=True, **options):
        """(X along K, X^T [K, tokens padded to 16] along the tokens) sharing one tensor reference (one
        compiled graph for the two)."""
        return program.quantize_operand_pair(x_TK, spec_x, spec_xt, pack_x=pack_x, pack_xt=pack_xt,
                                             compiled=self._compiled, native=self._native, **options)  # fmt: skip

    def quantize_forward(self, x_TK, weight, spec_x, spec_xt, spec_w, *, x_amax=None, w_amax=None, pack_x=False,
                         pack_xt=True, pack_w=False, **options):  # fmt: skip
        """(X, X^T or None when ``spec_xt`` is None, W): what a linear's forward quantizes, one compiled
        graph for the three."""
        return program.quantize_forward_operands(x_TK, weight, spec_x, spec_xt, spec_w, x_amax=x_amax, w_amax=w_amax,
                                                 pack_x=pack_x, pack_xt=pack_xt, pack_w=pack_w,
                                                 compiled=self._compiled, native=self._native, **options)  # fmt: skip

    def quantize_blocks(self, x, *args, **kwargs):
        """:func:`nemofp4.formats.quantize_blocks` (same arguments)."""
        return quantize_blocks(x, *args, **kwargs)

    def amax(self, x):
        """max |x| as a float32 0-d tensor on x's device (exact)."""
        return amax(x)

    def hadamard_transform(self, x):
        """:func:`nemofp4.formats.wgrad_hadamard_transform` (TE's wgrad signs, rounded to BF16)."""
        return wgrad_hadamard_transform(x)

    def gemm_hardware(self, a, b, **options):
        """float32 ``A @ B^T`` under the probe-matched hardware model (the vectorized torch twin)."""
        from .hardware_gemm import hardware_gemm_torch

        return hardware_gemm_torch(a, b, **options)


class CompiledBackend(EagerBackend):
    """The same program compiled by Inductor, one graph per spec (the same bits)."""

    name = "compiled"
    _compiled = True

    def hadamard_transform(self, x):
        return program.compiled_hadamard_transform(x)


class NativeBackend(CompiledBackend):
    """The native CPU kernel (:mod:`nemofp4.kernels.native`) for the operands it supports, one ctypes
    call each; the compiled program for the rest (the same bits)."""

    name = "native"
    _native = True

    def amax(self, x):
        """max |x| in one native pass for a contiguous float32 tensor (exact), else the program's."""
        return native.amax(x) if native.supports_amax(x) else super().amax(x)


def _triton_covers(spec: BlockSpec) -> bool:
    """The Triton kernels quantize FP4 (E2M1) payloads in the block sizes they have kernels for."""
    return spec.block_size in SUPPORTED_BLOCK_SIZES and not spec.is_fp8


class TritonBackend(EagerBackend):
    """Fused Triton kernels; the torch program for FP8 payloads and the block sizes they have no kernel for."""

    name = "triton"
    reads_packed_codes = True

    def quantize(self, x, spec, **options):
        if not _triton_covers(spec):
            return super().quantize(x, spec, **options)
        from .operand import triton_quantize_operand

        return triton_quantize_operand(x, spec, **options)

    def quantize_tokens(self, x_TD, spec, **options):
        """The padded transpose, quantized (after the eager Hadamard transform when ``spec.hadamard``)."""
        if not _triton_covers(spec):
            return super().quantize_tokens(x_TD, spec, **options)
        from .operand import triton_quantize_operand

        t = tokens_transposed(x_TD)
        return triton_quantize_operand(wgrad_hadamard_transform(t) if spec.hadamard else t, spec, **options)

    def quantize_pair(self, x_TK, spec_x, spec_xt, *, pack_x=False, pack_xt=True, values_xt=True, **options):
        """One fused launch when the two can share it (same format, block and rounding; 1-D blocks
        without a Hadamard transform); two quantizations otherwise."""
        fusable = (spec_x.blocks_like(spec_xt) and _triton_covers(spec_x)
                   and not (spec_x.two_d or spec_xt.two_d or spec_x.hadamard or spec_xt.hadamard))  # fmt: skip
        if spec_xt.hadamard:
            raise ValueError("X and X^T share one tensor reference only without a Hadamard transform on X^T")
        if not fusable:
            return self.quantize(x_TK, spec_x, pack=pack_x, **options), self.quantize_tokens(
                x_TK, spec_xt, pack=pack_xt, values=values_xt, **options)  # fmt: skip
        from .operand import triton_quantize_operand_pair

        return triton_quantize_operand_pair(x_TK, spec_x, spec_xt, pack_x=pack_x, pack_xt=pack_xt, values_xt=values_xt,
                                            **options)  # fmt: skip

    def quantize_forward(self, x_TK, weight, spec_x, spec_xt, spec_w, *, x_amax=None, w_amax=None, pack_x=False,
                         pack_xt=True, values_xt=True, pack_w=False, **options):  # fmt: skip
        """X (with X^T: :meth:`quantize_pair`), then W: kernel launches, which have no per-call guards
        to share."""
        if spec_xt is None:
            qx, qxt = self.quantize(x_TK, spec_x, tensor_amax=x_amax, pack=pack_x, **options), None
        else:
            qx, qxt = self.quantize_pair(x_TK, spec_x, spec_xt, tensor_amax=x_amax, pack_x=pack_x, pack_xt=pack_xt,
                                         values_xt=values_xt, **options)  # fmt: skip
        return qx, qxt, self.quantize(weight, spec_w, tensor_amax=w_amax, pack=pack_w, **options)

    def quantize_blocks(self, x, *args, **kwargs):
        """The Triton kernel for the block sizes it has; its stochastic roundings seed Philox with one
        draw from ``generator`` (same rule, other bits). It skips the reference's NaN/Inf check."""
        arguments = _QUANTIZE_BLOCKS.bind(x, *args, **kwargs)
        arguments.apply_defaults()
        a = arguments.arguments
        if a["block_size"] not in (None, *SUPPORTED_BLOCK_SIZES):
            return super().quantize_blocks(x, *args, **kwargs)
        from .operand import _seed
        from .quantize import triton_quantize_blocks

        return triton_quantize_blocks(
            x, scale_format=a["scale_format"], block_size=a["block_size"], two_d=a["two_d"],
            scale_target=a["scale_target"], tensor_amax=a["tensor_amax"], rounding=a["rounding"],
            seed=_seed(a["rounding"], a["generator"], x.device), mx_scale_mode=a["mx_scale_mode"],
        )  # fmt: skip

    def amax(self, x):
        from .quantize import triton_amax

        return triton_amax(x)

    def gemm_hardware(self, a, b, **options):
        """The Triton kernel when both operands have packed codes, else the torch twin."""
        if a.codes is None or b.codes is None:
            return super().gemm_hardware(a, b, **options)
        from .hardware_gemm import triton_hardware_gemm

        return triton_hardware_gemm(a, b, **options)


_QUANTIZE_BLOCKS = inspect.signature(quantize_blocks)
_BACKENDS = {backend.name: backend for backend in (EagerBackend(), CompiledBackend(), NativeBackend(), TritonBackend())}


# ------------------------------------------------------------------------------------ resolution
@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Triton is importable and has somewhere to run: a CUDA device, or ``TRITON_INTERPRET=1``."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _triton_importable() and (torch.cuda.is_available() or interpret)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown FP4 kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
    return backend


_FALLBACKS = {"compiled": "the compiled torch program", "eager": "the eager torch program (op by op, slower)"}
_warned: set[str] = set()


def _fall_back(path: str, why: str) -> str:
    """``auto``'s ``path`` when a faster one cannot run here, with one warning per cause in the process
    (each module resolves the setting for itself)."""
    message = f"kernels='auto': {why}; {_FALLBACKS[path]} quantizes instead (the same numerics)"
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
    return path


def _cannot_run_native(why: str, use: str) -> ValueError:
    return ValueError(f"kernels='native' (train.kernels, or nemofp4-eval's kernels) cannot run here: {why}; "
                      f"use {use}")  # fmt: skip


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The path (``triton``, ``native``, ``compiled`` or ``eager``) that ``backend`` takes for tensors on
    ``device``. An explicit ``native`` that cannot run is a ValueError saying why; ``auto`` falls back
    to the compiled program, or without a C++ compiler to the eager one, with one warning saying why."""
    check_backend(backend)
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if _triton_importable() else "eager"
        if device.type != "cpu":
            return "eager"
        if not cpu_compile_available():
            return _fall_back("eager", native.NO_COMPILER)
        if native.available():
            return "native"
        return _fall_back("compiled", native.unavailable_reason())
    if backend == "triton" and not (device.type == "cuda" and _triton_importable()):
        raise ValueError(
            f"backend 'triton' needs CUDA tensors and an importable triton; got a {device.type} tensor"
            f"{'' if _triton_importable() else ' and no triton'} (use 'auto', 'native', 'compiled' or 'eager')"
        )
    if backend == "native":
        if device.type != "cpu":
            raise _cannot_run_native(f"it quantizes CPU tensors, and these are on {device.type}",
                                     "'auto', 'triton', 'compiled' or 'eager'")  # fmt: skip
        if not cpu_compile_available():
            raise _cannot_run_native(native.NO_COMPILER, "'auto' or 'eager' (the eager torch program: the same numerics)")
        if not native.available():
            raise _cannot_run_native(native.unavailable_reason(), "'auto', 'compiled' (the compiled torch program: "
                                     "the same numerics) or 'eager'")  # fmt: skip
    if backend == "compiled" and device.type == "cpu" and not cpu_compile_available():
        return "eager"  # no C++ compiler: same numerics
    return backend


def backend_for(backend: str, device: torch.device | str) -> Backend:
    """The :class:`Backend` that the knob ``backend`` resolves to for tensors on ``device``."""
    return _BACKENDS[resolve_backend(backend, device)]


def describe(device: torch.device | str, backend: str = "auto") -> str:
    """One line for the start-up log: which quantizer FP4 operands on ``device`` will use."""
    path = resolve_backend(backend, device)
    if path == "triton":
        return "FP4 quantization: fused Triton kernels"
    if path == "native":
        return ("FP4 quantization: native CPU kernel (built on first use), the compiled torch program for the "
                "operands it does not cover")
    if path == "compiled":
        return "FP4 quantization: compiled torch program (torch.compile; the first step builds it)"
    if backend == "eager":
        return "FP4 quantization: eager torch program (kernels=eager)"
    return "FP4 quantization: eager torch program (no Triton on this device, no C++ compiler for torch.compile)"
