"""Transformer Engine's linears, for plans made where TE is not installed: what ``te.Linear`` under each
of TE's recipes (``NVFP4BlockScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``) quantizes,
keeps for backward and computes, and a stand-in that allocates exactly that on fake tensors (as
:mod:`nemofp4.planning.standins` does for mamba_ssm).

Read from Transformer Engine's sources (github.com/NVIDIA/TransformerEngine, main, commit d0067d0):

* ``te.Linear`` (``pytorch/module/linear.py``, ``_Linear``'s forward and backward), the same for every
  recipe: forward quantizes X row-wise (fprop) and column-wise (wgrad), drops the row-wise copy and
  saves the column-wise one; under FSDP2 (``is_fsdp2``, our trainer's backend) the weight is quantized
  row-wise only, not saved, and quantized again in backward, both copies, from the re-gathered weight
  (row-wise for fprop, column-wise for dgrad); dY is quantized once for both backward GEMMs (row-wise
  for dgrad, column-wise for wgrad). Its GEMMs output the activation dtype.
* NVFP4 (``common/recipe/__init__.py``, ``NVFP4BlockScaling.__post_init__``): X and dY get the 16-point
  random Hadamard transform (RHT) unless ``disable_rht``, on their column-wise copy only ("RHT is
  currently only applied to column-wise usage"); the weight gets 16x16 2-D scaling and no RHT; dY is
  stochastically rounded. The quantizer (``pytorch/csrc/quantizer.cpp``, ``NVFP4Quantizer::quantize_impl``):
  an amax pass over the BF16 tensor (with RHT ``nvte_hadamard_transform_amax``: the tensor's amax and
  that of its transformed transpose in one read), then one cast pass writing the copies asked for. With
  RHT the cast is fused with the transform (``nvte_quantize_with_hadamard_transform``, on the tensor
  cores) when the tensor is BF16 with rows % 64 == 0 and cols % 128 == 0
  (``is_eligible_for_rht_cast_fusion``); otherwise the transform of the transpose is written out in BF16
  and quantized from there (``quantize_with_rht_unfused_helper``). Storage (``pytorch/tensor/nvfp4_tensor.py``,
  ``get_scale_shape``): two E2M1 codes per byte, the column-wise copy transposed; E4M3 scales of an
  [M, K] copy padded to [round_up(M, 128), round_up(ceil(K / 16), 4)], 2-D weight tiles included (a
  scale per row and 16 columns); an FP32 amax per copy.
* Per-tensor FP8 (``Float8CurrentScalingQuantizer::quantize_impl``): an amax pass
  (``nvte_compute_amax_with_config``), the scale from it (``nvte_compute_scale_from_amax``), then one
  cast pass (``nvte_quantize_v2``) writing the row-wise FP8 data and, for column-wise usage, its
  transpose with the same scale. Storage (``Float8CurrentScalingQuantizer::create_tensor``): one byte
  per element and one FP32 ``scale_inv`` per tensor; the transpose exists only where FP8 GEMMs are
  TN-only (``with_transpose = columnwise_usage && !nvte_is_non_tn_fp8_gemm_supported()``: Hopper,
  Ada); on Blackwell (SM 10.x, 13.x: ``common/transformer_engine.cpp``) the one row-wise copy serves
  both GEMMs (``pytorch/tensor/storage/float8_tensor_storage.py``, ``update_usage``). The stand-in
  allocates Hopper's copies (the saved bytes are the same on both); the cost model skips the
  transpose's write on a device without that restriction.
* MXFP8 (``MXFP8Quantizer::quantize``): no amax pass; one cast (``nvte_quantize_v2``; both directions
  in one kernel, ``common/cast/mxfp8/quantize_mxfp8.cuh``) computes each 32-element block's E8M0
  scale and writes the row-wise and column-wise copies, each quantized from the BF16 tensor along its
  own dim. Storage (``MXFP8Quantizer::create_tensor``, ``get_scale_shape``): both copies keep the
  tensor's [M, K] layout, one byte per element; E8M0 scales [round_up(M, 128), round_up(K / 32, 4)]
  row-wise and [round_up(M / 32, 4), round_up(K, 128)] column-wise; no amax.

Roles are the emulated recipes' (:class:`nemofp4.quant.Role`); a test holds the operands to the
emulated ``nvfp4``, ``fp8`` and ``mxfp8`` recipes' (same roles, shapes and sizes).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from nemofp4.quant import TELinear

__all__ = [
    "HADAMARD_FLOPS_PER_ELEMENT",
    "TE_STORAGE",
    "TELinearStandIn",
    "TEOperand",
    "TEPass",
    "TEQuantization",
    "TEStorage",
    "te_linear_operands",
    "te_linear_standins",
    "te_quantizations",
]

BLOCK = 16
HADAMARD_FLOPS_PER_ELEMENT = 2 * BLOCK
"""The 16-point transform as a 16x16 matrix product on every 16 elements (TE runs it as an MMA)."""
_BF16 = 2


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class TEStorage:
    """How one TE recipe stores and makes a quantized copy (see the module docstring)."""

    recipe: str
    """TE's recipe class (:data:`nemofp4.quant.TE_RECIPES`)."""
    codes_per_byte: int
    """2 for E2M1, 1 for FP8."""
    block: int
    """Elements per scale along the GEMM's reduction dim; 0: one scale for the tensor."""
    scalar_bytes: int
    """FP32 scalars each copy keeps: NVFP4's amax, per-tensor FP8's ``scale_inv`` (one per tensor,
    which its two copies share: counted with each), none for MXFP8."""
    amax_pass: bool
    """A pass over the BF16 tensor for its amax before the cast."""
    columnwise_transposed: bool
    """A column-wise copy is stored transposed (NVFP4, per-tensor FP8) or in the tensor's layout (MXFP8)."""
    transpose_if_tn_only: bool = False
    """The column-wise copy exists only on GPUs whose FP8 GEMMs are TN-only (per-tensor FP8)."""


