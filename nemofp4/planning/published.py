"""Published, measured training runs the step-cost model is checked against: each run's own model,
GPUs, parallelism, sequence length and batch, its measured throughput and where it is published.
They are the test of the model, never its data: no efficiency in :mod:`nemofp4.planning.efficiency`
is fitted to them."""

from __future__ import annotations

from nemofp4.models import NemotronHConfig, get_model_config

__all__ = ["llama3_8b"]


def llama3_8b() -> NemotronHConfig:
    """Llama 3 (3.1) 8B in our layer language: 32 blocks of attention then a SwiGLU MLP, d 4096, FFN
    14,336, 32 query and 8 KV heads of 128, vocabulary 128,256, untied head (Meta's config.json of
    meta-llama/Meta-Llama-3-8B)."""
    return get_model_config("nemotron_h_8b", hybrid_layer_pattern="*-" * 32, hidden_size=4096, ffn_hidden_size=14336,
                            mlp_activation="swiglu", num_attention_heads=32, num_key_value_heads=8,
                            attention_head_dim=128, vocab_size=128256, max_position_embeddings=8192)  # fmt: skip
