"""Fast forms of the FP4 programs, chosen by a backend setting, one of :data:`BACKENDS`.

* ``eager``: the torch quantization program (:mod:`nemofp4.kernels.program`) run op by op;
* ``compiled``: the same program compiled by Inductor (C++ on CPU), one graph per call;
* ``native``: on CPU, a C++ kernel of the program's core (:mod:`nemofp4.kernels.native`, built on
  first use) for the float32 operands in blocks or tiles of 16 with E4M3/UE5M3 scales, one call
  each; the compiled program for the others;
* ``triton``: fused Triton kernels (:mod:`nemofp4.kernels.quantize`) on CUDA tensors;
* ``auto``: Triton on CUDA when importable, the native kernel on CPU when a C++ compiler is
  present, the eager program otherwise; on CPU a path it cannot take (no compiler, the native
  build failed) is one warning saying why, where an explicit ``native`` or ``compiled`` is an error.

Each path is a :class:`~nemofp4.kernels.backend.Backend` object (:mod:`nemofp4.kernels.backend`):
:func:`backend_for` resolves the setting for a device once, and a QuantLinear keeps the result. A
backend quantizes the operands a GEMM needs in one call, one :class:`OperandRequest` each (layout
``rows`` or ``tokens``, packed or not). Every path returns the same
:class:`nemofp4.formats.QuantizedBlocks` and equals the float64-checked reference
:func:`nemofp4.formats.quantize_blocks` bit for bit (RNE; stochastic rounding on the Triton path
draws its own Philox bits). The backend is an argument, not a process-wide switch (a compile
failure falls back for that spec alone), and nothing here imports triton until a Triton kernel runs
(the first import of the kernel module decides whether kernels compile for the GPU or run in
Triton's CPU interpreter, ``TRITON_INTERPRET=1``):

    from nemofp4 import kernels
    backend = kernels.backend_for("auto", x.device)                          # once per module and device
    qx, qxt = backend.quantize(kernels.OperandRequest(x, op_x, tensor_amax=g),
                               kernels.OperandRequest(x, op_xt, layout="tokens", pack=True, tensor_amax=g))
    q = kernels.quantize_blocks(x, scale_format="ue5m3")                     # QuantizedBlocks
    c = kernels.gemm_hardware(qa, qb)                                        # float32 A @ B^T

The functions below resolve the setting at every call (for scripts and tests); code on the
training step holds a resolved :class:`Backend`.
"""

from __future__ import annotations

import torch

from .backend import (
    BACKENDS,
    Backend,
    backend_for,
    check_backend,
    describe,
    gpu_quantizer,
    planned_path,
    resolve_backend,
    triton_available,
)
from .program import x_and_tokens
from .request import TOKEN_MULTIPLE, OperandRequest, tokens_transposed
from .toolchain import cpu_compile_available

__all__ = [
    "BACKENDS",
    "TOKEN_MULTIPLE",
    "Backend",
    "OperandRequest",
    "amax",
    "backend_for",
    "check_backend",
    "cpu_compile_available",
    "describe",
    "gemm_hardware",
    "gpu_quantizer",
    "hadamard_transform",
    "planned_path",
    "quantize_blocks",
    "quantize_operand",
    "quantize_operands",
    "quantize_operand_pair",
    "quantize_tokens_operand",
    "resolve_backend",
    "tokens_transposed",
    "triton_available",
    "x_and_tokens",
]


def amax(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """max |x| as a float32 0-d tensor on x's device (exact): :meth:`Backend.amax`."""
    return backend_for(backend, x.device).amax(x)


def hadamard_transform(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``nemofp4.formats.wgrad_hadamard_transform``, compiled where the backend compiles (same bits)."""
    return backend_for(backend, x.device).hadamard_transform(x)


def quantize_blocks(x: torch.Tensor, *args, backend: str = "auto", **kwargs):
    """``nemofp4.formats.quantize_blocks`` (same arguments) on the path ``backend`` resolves to for
    ``x``'s device: :meth:`Backend.quantize_blocks` (the torch program, its native kernel or the
    Triton kernel; never the float64 reference except for what no fast path covers).

    Results are bitwise identical to the reference's for RNE on every path, and for the stochastic
    roundings on the program's. The Triton path seeds its Philox stream with one draw from
    ``generator``, so its bits differ from the reference's (same rule, same statistics). The fast
    paths skip the reference's NaN/Inf check and keep the block counts alone.
    """
    return backend_for(backend, x.device).quantize_blocks(x, *args, **kwargs)


def quantize_operands(
    *requests: OperandRequest, backend: str = "auto", generator: torch.Generator | None = None, stats: bool = True
):
    """:meth:`Backend.quantize` of ``requests`` on the path ``backend`` resolves to for their device."""
    return backend_for(backend, requests[0].tensor.device).quantize(*requests, generator=generator, stats=stats)


def quantize_operand(x: torch.Tensor, op, *, backend: str = "auto", generator=None, stats: bool = True, **request):
    """One ``rows`` request (``tensor_amax``, ``two_d``, ``pack``, ``values``): the 2-D ``x`` along its
    last dim (or in tiles) as ``op`` (a :class:`~nemofp4.formats.BlockSpec`) says."""
    return quantize_operands(OperandRequest(x, op, **request), backend=backend, generator=generator, stats=stats)[0]


def quantize_tokens_operand(
    x_TD: torch.Tensor, op, *, backend: str = "auto", generator=None, stats: bool = True, **request
):
    """One ``tokens`` request: the wgrad operand X^T or dY^T [D, Tp] of a token-major ``x_TD``."""
    request = OperandRequest(x_TD, op, layout="tokens", **request)
    return quantize_operands(request, backend=backend, generator=generator, stats=stats)[0]


def quantize_operand_pair(
    x_TK: torch.Tensor,
    op_x,
    op_xt,
    *,
    backend: str = "auto",
    generator=None,
    stats: bool = True,
    tensor_amax=None,
    **packing,
):
    """(X along K, X^T [K, tokens padded to 16] along the tokens) sharing one tensor reference: one
    fused launch on CUDA, one compiled graph on CPU (``pack_x``, ``pack_xt``, ``values_xt``)."""
    requests = x_and_tokens(x_TK, op_x, op_xt, tensor_amax=tensor_amax, **packing)
    qx, qxt = quantize_operands(*requests, backend=backend, generator=generator, stats=stats)
    return qx, qxt


def gemm_hardware(a_q, b_q, *, backend: str = "auto", **options) -> torch.Tensor:
    """float32 ``A @ B^T`` under the probe-matched hardware model (``b_transposed``, ``lattice_snap``):
    the Triton kernel on CUDA (operands need packed codes), else the vectorized PyTorch twin."""
    return backend_for(backend, a_q.tensor_scale.device).gemm_hardware(a_q, b_q, **options)
