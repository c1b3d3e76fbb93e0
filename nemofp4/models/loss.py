"""The LM head and next-token cross-entropy fused and computed in token chunks.

A 131,072-token vocabulary makes the FP32 logits of one 8192-token micro-batch 4 GiB, and the
plain ``F.cross_entropy(lm_head(h).float(), labels)`` keeps the logits, their log-softmax and
then their gradient alive together. Here the forward pass keeps only each token's log-sum-exp
(4 bytes a token) and the backward pass recomputes one chunk's logits at a time, so at most
``chunk_tokens x vocab`` FP32 logits (and their gradient) exist at once. The cost is one extra
head matmul in backward.

The matmuls run in true FP32 (the paper's FP32 head) unless ``allow_tf32=True``, which lets CUDA
use TF32 tensor cores for them (about 8x faster head, 10-bit mantissa products).

Used below both training and evaluation; it knows nothing of precision recipes or parallelism.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HEAD_LOSS_METHOD", "chunked_cross_entropy", "head_cross_entropy", "lm_loss"]

DEFAULT_CHUNK_TOKENS = 1024
HEAD_LOSS_METHOD = "chunked_cross_entropy"
"""Name of the head method that training.parallel attaches (FSDP-aware) and lm_loss calls."""


@contextlib.contextmanager
def _fp32_matmuls(device: torch.device, allow_tf32: bool):
    """Autocast off (the head is FP32 whatever the body runs in); TF32 only when asked for."""
    previous = torch.backends.cuda.matmul.fp32_precision
    if allow_tf32:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous


def _chunk_logits(h_CD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None) -> torch.Tensor:
    logits_CV = h_CD.float() @ weight_VD.float().t()
    return logits_CV if bias_V is None else logits_CV + bias_V.float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over tokens of -log softmax(h W^T + b)[label]; gradients recomputed chunk by chunk."""

    @staticmethod
    def forward(ctx, h_TD, weight_VD, bias_V, labels_T, chunk_tokens, ignore_index, allow_tf32):
        lse_T = torch.empty(h_TD.shape[0], dtype=torch.float32, device=h_TD.device)
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        with torch.no_grad(), _fp32_matmuls(h_TD.device, allow_tf32):
            for start in range(0, h_TD.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits_CV = _chunk_logits(h_TD[rows], weight_VD, bias_V)
                lse_C = torch.logsumexp(logits_CV, dim=-1)
                labels_C = labels_T[rows]
                valid_C = labels_C != ignore_index
                target_C = logits_CV.gather(1, labels_C.clamp(min=0).unsqueeze(1)).squeeze(1)
                total += torch.where(valid_C, lse_C - target_C, 0.0).sum()
                lse_T[rows] = lse_C
                del logits_CV
        ctx.save_for_backward(h_TD, weight_VD, bias_V, labels_T, lse_T)
        ctx.chunk_tokens, ctx.ignore_index, ctx.allow_tf32 = chunk_tokens, ignore_index, allow_tf32
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_TD, weight_VD, bias_V, labels_T, lse_T = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h_TD = torch.empty(h_TD.shape, dtype=torch.float32, device=h_TD.device) if need_h else None
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if need_w else None
        grad_b_V = torch.zeros(bias_V.shape, dtype=torch.float32, device=bias_V.device) if need_b else None
        weight_f32 = weight_VD.float()
        with _fp32_matmuls(h_TD.device, ctx.allow_tf32):
            for start in range(0, h_TD.shape[0], ctx.chunk_tokens):
                rows = slice(start, start + ctx.chunk_tokens)
                h_CD = h_TD[rows].float()
                labels_C = labels_T[rows]
                valid_C = labels_C != ctx.ignore_index
                # d(lse - logit[label]) / d logits = softmax - onehot, zero for ignored tokens
                grad_CV = _chunk_logits(h_CD, weight_VD, bias_V).sub_(lse_T[rows, None]).exp_()
                grad_CV[torch.arange(grad_CV.shape[0], device=grad_CV.device), labels_C.clamp(min=0)] -= 1.0
                grad_CV.mul_((valid_C.float() * grad_total).unsqueeze(1))
                if need_h:
                    grad_h_TD[rows] = grad_CV @ weight_f32
                if need_w:
                    grad_w_VD.addmm_(grad_CV.t(), h_CD)
                if need_b:
                    grad_b_V += grad_CV.sum(0)
                del grad_CV
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
    allow_tf32: bool = False,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ weight_VD.T (+ bias_V)`` against ``labels``, in FP32.

    Equal to ``F.cross_entropy((hidden @ weight_VD.T).float().flatten(0, -2), labels.flatten())``
    (the same mean over tokens whose label is not ``ignore_index``) and to its gradients, without
    materialising the full logits: ``hidden`` is ``[..., D]``, ``labels`` the matching ``[...]``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}; must be a positive number of tokens")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match: "
                         "hidden must be labels' shape plus the model width")
    if hidden.shape[-1] != weight_VD.shape[-1]:
        raise ValueError(f"hidden width {hidden.shape[-1]} != head weight's input width {weight_VD.shape[-1]}")
    h_TD, labels_T = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = _ChunkedCrossEntropy.apply(h_TD, weight_VD, bias_V, labels_T, chunk_tokens, ignore_index, allow_tf32)
    count = (labels_T != ignore_index).sum()
    return total / count  # nan when every label is ignored, as F.cross_entropy


def head_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """:func:`chunked_cross_entropy` with the weight (and bias) of a linear-like ``head`` module."""
    bias = getattr(head, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) and bias.numel() else None
    return chunked_cross_entropy(hidden, head.weight, labels, bias_V=bias, **kwargs)


def lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, *, head_chunk_tokens: int = 0,
            head_tf32: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy in float32 over all positions.

    ``head_chunk_tokens=0`` applies the model's head and the loss to the full logits. A positive
    value runs the head and the loss in chunks of that many tokens (:func:`chunked_cross_entropy`,
    FP32 products whatever the recipe; ``head_tf32`` lets CUDA use TF32), through the head's
    ``chunked_cross_entropy`` method so that FSDP2 gathers the sharded head around it.
    """
    if head_chunk_tokens <= 0:
        logits = model(input_ids)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    head_loss = getattr(getattr(model, "lm_head", None), HEAD_LOSS_METHOD, None)
    if head_loss is None:
        raise ValueError(f"head_chunk_tokens={head_chunk_tokens} needs a model whose lm_head has the "
                         f"{HEAD_LOSS_METHOD!r} method (nemofp4.training.parallel.parallelize attaches it); "
                         f"got {type(model).__name__}")
    hidden = model(input_ids, return_hidden=True)
    return head_loss(hidden, labels, chunk_tokens=head_chunk_tokens, allow_tf32=head_tf32)