TE_STORAGE: dict[str, TEStorage] = {
    s.recipe: s
    for s in (
        TEStorage(
            recipe="NVFP4BlockScaling",
            codes_per_byte=2,
            block=16,
            scalar_bytes=4,
            amax_pass=True,
            columnwise_transposed=True,
        ),
        TEStorage(
            recipe="Float8CurrentScaling",
            codes_per_byte=1,
            block=0,
            scalar_bytes=4,
            amax_pass=True,
            columnwise_transposed=True,
            transpose_if_tn_only=True,
        ),
        TEStorage(
            recipe="MXFP8BlockScaling",
            codes_per_byte=1,
            block=32,
            scalar_bytes=0,
            amax_pass=False,
            columnwise_transposed=False,
        ),
    )
}


@dataclass(frozen=True, kw_only=True)
class TEOperand:
    """One quantized copy a TE linear makes: ``shape`` as its GEMM reads it, scales along the last dim
    (the GEMM's reduction)."""

    role: str
    """The emulated recipe's :class:`~nemofp4.quant.Role` value ('x', 'w', 'dy_dgrad', 'dy_wgrad', 'x_wgrad')."""
    gemm: str
    """'fprop', 'dgrad' or 'wgrad'."""
    shape: tuple[int, int]
    storage: TEStorage
    columnwise: bool = False
    """Quantized along the stored tensor's first dim (TE's column-wise usage: W^T, dY^T, X^T)."""
    hadamard: bool = False
    stochastic: bool = False
    two_d: bool = False
    saved: bool = False
    """Kept from forward to backward."""

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def code_bytes(self) -> int:
        return self.numel // self.storage.codes_per_byte

    @property
    def blocks(self) -> int:
        """Block scales before padding: one per row and block of columns (2-D tiles repeat theirs per
        row); 0 for per-tensor scaling."""
        block = self.storage.block
        return self.shape[0] * math.ceil(self.shape[1] / block) if block else 0

    @property
    def scale_shape(self) -> tuple[int, int] | None:
        """The padded block scales as the GEMM reads them; None for per-tensor scaling."""
        block = self.storage.block
        return (_round_up(self.shape[0], 128), _round_up(math.ceil(self.shape[1] / block), 4)) if block else None

    @property
    def in_place(self) -> bool:
        """A column-wise copy kept in the tensor's layout (MXFP8), not transposed."""
        return self.columnwise and not self.storage.columnwise_transposed

    @property
    def stored_shape(self) -> tuple[int, int]:
        """The codes' logical shape in memory (elements, not bytes)."""
        return tuple(reversed(self.shape)) if self.in_place else self.shape

    @property
    def stored_scale_shape(self) -> tuple[int, int] | None:
        scale = self.scale_shape
        return tuple(reversed(scale)) if scale and self.in_place else scale

    @property
    def tn_only(self) -> bool:
        """Made only on GPUs whose FP8 GEMMs are TN-only (per-tensor FP8's transpose, on Hopper)."""
        return self.columnwise and self.storage.transpose_if_tn_only

    @property
    def nbytes(self) -> int:
        """Codes, padded scales and the FP32 scalars."""
        scale = self.scale_shape
        return self.code_bytes + (math.prod(scale) if scale else 0) + self.storage.scalar_bytes


