"""Fast forms of the FP4 programs, chosen by a backend setting: ``auto | triton | compiled | eager``.

* ``eager``: the torch quantization program (:mod:`nemofp4.kernels.program`) run op by op;
* ``compiled``: the same program compiled by Inductor (C++ on CPU);
* ``triton``: fused Triton kernels (:mod:`nemofp4.kernels.quantize`) on CUDA tensors;
* ``auto``: Triton on CUDA when importable, the compiled program on CPU when a C++ compiler is
  present, the eager program otherwise.

Every path returns the same :class:`nemofp4.formats.QuantizedBlocks` and equals the float64-checked
reference :func:`nemofp4.formats.quantize_blocks` bit for bit (RNE; stochastic rounding on the
Triton path draws its own Philox bits). The backend is an argument, not a process-wide switch,
and nothing here imports triton until a Triton kernel runs (the first import decides whether
kernels compile for the GPU or run in Triton's CPU interpreter, ``TRITON_INTERPRET=1``):

    from nemofp4 import kernels
    op = kernels.quantize_operand(x, op_quant, tensor_amax=g, backend="auto")   # QuantizedBlocks
    q = kernels.quantize_blocks(x, scale_format="ue5m3")                        # QuantizedBlocks
    c = kernels.gemm_hardware(qa, qb)                                           # float32 A @ B^T
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from nemofp4.formats import amax as reference_amax
from nemofp4.formats import quantize_blocks as reference_quantize_blocks
from nemofp4.formats import wgrad_hadamard_transform as reference_hadamard_transform

from .program import TOKEN_MULTIPLE, compiled_hadamard_transform, cpu_compile_available, tokens_transposed
from .program import quantize_operand as program_quantize_operand
from .program import quantize_tokens_operand as program_quantize_tokens_operand
from .quantize import SUPPORTED_BLOCK_SIZES

__all__ = [
    "BACKENDS",
    "TOKEN_MULTIPLE",
    "amax",
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

BACKENDS = ("auto", "triton", "compiled", "eager")


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


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The path (``triton``, ``compiled`` or ``eager``) that ``backend`` takes for tensors on ``device``."""
    check_backend(backend)
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if _triton_importable() else "eager"
        if device.type == "cpu" and cpu_compile_available():
            return "compiled"
        return "eager"
    if backend == "triton" and not (device.type == "cuda" and _triton_importable()):
        raise ValueError(
            f"backend 'triton' needs CUDA tensors and an importable triton; got a {device.type} tensor"
            f"{'' if _triton_importable() else ' and no triton'} (use 'auto', 'compiled' or 'eager')"
        )
    if backend == "compiled" and device.type == "cpu" and not cpu_compile_available():
        return "eager"  # no C++ compiler, or a build failed (that warned once): same numerics
    return backend


def describe(device: torch.device | str, backend: str = "auto") -> str:
    """One line for the start-up log: which quantizer FP4 operands on ``device`` will use."""
    path = resolve_backend(backend, device)
    if path == "triton":
        return "FP4 quantization: fused Triton kernels"
    if path == "compiled":
        return "FP4 quantization: compiled torch program (torch.compile; the first step builds it)"
    if backend == "eager":
        return "FP4 quantization: eager torch program (kernels=eager)"
    return (
        "FP4 quantization: eager torch program (no Triton on this device, no C++ compiler for torch.compile)"
    )


