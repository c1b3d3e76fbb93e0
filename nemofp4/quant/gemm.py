"""GEMMs on block-quantized operands: the fast scaled path, the decoded path, a float64 reference.

Both operands are ``[rows, K]`` with blocks along K (the reduction dim); the product is
``A @ B^T``. A quantized operand is ``value * block_scale * tensor_scale`` where the first
product (an E2M1 value times a decoded scale code) has at most 2 + 4 significant bits, so it
is exact in BF16 and in float32.

``scaled``   (default) multiplies the block-scaled operands (exact in the compute dtype) with
             FP32 accumulation and applies the tensor-scale product once, after the product, as
             each source computes it from the two amaxes (TE's ``fl(g_a g_b) * fl(1/(36 * 448^2))``
             for NVFP4, the paper's ``_encoded_global_alpha`` for UE5M3;
             :func:`nemofp4.formats.tensor_scale_product`): the emulation runs at the speed of an
             ordinary BF16 (GPU) or FP32 (CPU) GEMM.
``decoded``  multiplies the fully dequantized FP32 operands in FP32 (the UE5M3 paper's
             "decoded-Torch" control).
``reference_gemm`` is the slow, obviously-correct float64 product of the same operands that
the tests hold both paths against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemofp4 import kernels
from nemofp4.formats import QuantizedBlocks, tensor_scale_product

__all__ = ["GemmOperand", "decoded_gemm", "gemm", "reference_gemm", "scaled_gemm"]


@dataclass(frozen=True)
class GemmOperand:
    """A quantized 2-D operand ``[rows, K]``, blocks along K.

    ``transposed=True`` reads a 16x16-tiled tensor ``[K, rows]`` as its transpose: square tiles
    make the quantization of W^T exactly the transpose of the quantization of W, so the dgrad
    GEMM reuses the fprop weight without quantizing it again.
    """

    q: QuantizedBlocks
    transposed: bool = False

    def __post_init__(self) -> None:
        assert len(self.q.shape) == 2, self.q.shape
        assert not self.transposed or self.q.two_d, "only 2-D tiles can be read transposed"

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return (cols, rows) if self.transposed else (rows, cols)

    @property
    def tensor_scale(self) -> torch.Tensor:
        return self.q.tensor_scale

    def scaled(self) -> torch.Tensor:
        """FP4 values x block scales, float32, padded: exact and exactly representable in BF16."""
        s = self.q.scaled_values()
        return s.t() if self.transposed else s

    def dequantized(self) -> torch.Tensor:
        """Fully dequantized float32 operand, unpadded."""
        d = self.q.dequantize()
        return d.t() if self.transposed else d

    def dequantized_f64(self) -> torch.Tensor:
        """float64 dequantized operand, unpadded: the exact product of its three factors."""
        rows, cols = self.q.shape
        full = self.q.scaled_values().double()[:rows, :cols] * self.q.tensor_scale.double()
        return full.t() if self.transposed else full


def _common_k(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the reduction dim of the shorter operand (operands padded to different blocks)."""
    ka, kb = a.shape[1], b.shape[1]
    if ka < kb:
        a = F.pad(a, (0, kb - ka))
    elif kb < ka:
        b = F.pad(b, (0, ka - kb))
    return a, b


def scaled_gemm(a: GemmOperand, b: GemmOperand, compute_dtype: torch.dtype) -> torch.Tensor:
    """``A @ B^T`` in float32 from block-scaled operands, the tensor-scale product applied after it."""
    m, n = a.shape[0], b.shape[0]
    a_s, b_s = _common_k(a.scaled()[:m], b.scaled()[:n])
    if compute_dtype == torch.bfloat16 and a_s.is_cuda:
        # Exact BF16 operands, FP32 accumulation and FP32 output (one rounding of each sum).
        acc = torch.mm(a_s.to(torch.bfloat16), b_s.to(torch.bfloat16).t(), out_dtype=torch.float32)
    else:
        acc = a_s @ b_s.t()
    return acc.mul_(tensor_scale_product(a.q, b.q).to(acc.device))  # in place: acc is fresh (one page-fault pass fewer)


def decoded_gemm(a: GemmOperand, b: GemmOperand) -> torch.Tensor:
    """``A @ B^T`` from fully dequantized float32 operands, in float32."""
    return a.dequantized() @ b.dequantized().t()


def gemm(
    a: GemmOperand, b: GemmOperand, *, mode: str, compute_dtype: torch.dtype, backend: kernels.Backend | None = None
) -> torch.Tensor:
    """Dispatch on the recipe's GEMM mode; returns float32 ``[a.rows, b.rows]``.

    ``hardware`` is the UE5M3 paper's probe-matched model of a native FP4 GEMM (64-product
    groups, round-toward-zero accumulation, then the final snap to the 1/1024 lattice that its
    ``probe_matched_fp4_gemm`` applies with ``snap_to_1_over_1024=True``), from
    :mod:`nemofp4.kernels`: a Triton kernel on CUDA, its PyTorch twin elsewhere (``backend``: the
    module's resolved kernels; None: those of 'auto' for the operands' device).
    """
    if mode == "scaled":
        return scaled_gemm(a, b, compute_dtype)
    if mode == "decoded":
        return decoded_gemm(a, b)
    if mode == "hardware":
        assert not a.transposed
        backend = backend or kernels.backend_for("auto", a.q.tensor_scale.device)
        return backend.gemm_hardware(a.q, b.q, b_transposed=b.transposed, lattice_snap=True)
    raise ValueError(f"unknown gemm mode {mode!r}; valid modes are 'scaled', 'decoded' and 'hardware'")


def reference_gemm(a: GemmOperand, b: GemmOperand) -> torch.Tensor:
    """float64 ``A @ B^T`` of the dequantized operands (the test oracle for both paths)."""
    return a.dequantized_f64() @ b.dequantized_f64().t()
