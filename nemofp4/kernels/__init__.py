"""Fast forms of the FP4 programs, chosen by a backend setting: ``auto | triton | native | compiled | eager``.

* ``eager``: the torch quantization program (:mod:`nemofp4.kernels.program`) run op by op;
* ``compiled``: the same program compiled by Inductor (C++ on CPU), one graph per spec;
* ``native``: on CPU, a C++ kernel of the program's core (:mod:`nemofp4.kernels.native`, built on
  first use) for the float32 operands in blocks or tiles of 16 with E4M3/UE5M3 scales, one call
  each; the compiled program for the others;
* ``triton``: fused Triton kernels (:mod:`nemofp4.kernels.quantize`) on CUDA tensors;
* ``auto``: Triton on CUDA when importable, the native kernel on CPU when a C++ compiler is
  present, the eager program otherwise; on CPU a path it cannot take (no compiler, the native
  build failed) is one warning saying why, where an explicit ``native`` is an error.

Each path is a :class:`~nemofp4.kernels.backend.Backend` object (:mod:`nemofp4.kernels.backend`):
:func:`backend_for` resolves the setting for a device once, and a QuantLinear keeps the result.
Every path returns the same :class:`nemofp4.formats.QuantizedBlocks` and equals the float64-checked
reference :func:`nemofp4.formats.quantize_blocks` bit for bit (RNE; stochastic rounding on the
Triton path draws its own Philox bits). The backend is an argument, not a process-wide switch (a
compile failure falls back for that spec alone), and nothing here imports triton until a Triton
kernel runs (the first import of the kernel module decides whether kernels compile for the GPU or
run in Triton's CPU interpreter, ``TRITON_INTERPRET=1``):

    from nemofp4 import kernels
    backend = kernels.backend_for("auto", x.device)      # once per module and device
    op = backend.quantize(x, op_quant, tensor_amax=g)     # QuantizedBlocks
    q = kernels.quantize_blocks(x, scale_format="ue5m3")  # QuantizedBlocks
    c = kernels.gemm_hardware(qa, qb)                     # float32 A @ B^T

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
    resolve_backend,
    triton_available,
)
from .program import TOKEN_MULTIPLE, cpu_compile_available, tokens_transposed

__all__ = [
    "BACKENDS",
    "TOKEN_MULTIPLE",
    "Backend",
    "amax",
    "backend_for",
    "check_backend",
    "cpu_compile_available",
    "describe",
    "gemm_hardware",
    "hadamard_transform",
    "quantize_blocks",
    "quantize_operand",
    "quantize_operand_pair",
    "quantize_tokens_operand",
    "resolve_backend",
    "tokens_transposed",
    "triton_available",
]


def amax(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """max |x| as a float32 0-d tensor on x's device (exact): :meth:`Backend.amax`."""
    return backend_for(backend, x.device).amax(x)


def hadamard_transform(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``nemofp4.formats.wgrad_hadamard_transform``, compiled where the backend compiles (same bits)."""
    return backend_for(backend, x.device).hadamard_transform(x)


def quantize_blocks(x: torch.Tensor, *args, backend: str = "auto", **kwargs):
    """``nemofp4.formats.quantize_blocks`` (same arguments), run by the Triton kernel on CUDA.

    RNE results are bitwise identical on either path. For ``sr8``/``sr`` the Triton path seeds
    its Philox stream with one draw from ``generator``, so its bits differ from the reference's
    (same rule, same statistics). The Triton path skips the reference's NaN/Inf check.
    """
    return backend_for(backend, x.device).quantize_blocks(x, *args, **kwargs)


def quantize_operand(x: torch.Tensor, op, *, backend: str = "auto", **options):
    """:func:`nemofp4.kernels.program.quantize_operand` (same arguments and result) on the path
    ``backend`` resolves to: :meth:`Backend.quantize`."""
    return backend_for(backend, x.device).quantize(x, op, **options)


def quantize_tokens_operand(x_TD: torch.Tensor, op, *, backend: str = "auto", **options):
    """:func:`nemofp4.kernels.program.quantize_tokens_operand` (the wgrad operand X^T or dY^T of a
    token-major tensor, same arguments and result): :meth:`Backend.quantize_tokens`."""
    return backend_for(backend, x_TD.device).quantize_tokens(x_TD, op, **options)


def quantize_operand_pair(x_TK: torch.Tensor, op_x, op_xt, *, backend: str = "auto", **options):
    """(X along K, X^T [K, tokens padded to 16] along the tokens) sharing one tensor reference: one
    fused launch on CUDA, one compiled graph on CPU: :meth:`Backend.quantize_pair`."""
    return backend_for(backend, x_TK.device).quantize_pair(x_TK, op_x, op_xt, **options)


def gemm_hardware(a_q, b_q, *, backend: str = "auto", **options) -> torch.Tensor:
    """float32 ``A @ B^T`` under the probe-matched hardware model (``b_transposed``, ``lattice_snap``):
    the Triton kernel on CUDA (operands need packed codes), else the vectorized PyTorch twin."""
    return backend_for(backend, a_q.tensor_scale.device).gemm_hardware(a_q, b_q, **options)
