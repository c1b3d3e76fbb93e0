"""A small stand-in for the Nemotron-H model with the same module names, for fast quant tests.

The recipe and QuantLinear tests train this model for hundreds of steps in a few seconds; the
test below keeps its linear FQNs and block types identical to the real model's, so what the
recipes select on it is what they select on the real one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nemofp4.models import build_model, get_model_config

_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp"}


@pytest.fixture(autouse=True)
def one_thread():
    """The quant tests run many small ops; with the 2 CI cores shared, intra-op threads mostly
    wait on each other (10x slower). Import this fixture into a test module to use it there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Mixer(nn.Module):
    def __init__(self, kind: str, d: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "mamba":
            self.in_proj = nn.Linear(d, 4 * d, bias=False)
            self.out_proj = nn.Linear(2 * d, d, bias=False)
        elif kind == "attention":
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, d // 2, bias=False)
            self.v_proj = nn.Linear(d, d // 2, bias=False)
            self.o_proj = nn.Linear(d, d, bias=False)
        else:
            self.up_proj = nn.Linear(d, 2 * d, bias=False)
            self.down_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        if self.kind == "mamba":  # gated mixing along the sequence (a stand-in for the scan)
            z, u = self.in_proj(x_BLD).chunk(2, dim=-1)
            u = torch.cumsum(u, dim=1) / torch.arange(1, u.shape[1] + 1, device=u.device)[:, None]
            return self.out_proj(u * F.silu(z))
        if self.kind == "attention":
            b, n, d = x_BLD.shape
            q = self.q_proj(x_BLD).view(b, n, 2, d // 2).transpose(1, 2)
            k = self.k_proj(x_BLD).view(b, n, 1, d // 2).transpose(1, 2).expand(b, 2, n, d // 2)
            v = self.v_proj(x_BLD).view(b, n, 1, d // 2).transpose(1, 2).expand(b, 2, n, d // 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, n, d))
        return self.down_proj(F.relu(self.up_proj(x_BLD)).square())


class _Block(nn.Module):
    def __init__(self, symbol: str, d: int) -> None:
        super().__init__()
        self.block_type = _SYMBOLS[symbol]
        self.norm = nn.RMSNorm(d)
        self.mixer = _Mixer(self.block_type, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class StandInModel(nn.Module):
    """embeddings, layers.{i}.{norm,mixer.*_proj}, norm_f, lm_head: the real model's names."""

    def __init__(self, pattern: str = "M-*-", d: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(s, d) for s in pattern)
        self.norm_f = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids_BL: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids_BL)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))


def linear_names(model: nn.Module) -> list[tuple[str, str]]:
    """(fqn, block type of its layer) of every nn.Linear."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            block = ""
            if name.startswith("layers."):
                block = model.layers[int(name.split(".")[1])].block_type
            out.append((name, block))
    return out


def test_standin_has_the_real_models_linear_names():
    config = get_model_config("tiny")
    real = build_model(config, device="meta")
    standin = StandInModel(config.hybrid_layer_pattern)
    assert linear_names(standin) == linear_names(real)
