"""Triton quantization of QuantLinear's GEMM operands, returning QuantizedBlocks as every quantizer does.

:func:`triton_quantize_operand` is a drop-in for :func:`nemofp4.kernels.program.quantize_operand`
(same arguments, same :class:`~nemofp4.formats.QuantizedBlocks`, bitwise equal for RNE), and
:func:`triton_quantize_operand_pair` quantizes X for fprop and X^T for wgrad (blocks along the
tokens) in one launch.

Stochastic rounding takes its Philox seed from the operand's torch generator with one draw on
the generator's device (no host synchronization), so a generator reseeded per step by
``set_step`` gives the same bits on a rerun, as the PyTorch path does (the bits themselves
differ from that path's).
"""

from __future__ import annotations

import dataclasses

import torch

from nemofp4.formats import BlockSpec, QuantizedBlocks
from nemofp4.formats.spec import BLOCK_STATS

from .quantize import triton_quantize
from .request import TOKEN_MULTIPLE, check_values

__all__ = ["triton_quantize_operand", "triton_quantize_operand_pair"]


def triton_quantize_operand(
    x: torch.Tensor,
    op: BlockSpec,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    two_d: bool | None = None,
    pack: bool = False,
    values: bool = True,
    stats: bool = True,
) -> QuantizedBlocks:
    """Same contract as ``nemofp4.kernels.program.quantize_operand`` (2-D ``x``, a ``BlockSpec``)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_operand takes a 2-D tensor, got shape {tuple(x.shape)}")
    spec = op if two_d is None or two_d == op.two_d else dataclasses.replace(op, two_d=two_d)
    check_values(pack, values)
    seed = _seed(op.rounding, generator, x.device)
    scaled_dtype = torch.float32 if values else None  # the packed form alone: no values written
    rows, _ = triton_quantize(x, spec, tensor_amax=tensor_amax, seed=seed, scaled_dtype=scaled_dtype, stats=stats)
    return _block_operand(rows, tuple(x.shape), pack, values, stats)


def triton_quantize_operand_pair(
    x_TK: torch.Tensor,
    op_x: BlockSpec,
    op_xt: BlockSpec,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    pack_x: bool = False,
    pack_xt: bool = True,
    values_xt: bool = True,
    stats: bool = True,
) -> tuple[QuantizedBlocks, QuantizedBlocks]:
    """(X quantized along K as ``op_x`` says, X^T [K, Tp] quantized along the tokens as ``op_xt``
    says) from one read of ``x_TK``: what QuantLinear's forward computes as ``quantize(Role.X,
    x_TK)`` and ``quantize(Role.X_WGRAD, pad_tokens(x_TK).t(), pack=True)``, bitwise (RNE).

    Both share one tensor reference (the ``x`` reference of the recipe) and must agree on the
    scale format, block size and rounding; a Hadamard transform on X^T cannot be fused here.
    """
    if x_TK.dim() != 2:
        raise ValueError(f"x_TK must be 2-D [tokens, features], got shape {tuple(x_TK.shape)}")
    if not op_x.blocks_like(op_xt):
        raise ValueError(
            f"X and X^T quantizations must share scale_format, block_size and rounding to fuse: {op_x} vs {op_xt}; "
            "quantize them separately"
        )
    if op_x.two_d or op_xt.two_d or op_x.hadamard or op_xt.hadamard:
        raise ValueError("fused X/X^T quantization supports 1-D blocks without a Hadamard transform only")
    check_values(pack_xt, values_xt)
    tokens, features = x_TK.shape
    seed = _seed(op_x.rounding, generator, x_TK.device)
    rows, cols = triton_quantize(
        x_TK,
        op_x,
        tensor_amax=tensor_amax,
        seed=seed,
        transposed=True,
        transposed_scale_target=op_xt.scale_target,
        scaled_dtype=torch.float32,
        stats=stats,
    )
    padded_tokens = tokens + (-tokens % TOKEN_MULTIPLE)
    return (
        _block_operand(rows, (tokens, features), pack_x, True, stats),
        _block_operand(cols, (features, padded_tokens), pack_xt, values_xt, stats),
    )


def _seed(rounding: str, generator: torch.Generator | None, device: torch.device) -> int | torch.Tensor:
    if rounding == "rne":
        return 0
    return torch.randint(
        -(2**63),
        2**63 - 1,
        (1,),
        generator=generator,
        device=device if generator is None else generator.device,
        dtype=torch.int64,
    ).to(device)


def _block_operand(
    q: QuantizedBlocks, shape: tuple[int, int], pack: bool, values: bool, stats: bool
) -> QuantizedBlocks:
    """``q`` as the torch program returns it: the operand's own (unpadded-token) shape, packed
    codes only when asked for, the scaled values unless ``values`` is False (the fused pair's kernel
    writes X^T's anyway), and the three block counts (a test compares the two)."""
    counts = {name: q.counts[name] for name in BLOCK_STATS} if stats else {}
    codes = q.codes if pack else None  # the block-scale codes stay: NVFP4's dequantize reads them
    scaled = q.scaled if values else None
    return dataclasses.replace(
        q, shape=shape, padded_shape=tuple(q.padded_shape), counts=counts, codes=codes, scaled=scaled
    )