# ------------------------------------------------------------------------------------ dispatch
def amax(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """max |x| as a float32 0-d tensor on x's device (exact)."""
    if resolve_backend(backend, x.device) == "triton":
        from .quantize import triton_amax

        return triton_amax(x)
    return reference_amax(x)


def hadamard_transform(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``nemofp4.formats.wgrad_hadamard_transform`` (TE's wgrad signs, rounded to BF16), compiled
    where the backend compiles the quantizer (same bits)."""
    if resolve_backend(backend, x.device) == "compiled":
        return compiled_hadamard_transform(x)
    return reference_hadamard_transform(x)


def quantize_blocks(
    x: torch.Tensor,
    scale_format: str = "ue5m3",
    block_size: int | None = None,
    two_d: bool = False,
    scale_target: float = 448.0,
    tensor_amax: torch.Tensor | float | None = None,
    rounding: str = "rne",
    generator: torch.Generator | None = None,
    *,
    mx_scale_mode: str = "floor",
    backend: str = "auto",
):
    """``nemofp4.formats.quantize_blocks`` (same arguments), run by the Triton kernel on CUDA.

    RNE results are bitwise identical on either path. For ``sr8``/``sr`` the Triton path seeds
    its Philox stream with one draw from ``generator``, so its bits differ from the reference's
    (same rule, same statistics). The Triton path skips the reference's NaN/Inf check.
    """
    triton = resolve_backend(backend, x.device) == "triton"
    if triton and (block_size is None or block_size in SUPPORTED_BLOCK_SIZES):
        from .operand import _seed
        from .quantize import triton_quantize_blocks

        return triton_quantize_blocks(
            x,
            scale_format=scale_format,
            block_size=block_size,
            two_d=two_d,
            scale_target=scale_target,
            tensor_amax=tensor_amax,
            rounding=rounding,
            seed=_seed(rounding, generator, x.device),
            mx_scale_mode=mx_scale_mode,
        )
    return reference_quantize_blocks(
        x, scale_format, block_size, two_d, scale_target, tensor_amax, rounding, generator,
        mx_scale_mode=mx_scale_mode,
    )  # fmt: skip


def quantize_operand(
    x: torch.Tensor,
    op,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    two_d: bool | None = None,
    pack: bool = False,
    stats: bool = True,
    backend: str = "auto",
):
    """:func:`nemofp4.kernels.program.quantize_operand` (same arguments and result) on the path
    ``backend`` resolves to (Triton for block sizes it has kernels for)."""
    path = resolve_backend(backend, x.device)
    if path == "triton" and op.block_size in SUPPORTED_BLOCK_SIZES:
        from .operand import triton_quantize_operand

        return triton_quantize_operand(
            x, op, tensor_amax=tensor_amax, generator=generator, two_d=two_d, pack=pack, stats=stats
        )
    return program_quantize_operand(
        x, op, tensor_amax=tensor_amax, generator=generator, two_d=two_d, pack=pack, stats=stats,
        compiled=path == "compiled",
    )  # fmt: skip


def quantize_tokens_operand(
    x_TD: torch.Tensor,
    op,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    pack: bool = False,
    stats: bool = True,
    backend: str = "auto",
):
    """:func:`nemofp4.kernels.program.quantize_tokens_operand` (the wgrad operand X^T or dY^T of a
    token-major tensor, same arguments and result) on the path ``backend`` resolves to. Triton
    quantizes the padded transpose (after the eager Hadamard transform when ``op.hadamard``)."""
    path = resolve_backend(backend, x_TD.device)
    if path == "triton" and op.block_size in SUPPORTED_BLOCK_SIZES:
        from .operand import triton_quantize_operand

        t = tokens_transposed(x_TD)
        if op.hadamard:
            t = reference_hadamard_transform(t)
        return triton_quantize_operand(t, op, tensor_amax=tensor_amax, generator=generator, pack=pack, stats=stats)
    return program_quantize_tokens_operand(
        x_TD, op, tensor_amax=tensor_amax, generator=generator, pack=pack, stats=stats,
        compiled=path == "compiled",
    )  # fmt: skip


def quantize_operand_pair(
    x_TK: torch.Tensor,
    op_x,
    op_xt,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    pack_x: bool = False,
    pack_xt: bool = True,
    stats: bool = True,
    backend: str = "auto",
):
    """(X along K, X^T [K, tokens padded to 16] along the tokens) sharing one tensor reference: one
    fused launch on CUDA, two quantizations of ``x_TK`` otherwise (:func:`quantize_operand` and
    :func:`quantize_tokens_operand`). See :func:`nemofp4.kernels.operand.triton_quantize_operand_pair`
    for when the two can be fused (same format, block and rounding; no Hadamard)."""
    fusable = (
        op_x.scale_format == op_xt.scale_format
        and op_x.block_size == op_xt.block_size
        and op_x.rounding == op_xt.rounding
        and not (op_x.two_d or op_xt.two_d or op_x.hadamard or op_xt.hadamard)
        and op_x.block_size in SUPPORTED_BLOCK_SIZES
    )
    if fusable and resolve_backend(backend, x_TK.device) == "triton":
        from .operand import triton_quantize_operand_pair

        return triton_quantize_operand_pair(
            x_TK, op_x, op_xt, tensor_amax=tensor_amax, generator=generator,
            pack_x=pack_x, pack_xt=pack_xt, stats=stats,
        )  # fmt: skip
    if op_xt.hadamard:
        raise ValueError("X and X^T share one tensor reference only without a Hadamard transform on X^T")
    common = dict(tensor_amax=tensor_amax, generator=generator, stats=stats, backend=backend)
    first = quantize_operand(x_TK, op_x, pack=pack_x, **common)
    second = quantize_tokens_operand(x_TK, op_xt, pack=pack_xt, **common)
    return first, second


def gemm_hardware(
    a_q, b_q, *, b_transposed: bool = False, lattice_snap: bool = False, backend: str = "auto"
) -> torch.Tensor:
    """float32 ``A @ B^T`` under the probe-matched hardware model: the Triton kernel on CUDA
    (operands need packed codes), else the vectorized PyTorch twin (same numerics)."""
    from .hardware_gemm import hardware_gemm_torch, triton_hardware_gemm

    has_codes = a_q.codes is not None and b_q.codes is not None
    if has_codes and resolve_backend(backend, a_q.tensor_scale.device) == "triton":
        return triton_hardware_gemm(a_q, b_q, b_transposed=b_transposed, lattice_snap=lattice_snap)
    return hardware_gemm_torch(a_q, b_q, b_transposed=b_transposed, lattice_snap=lattice_snap)
