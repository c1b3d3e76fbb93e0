"""The LM head and next-token cross-entropy fused and computed in token chunks.

A 131,072-token vocabulary makes the FP32 logits of one 8192-token micro-batch 4 GiB, and the
plain ``F.cross_entropy(lm_head(h).float(), labels)`` keeps the logits, their log-softmax and
then their gradient alive together. Here the forward pass keeps only each token's log-sum-exp
(4 bytes a token) and the backward pass recomputes one chunk's logits at a time, so at most
``chunk_tokens x vocab`` FP32 logits (and their gradient) exist at once. The cost is one extra
head matmul in backward.

``precision`` (the model's ``head_precision``) chooses the three head GEMMs' arithmetic; the
log-sum-exp, the softmax gradient and the loss are FP32 in every case:

* ``fp32``: true FP32 products (the paper's ``FP32OutputLinear``);
* ``tf32``: FP32 tensors, CUDA may use TF32 tensor cores (10-bit mantissa products, ~8x faster);
* ``bf16``: BF16 operands (hidden states, weight, and in backward the logits' gradient) with FP32
  accumulation and FP32 output, as NVIDIA's recipes keep the head (~16x the FP32 rate on H100).
  On CPU, where BF16 matmul is slow, the same program runs as an FP32 matmul of the BF16-rounded
  operands: products of two BF16 values are exact in FP32, so only the summation order differs.

Used below both training and evaluation; it knows nothing of precision recipes or parallelism.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HEAD_LOSS_METHOD",
    "HEAD_PRECISIONS",
    "check_head_precision",
    "chunked_cross_entropy",
    "head_cross_entropy",
    "head_gemms_in_fp32",
    "head_keeps_fp32_parameters",
    "head_parameter_dtype",
    "lm_loss",
]

DEFAULT_CHUNK_TOKENS = 1024
HEAD_PRECISIONS = ("fp32", "tf32", "bf16")
"""Arithmetic of the LM head's GEMMs (``model.head_precision``); see the module docstring."""
HEAD_LOSS_METHOD = "chunked_cross_entropy"
"""Name of the head method that training.parallel attaches (FSDP-aware) and lm_loss calls."""


def check_head_precision(precision: str, *, what: str = "head_precision") -> str:
    """``precision`` if it is one of :data:`HEAD_PRECISIONS`, else one ValueError naming it."""
    if precision not in HEAD_PRECISIONS:
        raise ValueError(
            f"{what}={precision!r}; valid: {', '.join(HEAD_PRECISIONS)} (fp32: the paper's FP32 head, "
            "tf32: TF32 tensor cores on CUDA, bf16: BF16 GEMMs with FP32 accumulation and loss)"
        )
    return precision


def head_gemms_in_fp32(precision: str) -> bool:
    """Whether the head's GEMMs take FP32 operands (``fp32``, ``tf32``); ``bf16`` rounds them to BF16."""
    return check_head_precision(precision) != "bf16"


def head_keeps_fp32_parameters(precision: str, *, fp32_part: bool) -> bool:
    """Whether the LM head's parameters stay FP32 under mixed precision (FSDP2 gathers them in FP32
    whatever the body's ``param_dtype``): when the recipe makes the head an FP32 part (an
    ``FP32Linear``, ``fp32_part``) and its GEMMs take FP32 operands. A bf16 head rounds its operands
    to BF16 anyway, so it is gathered in the body's dtype; a head the recipe leaves to the body (no
    FP32 part) is the body's. The trainer's FSDP2 policy and the planner's memory and cost all ask this."""
    return fp32_part and head_gemms_in_fp32(precision)