def _flags(part) -> tuple[bool, bool, bool]:
    """(RHT on the wgrad copies, stochastic rounding on dY, 16x16 weight tiles) of a TE part: NVFP4's
    flags; TE's FP8 recipes have none of the three."""
    if part.te_recipe != "NVFP4BlockScaling":
        return False, False, False
    return not part.disable_rht, not part.disable_stochastic_rounding, not part.disable_2d_quantization


def te_linear_operands(tokens: int, in_features: int, out_features: int, part) -> tuple[TEOperand, ...]:
    """The six quantized copies of one ``te.Linear`` call on ``tokens`` tokens (W serves fprop and
    dgrad), under ``part`` (a :class:`~nemofp4.recipes.TransformerEngineNVFP4` or
    :class:`~nemofp4.recipes.TransformerEngineFP8`)."""
    t, k, n = tokens, in_features, out_features
    rht, sr, two_d = _flags(part)
    s = TE_STORAGE[part.te_recipe]
    return (
        TEOperand(role="x", gemm="fprop", shape=(t, k), storage=s),
        TEOperand(role="w", gemm="fprop", shape=(n, k), storage=s, two_d=two_d),
        TEOperand(role="dy_dgrad", gemm="dgrad", shape=(t, n), storage=s, stochastic=sr),
        TEOperand(role="w", gemm="dgrad", shape=(k, n), storage=s, columnwise=True, two_d=two_d),
        TEOperand(role="dy_wgrad", gemm="wgrad", shape=(n, t), storage=s, columnwise=True, hadamard=rht, stochastic=sr),
        TEOperand(role="x_wgrad", gemm="wgrad", shape=(k, t), storage=s, columnwise=True, hadamard=rht, saved=True),
    )


class TEPass(NamedTuple):
    """One pass over memory of a TE quantizer call, charged to the role it serves."""

    role: str
    nbytes: float
    """HBM bytes read or written."""
    hadamard_flops: float
    hadamard_only: bool
    """The pass exists only for the transform."""
    tn_only: bool = False
    """The write of per-tensor FP8's transpose, made only on GPUs whose FP8 GEMMs are TN-only."""
    launches: int = 0
    """Kernels the pass starts: the amax pass, the unfused transform and the cast one each; a copy's write, made
    by the cast's kernel, none."""


@dataclass(frozen=True, kw_only=True)
class TEQuantization:
    """One call of a TE quantizer on a BF16 tensor: its amax pass (where the recipe has one) and its cast."""

    source: str
    """'x', 'w' or 'dy': the BF16 tensor read."""
    phase: str
    """'forward' (repeated by activation checkpointing's recompute) or 'backward'."""
    shape: tuple[int, int]
    """The BF16 tensor as stored: token-major X [T, K] and dY [T, N], the weight [N, K]."""
    copies: tuple[TEOperand, ...]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def hadamard(self) -> bool:
        return any(c.hadamard for c in self.copies)

    @property
    def fused(self) -> bool:
        """The RHT is fused with the cast (``is_eligible_for_rht_cast_fusion``, BF16 assumed)."""
        return self.shape[0] % 64 == 0 and self.shape[1] % 128 == 0

    def passes(self) -> tuple[TEPass, ...]:
        """Each pass over memory, charged to the role it serves: the amax pass and the cast's read to the
        first copy's role (the amax to the transformed copy's when it is the transform's amax), each
        copy's write to its own, the transform (its FLOPs, and the unfused path's BF16 round trip) to the
        transformed copy's."""
        first = self.copies[0].role
        read = self.numel * _BF16
        rht = next((c for c in self.copies if c.hadamard), None)
        flops = self.numel * HADAMARD_FLOPS_PER_ELEMENT if rht else 0.0
        out = []
        if self.copies[0].storage.amax_pass:  # with the RHT, the post-RHT amax in the same read
            out.append(TEPass(first if rht is None else rht.role, read, flops, False, launches=1))
        if rht is not None and not self.fused:
            # the transpose's transform written out in BF16 (input read again) and read back by the cast
            out.append(TEPass(rht.role, 3 * read, flops, True, launches=1))
            flops = 0.0
        out.append(TEPass(first, read, 0.0, False, launches=1))  # the cast's read
        out += [TEPass(c.role, c.nbytes, flops if c is rht else 0.0, False, c.tn_only) for c in self.copies]
        return tuple(out)


