"""Transformer Engine's NVFP4 linear, for plans made where TE is not installed: what ``te.Linear``
under ``NVFP4BlockScaling`` quantizes, keeps for backward and computes, and a stand-in that
allocates exactly that on fake tensors (as :mod:`nemofp4.planning.standins` does for mamba_ssm).

Read from Transformer Engine's sources (github.com/NVIDIA/TransformerEngine, main, commit d0067d0):

* the recipe (``common/recipe/__init__.py``, ``NVFP4BlockScaling.__post_init__``): the input X and
  the output gradient dY get the 16-point random Hadamard transform (RHT) unless ``disable_rht``,
  and only on their column-wise copy, the wgrad operand ("RHT is currently only applied to
  column-wise usage"); the weight gets 16x16 2-D scaling and no RHT; dY is stochastically rounded;
* the quantizer (``pytorch/csrc/quantizer.cpp``, ``NVFP4Quantizer::quantize_impl``): an amax pass
  over the BF16 tensor (with RHT ``nvte_hadamard_transform_amax``: the tensor's amax and that of its
  transformed transpose in one read), then one cast pass writing the row-wise and column-wise FP4
  copies asked for. With RHT the cast is fused with the transform
  (``nvte_quantize_with_hadamard_transform``, on the tensor cores) when the tensor is BF16 with
  rows % 64 == 0 and cols % 128 == 0 (``is_eligible_for_rht_cast_fusion``); otherwise the
  transform of the transpose is written out in BF16 and quantized from there
  (``quantize_with_rht_unfused_helper``);
* the storage (``pytorch/tensor/nvfp4_tensor.py``, ``get_scale_shape``): two E2M1 codes per byte;
  E4M3 scales of an [M, K] copy padded to [round_up(M, 128), round_up(ceil(K / 16), 4)], 2-D weight
  tiles included (a scale per row and 16 columns); an FP32 amax per copy;
* ``te.Linear`` (``pytorch/module/linear.py``): forward quantizes X row-wise and column-wise, drops
  the row-wise copy and saves the column-wise one for wgrad; under FSDP2 (``is_fsdp2``, our trainer's
  backend) the weight is quantized row-wise only, not saved, and quantized again in backward, both
  copies, from the re-gathered weight; dY is quantized once for both backward GEMMs (row-wise for
  dgrad, column-wise for wgrad). Its GEMMs output the activation dtype.

Roles are the emulated recipe's (:class:`nemofp4.quant.Role`); a test holds the operands to the
emulated ``nvfp4`` recipe's (same roles, shapes and packed sizes).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from nemofp4.quant import TENVFP4Linear

__all__ = ["TELinearStandIn", "TEOperand", "TEQuantization", "te_linear_operands", "te_linear_standins",
           "te_quantizations"]

BLOCK = 16
HADAMARD_FLOPS_PER_ELEMENT = 2 * BLOCK
"""The 16-point transform as a 16x16 matrix product on every 16 elements (TE runs it as an MMA)."""
_BF16 = 2


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class TEOperand:
    """One FP4 copy a TE NVFP4 linear makes: ``shape`` as its GEMM reads it, blocks of 16 along the
    last dim (the GEMM's reduction)."""

    role: str
    """The emulated recipe's :class:`~nemofp4.quant.Role` value ('x', 'w', 'dy_dgrad', 'dy_wgrad', 'x_wgrad')."""
    gemm: str
    """'fprop', 'dgrad' or 'wgrad'."""
    shape: tuple[int, int]
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
        return self.numel // 2

    @property
    def blocks(self) -> int:
        """E4M3 scales before padding: one per row and 16 columns (2-D tiles repeat theirs per row)."""
        return self.shape[0] * math.ceil(self.shape[1] / BLOCK)

    @property
    def scale_shape(self) -> tuple[int, int]:
        return _round_up(self.shape[0], 128), _round_up(math.ceil(self.shape[1] / BLOCK), 4)

    @property
    def nbytes(self) -> int:
        """Codes, padded scales and the FP32 amax."""
        return self.code_bytes + math.prod(self.scale_shape) + 4


def te_linear_operands(tokens: int, in_features: int, out_features: int, part) -> tuple[TEOperand, ...]:
    """The six FP4 copies of one ``te.Linear`` call on ``tokens`` tokens (W serves fprop and dgrad),
    under ``part`` (a :class:`~nemofp4.recipes.TransformerEngineNVFP4`)."""
    t, k, n = tokens, in_features, out_features
    rht, sr, two_d = not part.disable_rht, not part.disable_stochastic_rounding, not part.disable_2d_quantization
    return (
        TEOperand(role="x", gemm="fprop", shape=(t, k)),
        TEOperand(role="w", gemm="fprop", shape=(n, k), two_d=two_d),
        TEOperand(role="dy_dgrad", gemm="dgrad", shape=(t, n), stochastic=sr),
        TEOperand(role="w", gemm="dgrad", shape=(k, n), two_d=two_d),
        TEOperand(role="dy_wgrad", gemm="wgrad", shape=(n, t), hadamard=rht, stochastic=sr),
        TEOperand(role="x_wgrad", gemm="wgrad", shape=(k, t), hadamard=rht, saved=True),
    )


@dataclass(frozen=True, kw_only=True)
class TEQuantization:
    """One call of TE's NVFP4 quantizer on a BF16 tensor: its amax pass and its cast pass."""

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

    def passes(self) -> tuple[tuple[str, float, float, bool], ...]:
        """(role, HBM bytes, Hadamard FLOPs, only for the transform) of each pass over memory, charged
        to the role it serves: the amax pass and the cast's read to the first copy's role (the amax
        to the transformed copy's when it is the transform's amax), each copy's write to its own, the
        transform (its FLOPs, and the unfused path's BF16 round trip) to the transformed copy's."""
        first = self.copies[0].role
        read = self.numel * _BF16
        rht = next((c for c in self.copies if c.hadamard), None)
        flops = self.numel * HADAMARD_FLOPS_PER_ELEMENT if rht else 0.0
        out = [(first if rht is None else rht.role, read, flops, False)]  # the amax pass (post-RHT amax in the same read)
        if rht is not None and not self.fused:
            # the transpose's transform written out in BF16 (input read again) and read back by the cast
            out.append((rht.role, 3 * read, flops, True))
            flops = 0.0
        out.append((first, read, 0.0, False))  # the cast's read
        out += [(c.role, c.nbytes, flops if c is rht else 0.0, False) for c in self.copies]
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
    """The storage of one FP4 copy: codes, padded E4M3 scales, the FP32 amax."""
    rows, cols = op.shape
    return (torch.empty(rows, cols // 2, dtype=torch.uint8, device=device),
            torch.empty(op.scale_shape, dtype=torch.uint8, device=device),
            torch.empty(1, dtype=torch.float32, device=device))  # fmt: skip


def _transform_buffer(q: TEQuantization, device) -> torch.Tensor | None:
    """The unfused RHT's BF16 transform of the transpose (``allocateTorchTensor(cols, rows)``)."""
    if q.hadamard and not q.fused:
        return torch.empty(q.shape[1], q.shape[0], dtype=torch.bfloat16, device=device)
    return None


class _TELinearStandIn(torch.autograd.Function):
    """``te.Linear`` forward and backward under ``NVFP4BlockScaling`` and FSDP2, by allocation only."""

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


class TELinearStandIn(TENVFP4Linear):
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

    saved = recipe_apply.transformer_engine_status, TENVFP4Linear.__dict__["from_linear"]
    recipe_apply.transformer_engine_status = lambda part=None: (True, "")
    TENVFP4Linear.from_linear = staticmethod(TELinearStandIn)
    try:
        yield
    finally:
        recipe_apply.transformer_engine_status = saved[0]
        TENVFP4Linear.from_linear = saved[1]
