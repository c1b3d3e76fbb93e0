"""The fast paths of FP4 quantization: fused Triton kernels on CUDA, an Inductor-compiled
quantizer on CPU, and the ``hardware`` GEMM emulator.

Every function here has a PyTorch reference with the same numerics (``nemofp4.formats`` for
quantization; :mod:`nemofp4.kernels.hardware_gemm` for the GEMM model). The dispatchers below
pick the Triton kernel for CUDA tensors when Triton is importable and the switch allows it,
the ``torch.compile``-fused quantizer (:mod:`nemofp4.kernels.compiled`) for CPU tensors when
a C++ compiler is present, and the eager PyTorch path otherwise:

    from nemofp4 import kernels
    q = kernels.quantize_blocks(x, scale_format="ue5m3")          # QuantizedBlocks
    op = kernels.quantize_operand(x, op_quant, tensor_amax=g)      # quant's BlockOperand
    c = kernels.gemm_hardware(qa, qb)                              # float32 A @ B^T
    kernels.use_triton(False)                                      # force the reference path

The switch starts from the environment variable ``NEMOFP4_TRITON`` (``0`` disables Triton);
``NEMOFP4_CPU_COMPILE=0`` disables the compiled CPU quantizer alone. Nothing here imports
triton until a kernel runs: the first import decides, for the whole process, whether kernels
compile for the GPU or run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, which the unit
tests use).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator

import torch

__all__ = [
    "amax",
    "describe",
    "gemm_hardware",
    "quantize_blocks",
    "quantize_operand",
    "quantize_operand_pair",
    "triton_available",
    "triton_enabled",
    "use_triton",
    "using_triton",
]

_prefer_triton = os.environ.get("NEMOFP4_TRITON", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Triton is importable and has somewhere to run: a CUDA device, or ``TRITON_INTERPRET=1``."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _triton_importable() and (torch.cuda.is_available() or interpret)


def use_triton(prefer: bool) -> None:
    """Process-wide switch: ``False`` forces the eager PyTorch path everywhere (no Triton, no
    compiled CPU quantizer)."""
    global _prefer_triton
    _prefer_triton = bool(prefer)


def triton_enabled() -> bool:
    """The current setting of the :func:`use_triton` switch."""
    return _prefer_triton


@contextlib.contextmanager
def using_triton(prefer: bool) -> Iterator[None]:
    """``with using_triton(False): ...`` runs a block on the reference path, then restores."""
    previous = _prefer_triton
    use_triton(prefer)
    try:
        yield
    finally:
        use_triton(previous)


def _use_triton_for(x: torch.Tensor) -> bool:
    return _prefer_triton and x.is_cuda and _triton_importable()


def _use_compiled_for(x: torch.Tensor, op) -> bool:
    """The Inductor-compiled quantizer for CPU tensors (see :mod:`nemofp4.kernels.compiled`)."""
    if not (_prefer_triton and x.device.type == "cpu"):
        return False
    from .compiled import cpu_compile_available, cpu_compile_supports

    return cpu_compile_supports(op) and cpu_compile_available()


def describe(device: torch.device | str) -> str:
    """One line for the start-up log: which quantizer FP4 operands on ``device`` will use."""
    device = torch.device(device)
    if not _prefer_triton:
        return "FP4 quantization: eager PyTorch path (fast kernels switched off)"
    if device.type == "cuda":
        if _triton_importable():
            return "FP4 quantization: fused Triton kernels"
        return "FP4 quantization: eager PyTorch path (triton is not importable)"
    if device.type == "cpu":
        from .compiled import cpu_compile_available

        if cpu_compile_available():
            return (
                "FP4 quantization: compiled CPU quantizer (torch.compile; the first step builds it); "
                "eager PyTorch path for MX scales and exact SR"
            )
        return "FP4 quantization: eager PyTorch path (no C++ compiler, or NEMOFP4_CPU_COMPILE=0)"
    return "FP4 quantization: eager PyTorch path"


# ------------------------------------------------------------------------------------ dispatch
def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor on x's device (exact)."""
    if _use_triton_for(x):
        from .quantize import triton_amax

        return triton_amax(x)
    from nemofp4.formats import amax as reference_amax

    return reference_amax(x)


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
):
    """``nemofp4.formats.quantize_blocks`` (same arguments), run by the Triton kernel on CUDA.

    RNE results are bitwise identical on either path. For ``sr8``/``sr`` the Triton path seeds
    its Philox stream with one draw from ``generator``, so its bits differ from the reference's
    (same rule, same statistics). The Triton path skips the reference's NaN/Inf check.
    """
    from .quantize import SUPPORTED_BLOCK_SIZES

    if _use_triton_for(x) and (block_size is None or block_size in SUPPORTED_BLOCK_SIZES):
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
    from nemofp4.formats import quantize_blocks as reference_quantize_blocks

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
):
    """``nemofp4.quant.blocks.quantize_operand`` (same arguments and result), by the Triton kernel
    on CUDA and the Inductor-compiled one on CPU (formats and roundings it implements; the
    eager PyTorch path otherwise)."""
    from .quantize import SUPPORTED_BLOCK_SIZES

    if _use_triton_for(x) and op.block_size in SUPPORTED_BLOCK_SIZES:
        from .operand import triton_quantize_operand

        return triton_quantize_operand(
            x, op, tensor_amax=tensor_amax, generator=generator, two_d=two_d, pack=pack, stats=stats
        )
    if _use_compiled_for(x, op):
        from .compiled import compiled_quantize_operand

        return compiled_quantize_operand(
            x, op, tensor_amax=tensor_amax, generator=generator, two_d=two_d, pack=pack, stats=stats
        )
    from nemofp4.quant.blocks import quantize_operand as reference_quantize_operand

    return reference_quantize_operand(
        x, op, tensor_amax=tensor_amax, generator=generator, two_d=two_d, pack=pack, stats=stats
    )


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
):
    """(X along K, X^T [K, tokens padded to 16] along the tokens): one fused launch on CUDA, two
    reference quantizations otherwise. See :func:`nemofp4.kernels.operand.triton_quantize_operand_pair`
    for when the two can be fused (same format, block and rounding; no Hadamard)."""
    from .quantize import SUPPORTED_BLOCK_SIZES

    fusable = (
        op_x.scale_format == op_xt.scale_format
        and op_x.block_size == op_xt.block_size
        and op_x.rounding == op_xt.rounding
        and not (op_x.two_d or op_xt.two_d or op_x.hadamard or op_xt.hadamard)
        and op_x.block_size in SUPPORTED_BLOCK_SIZES
    )
    if _use_triton_for(x_TK) and fusable:
        from .operand import triton_quantize_operand_pair

        return triton_quantize_operand_pair(
            x_TK, op_x, op_xt, tensor_amax=tensor_amax, generator=generator,
            pack_x=pack_x, pack_xt=pack_xt, stats=stats,
        )  # fmt: skip
    if op_xt.hadamard:
        raise ValueError(
            "quantize_operand_pair does not apply the Hadamard transform; quantize X^T separately"
        )
    pad = -x_TK.shape[0] % 16
    xt_KTp = torch.nn.functional.pad(x_TK, (0, 0, 0, pad)).t() if pad else x_TK.t()
    first = quantize_operand(
        x_TK, op_x, tensor_amax=tensor_amax, generator=generator, pack=pack_x, stats=stats
    )
    second = quantize_operand(
        xt_KTp, op_xt, tensor_amax=tensor_amax, generator=generator, pack=pack_xt, stats=stats
    )
    return first, second


def gemm_hardware(a_q, b_q, *, b_transposed: bool = False, lattice_snap: bool = False) -> torch.Tensor:
    """float32 ``A @ B^T`` under the probe-matched hardware model: the Triton kernel on CUDA
    (operands need packed codes), else the vectorized PyTorch twin (same numerics)."""
    from .hardware_gemm import hardware_gemm_torch, triton_hardware_gemm

    device_tensor = getattr(a_q, "codes", None)
    if device_tensor is None:
        device_tensor = a_q.packed.codes if getattr(a_q, "packed", None) is not None else a_q.tensor_scale
    has_codes = all(hasattr(q, "codes") or getattr(q, "packed", None) is not None for q in (a_q, b_q))
    if _use_triton_for(device_tensor) and has_codes:
        return triton_hardware_gemm(a_q, b_q, b_transposed=b_transposed, lattice_snap=lattice_snap)
    return hardware_gemm_torch(a_q, b_q, b_transposed=b_transposed, lattice_snap=lattice_snap)