def head_parameter_dtype(precision: str, *, fp32_part: bool, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the LM head's parameters are gathered in when the body's are ``compute_dtype``:
    FP32 where :func:`head_keeps_fp32_parameters`, else ``compute_dtype``."""
    return torch.float32 if head_keeps_fp32_parameters(precision, fp32_part=fp32_part) else compute_dtype


@contextlib.contextmanager
def _head_matmuls(device: torch.device, precision: str):
    """Autocast off (the head's arithmetic is ``precision``'s whatever the body runs in); CUDA's FP32
    matmuls in TF32 only for tf32, strict IEEE FP32 for fp32 whatever the process-wide setting."""
    previous = torch.backends.cuda.matmul.fp32_precision
    if head_gemms_in_fp32(precision):
        torch.backends.cuda.matmul.fp32_precision = "tf32" if precision == "tf32" else "ieee"
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous


def _operand(t: torch.Tensor, precision: str) -> torch.Tensor:
    """A GEMM operand in the head's arithmetic: FP32, or for bf16 the BF16-rounded values (BF16 on CUDA;
    on CPU, where BF16 matmul is slow, the same values held in FP32). A no-op where ``t`` already is one."""
    if head_gemms_in_fp32(precision):
        return t.float()
    t = t.to(torch.bfloat16)
    return t if t.is_cuda else t.float()


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32 ``a @ b`` of two operands from :func:`_operand`: a BF16 pair multiplies with FP32 accumulation
    into an FP32 result (CUDA's BF16 GEMM with ``out_dtype``); FP32 operands in an FP32 GEMM, which for
    BF16-rounded values computes exact products (8-bit x 8-bit significands fit FP32's 24)."""
    if a.dtype == torch.bfloat16:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a @ b


_fused_bf16_addmm: bool | None = None
"""Whether CUDA's ``addmm`` takes an FP32 accumulator with BF16 operands (``out_dtype``); probed at first use."""


def _add_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into the FP32 accumulator ``acc``, for two operands from :func:`_operand`. A BF16 pair
    accumulates in place with ``addmm(out_dtype=float32)`` where this torch's CUDA GEMM takes an FP32
    ``self``; elsewhere the chunk's FP32 product is added, one ``acc``-sized FP32 transient (2 GiB for the
    8B head's weight gradient) and one more pass over it."""
    global _fused_bf16_addmm
    if a.dtype != torch.bfloat16:
        acc.addmm_(a, b)
        return
    if _fused_bf16_addmm is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _fused_bf16_addmm = True
            return
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # an older CUDA kernel wants self in the operands' dtype: checked before it runs
            if _fused_bf16_addmm:
                raise
            _fused_bf16_addmm = False
    acc += _mm(a, b)


