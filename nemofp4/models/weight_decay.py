"""Optimizer parameter groups: which parameters get weight decay."""

from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer param groups: ``[{"params": decayed, "weight_decay": weight_decay},
    {"params": not_decayed, "weight_decay": 0.0}]``.

    Rule (Megatron-LM's default, which also covers what mamba_ssm and transformers exclude):
    every parameter with fewer than two dimensions gets no decay. In Nemotron-H that is exactly
    A_log, D, dt_bias, all RMSNorm / gated-norm weights and all biases (the conv bias). Decaying
    A_log or D pulls the SSM's decay rates and skip toward zero, and decaying norm gains pulls
    them toward zero rather than their natural value of one. Matrices (linears, the depthwise
    conv kernel, embeddings, LM head) are decayed, as in Megatron and the NVFP4 paper's runs.
    Tied parameters appear once. Only parameters with ``requires_grad`` are included.
    """
    decay, no_decay, seen = [], [], set()
    for _, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