def te_quantizations(tokens: int, in_features: int, out_features: int, part) -> tuple[TEQuantization, ...]:
    """The quantizer calls of one ``te.Linear`` forward and backward under FSDP2 (see the module
    docstring): X (both copies) and W (row-wise) in forward; W again (both copies) and dY in backward."""
    x, w, dy_dgrad, wt, dy_wgrad, xt = te_linear_operands(tokens, in_features, out_features, part)
    return (
        TEQuantization(source="x", phase="forward", shape=(tokens, in_features), copies=(x, xt)),
        TEQuantization(source="w", phase="forward", shape=(out_features, in_features), copies=(w,)),
        TEQuantization(source="w", phase="backward", shape=(out_features, in_features), copies=(w, wt)),
        TEQuantization(source="dy", phase="backward", shape=(tokens, out_features), copies=(dy_dgrad, dy_wgrad)),
    )


# ------------------------------------------------------------------------------------ the stand-in
def _copy(op: TEOperand, device) -> tuple[torch.Tensor, ...]:
    """The storage of one copy: codes, padded block scales (a byte each), the FP32 scalars."""
    rows, cols = op.stored_shape
    out = [torch.empty(rows, cols // op.storage.codes_per_byte, dtype=torch.uint8, device=device)]
    if op.stored_scale_shape:
        out.append(torch.empty(op.stored_scale_shape, dtype=torch.uint8, device=device))
    out += [torch.empty(1, dtype=torch.float32, device=device) for _ in range(op.storage.scalar_bytes // 4)]
    return tuple(out)


def _transform_buffer(q: TEQuantization, device) -> torch.Tensor | None:
    """The unfused RHT's BF16 transform of the transpose (``allocateTorchTensor(cols, rows)``)."""
    if q.hadamard and not q.fused:
        return torch.empty(q.shape[1], q.shape[0], dtype=torch.bfloat16, device=device)
    return None


class _TELinearStandIn(torch.autograd.Function):
    """``te.Linear`` forward and backward under a TE recipe and FSDP2, by allocation only."""

    @staticmethod
    def forward(ctx, x, weight, bias, part, dtype):
        tokens = x.numel() // x.shape[-1]
        out_features, in_features = weight.shape
        qx, qw, _, _ = te_quantizations(tokens, in_features, out_features, part)
        buffer = _transform_buffer(qx, x.device)
        x_rowwise, x_columnwise = (_copy(op, x.device) for op in qx.copies)
        del buffer
        w_rowwise = _copy(qw.copies[0], x.device)
        out = torch.empty(*x.shape[:-1], out_features, dtype=dtype, device=x.device)
        del x_rowwise, w_rowwise  # the row-wise X is discarded once fprop is done; W is not saved under FSDP2
        ctx.save_for_backward(*x_columnwise, weight)
        ctx.part, ctx.dtype, ctx.x_shape, ctx.has_bias = part, dtype, x.shape, bias is not None
        return out

    @staticmethod
    def backward(ctx, dy):
        *x_columnwise, weight = ctx.saved_tensors
        out_features, in_features = weight.shape
        tokens = dy.numel() // out_features
        _, _, qw, qdy = te_quantizations(tokens, in_features, out_features, ctx.part)
        w_copies = [_copy(op, dy.device) for op in qw.copies]
        buffer = _transform_buffer(qdy, dy.device)
        dy_copies = [_copy(op, dy.device) for op in qdy.copies]
        del buffer
        dx = torch.empty(ctx.x_shape, dtype=ctx.dtype, device=dy.device)
        del w_copies
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=dy.device)
        db = torch.empty(out_features, dtype=weight.dtype, device=dy.device) if ctx.has_bias else None
        del dy_copies, x_columnwise
        return dx, dw, db, None, None


class TELinearStandIn(TELinear):
    """A ``te.Linear`` of the recipe's part for plans: the same parameter objects, the stand-in's
    allocations (values are empty: for FakeTensorMode only)."""

    def __init__(self, linear: nn.Linear, part) -> None:
        super().__init__()
        self.in_features, self.out_features, self.part = linear.in_features, linear.out_features, part
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        return _TELinearStandIn.apply(x, self.weight, self.bias, self.part, dtype)


@contextlib.contextmanager
def te_linear_standins(enabled: bool = True):
    """Inside: ``apply_recipe`` turns a Transformer Engine part's linears into :class:`TELinearStandIn`
    and does not ask for TE (planning on fake tensors needs neither TE nor its GPU)."""
    if not enabled:
        yield
        return
    from nemofp4.recipes import apply as recipe_apply

    saved = recipe_apply.transformer_engine_status, TELinear.__dict__["from_linear"]
    recipe_apply.transformer_engine_status = lambda part=None: (True, "")
    TELinear.from_linear = staticmethod(TELinearStandIn)
    try:
        yield
    finally:
        recipe_apply.transformer_engine_status = saved[0]
        TELinear.from_linear = saved[1]