def _chunk_logits(
    h_CD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None, precision: str
) -> torch.Tensor:
    """FP32 logits of one chunk; ``weight_VD`` is already the head's operand (:func:`_operand`)."""
    logits_CV = _mm(_operand(h_CD, precision), weight_VD.t())
    return logits_CV if bias_V is None else logits_CV + bias_V.float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over tokens of -log softmax(h W^T + b)[label]; gradients recomputed chunk by chunk."""

    @staticmethod
    def forward(ctx, h_TD, weight_VD, bias_V, labels_T, chunk_tokens, ignore_index, precision):
        lse_T = torch.empty(h_TD.shape[0], dtype=torch.float32, device=h_TD.device)
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        with torch.no_grad(), _head_matmuls(h_TD.device, precision):
            w_VD = _operand(weight_VD, precision)
            for start in range(0, h_TD.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits_CV = _chunk_logits(h_TD[rows], w_VD, bias_V, precision)
                lse_C = torch.logsumexp(logits_CV, dim=-1)
                labels_C = labels_T[rows]
                valid_C = labels_C != ignore_index
                target_C = logits_CV.gather(1, labels_C.clamp(min=0).unsqueeze(1)).squeeze(1)
                total += torch.where(valid_C, lse_C - target_C, 0.0).sum()
                lse_T[rows] = lse_C
                del logits_CV
            del w_VD
        ctx.save_for_backward(h_TD, weight_VD, bias_V, labels_T, lse_T)
        ctx.chunk_tokens, ctx.ignore_index, ctx.precision = chunk_tokens, ignore_index, precision
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_TD, weight_VD, bias_V, labels_T, lse_T = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h_TD = torch.empty(h_TD.shape, dtype=torch.float32, device=h_TD.device) if need_h else None
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if need_w else None
        grad_b_V = torch.zeros(bias_V.shape, dtype=torch.float32, device=bias_V.device) if need_b else None
        precision = ctx.precision
        with _head_matmuls(h_TD.device, precision):
            w_VD = _operand(weight_VD, precision)
            for start in range(0, h_TD.shape[0], ctx.chunk_tokens):
                rows = slice(start, start + ctx.chunk_tokens)
                h_CD = _operand(h_TD[rows], precision)
                labels_C = labels_T[rows]
                valid_C = labels_C != ctx.ignore_index
                # d(lse - logit[label]) / d logits = softmax - onehot, zero for ignored tokens
                grad_CV = _chunk_logits(h_CD, w_VD, bias_V, precision).sub_(lse_T[rows, None]).exp_()
                grad_CV[torch.arange(grad_CV.shape[0], device=grad_CV.device), labels_C.clamp(min=0)] -= 1.0
                grad_CV.mul_((valid_C.float() * grad_total).unsqueeze(1))
                if need_b:
                    grad_b_V += grad_CV.sum(0)
                grad_op_CV = _operand(grad_CV, precision)
                if need_h:
                    grad_h_TD[rows] = _mm(grad_op_CV, w_VD)
                if need_w:
                    _add_mm_(grad_w_VD, grad_op_CV.t(), h_CD)
                del grad_CV, grad_op_CV
        grad_h = grad_h_TD.to(h_TD.dtype) if need_h else None
        grad_w = grad_w_VD.to(weight_VD.dtype) if need_w else None
        grad_b = grad_b_V.to(bias_V.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight_VD: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
    precision: str = "fp32",
    allow_tf32: bool = False,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ weight_VD.T (+ bias_V)`` against ``labels``, in FP32.

    Equal to ``F.cross_entropy((hidden @ weight_VD.T).float().flatten(0, -2), labels.flatten())``
    (the same mean over tokens whose label is not ``ignore_index``) and to its gradients, without
    materialising the full logits: ``hidden`` is ``[..., D]``, ``labels`` the matching ``[...]``.
    ``precision`` is the GEMMs' arithmetic (:data:`HEAD_PRECISIONS`); ``allow_tf32=True`` is the older
    spelling of ``precision="tf32"``.
    """
    check_head_precision(precision, what="precision")
    if allow_tf32:
        if precision == "bf16":
            raise ValueError("allow_tf32=True asks for a TF32 head but precision='bf16'; pass one of them")
        precision = "tf32"
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}; must be a positive number of tokens")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match: "
            "hidden must be labels' shape plus the model width"
        )
    if hidden.shape[-1] != weight_VD.shape[-1]:
        raise ValueError(f"hidden width {hidden.shape[-1]} != head weight's input width {weight_VD.shape[-1]}")
    h_TD, labels_T = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = _ChunkedCrossEntropy.apply(h_TD, weight_VD, bias_V, labels_T, chunk_tokens, ignore_index, precision)
    count = (labels_T != ignore_index).sum()
    return total / count  # nan when every label is ignored, as F.cross_entropy


def head_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """:func:`chunked_cross_entropy` with the weight (and bias) of a linear-like ``head`` module."""
    bias = getattr(head, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) and bias.numel() else None
    return chunked_cross_entropy(hidden, head.weight, labels, bias_V=bias, **kwargs)


def lm_loss(
    model, input_ids: torch.Tensor, labels: torch.Tensor, *, head_chunk_tokens: int = 0, head_precision: str = "fp32"
) -> torch.Tensor:
    """Mean next-token cross-entropy in float32 over all positions.

    ``head_chunk_tokens=0`` with the FP32 head applies the model's head module and the loss to the
    full logits. A positive value runs the head and the loss in chunks of that many tokens
    (:func:`chunked_cross_entropy` in ``head_precision``'s arithmetic whatever the recipe), through the head's
    ``chunked_cross_entropy`` method so that FSDP2 gathers the sharded head around it. A tf32 or bf16
    head without chunks runs the same fused head and loss as one chunk of every token.
    """
    check_head_precision(head_precision)
    if head_chunk_tokens <= 0 and head_precision == "fp32":
        logits = model(input_ids)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    head_loss = getattr(getattr(model, "lm_head", None), HEAD_LOSS_METHOD, None)
    if head_loss is None:
        what = f"head_chunk_tokens={head_chunk_tokens}" if head_chunk_tokens > 0 else f"head_precision={head_precision}"
        raise ValueError(
            f"{what} needs a model whose lm_head has the "
            f"{HEAD_LOSS_METHOD!r} method (nemofp4.training.parallel.parallelize attaches it); "
            f"got {type(model).__name__}"
        )
    hidden = model(input_ids, return_hidden=True)
    chunk_tokens = head_chunk_tokens if head_chunk_tokens > 0 else max(1, labels.numel())
    return head_loss(hidden, labels, chunk_tokens=chunk_tokens, precision=head_precision)
