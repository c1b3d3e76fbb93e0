"""Nemotron-H architecture config, layer pattern, named presets, parameter and FLOP counts.

The config is a flat ``kw_only`` dataclass of str/int/float/bool fields so that Hydra can
validate ``configs/model/<preset>.yaml`` against it. Every preset yaml holds every field, and a
test keeps the yaml files equal to :data:`PRESETS`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from nemofp4.models.loss import HEAD_PRECISIONS

MLP_ACTIVATIONS = ("relu2", "swiglu")
"""Values of ``mlp_activation``: Nemotron-H's squared ReLU (two GEMMs) or Llama's SwiGLU (three)."""


class LayerType(str, enum.Enum):
    """One layer of the hybrid stack; values are Megatron's pattern symbols."""

    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"

    @property
    def block_type(self) -> str:
        """The name stored on each block as ``block.block_type``."""
        return _BLOCK_TYPE_NAMES[self]


_BLOCK_TYPE_NAMES = {LayerType.MAMBA: "mamba", LayerType.ATTENTION: "attention", LayerType.MLP: "mlp"}


def parse_pattern(pattern: str) -> list[LayerType]:
    """Parse a Megatron hybrid layer pattern ("M-M*-...") into one LayerType per layer.

    One symbol is one layer (pre-norm + one mixer + residual); the layer count is the length.
    Megatron's other symbols (``E`` MoE, ``|`` pipeline split, ``/`` MTP) are not supported here
    and are rejected rather than silently dropped.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            f"hybrid_layer_pattern must be a non-empty string of the symbols "
            f"{[t.value for t in LayerType]} (M=Mamba-2, *=attention, -=MLP), got {pattern!r}"
        )
    valid = {t.value for t in LayerType}
    unknown = sorted({symbol for symbol in pattern if symbol not in valid})
    if unknown:
        raise ValueError(
            f"hybrid_layer_pattern {pattern!r} has unknown symbols {unknown}; "
            f"valid symbols are 'M' (Mamba-2), '*' (attention) and '-' (MLP)"
        )
    return [LayerType(symbol) for symbol in pattern]


@dataclass(kw_only=True)
class NemotronHConfig:
    """Every architecture field of a Nemotron-H hybrid model.

    Names follow transformers' ``NemotronHConfig`` where one exists, so the HF adapter is a
    near-identity map. Derived sizes (``num_layers``, ``mamba_intermediate_size``,
    ``mamba_conv_dim``) are properties, never fields, so they cannot disagree with the fields.
    """

    # --- stack ---
    hybrid_layer_pattern: str
    """Megatron symbols, one per layer: 'M' Mamba-2, '*' attention, '-' MLP."""
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (block norms, final norm, Mamba gated norm)."""

    # --- MLP (no bias) ---
    ffn_hidden_size: int
    """Width of the MLP's hidden activation (Megatron's ``ffn_hidden_size``); SwiGLU's fused input
    projection is twice as wide (gate and up)."""
    mlp_activation: str = "relu2"
    """``relu2``: ``down(relu(up(x))^2)``, Nemotron-H's. ``swiglu``: ``down(silu(gate(x)) * up(x))`` with
    gate and up fused in one linear, as Megatron's ``--swiglu`` (Llama-shaped MLPs at their real GEMM
    shapes). transformers' NemotronH has no gated MLP, so a SwiGLU model does not export to HF."""

    # --- attention (GQA, no positional embedding) ---
    num_attention_heads: int
    num_key_value_heads: int
    attention_head_dim: int
    max_position_embeddings: int = 8192
    """Context length the model is trained for. No tensor depends on it (the attention has no
    positional embedding and Mamba-2 is recurrent), so a longer training sequence is no error:
    :meth:`trained_on` raises it to the trained length, which goes to the HF config."""

    # --- Mamba-2 ---
    mamba_num_heads: int
    mamba_head_dim: int
    mamba_expand: int = 2
    """Only checked: mamba_num_heads * mamba_head_dim must equal mamba_expand * hidden_size."""
    ssm_state_size: int
    mamba_num_groups: int
    """Groups sharing B and C; also the groups of the gated RMSNorm."""
    conv_kernel: int = 4
    use_conv_bias: bool = True
    chunk_size: int = 256
    """SSD chunk length. Numerics do not depend on it (up to rounding); speed and memory do."""
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    """dt_bias init: dt ~ log-uniform[time_step_min, time_step_max], clamped >= time_step_floor."""
    clamp_dt_to_min: bool = True
    """Clamp softplus(dt + dt_bias) from below at time_step_min in the forward pass. Exported as
    NemotronH's ``time_step_limit`` ([time_step_min, inf] when True, the released checkpoints'
    [0, inf] when False), which transformers >= 5.25 applies, so either exports faithfully.
    Imported released checkpoints get False (docs/model.md, "dt clamp")."""

    # --- LM head ---
    head_precision: str = "fp32"
    """Arithmetic of the LM head's GEMMs (logits, and in backward the hidden states' and the weight's
    gradients); the log-softmax and the loss are FP32 in every case. ``fp32``: true FP32 (the UE5M3
    and NVFP4 papers' FP32 head, kept by the paper presets); ``tf32``: TF32 tensor cores on CUDA;
    ``bf16``: BF16 operands with FP32 accumulation (NVIDIA's recipes). A numerics choice, not an
    architecture one: the weights are the same and export ignores it (docs/model.md, "LM head")."""

    # --- initialization ---
    init_std: float = 0.02
    rescale_prenorm_residual: bool = True
    """Mamba out_proj init divided by sqrt(num_layers) (transformers' NemotronH convention)."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def layer_types(self) -> list[LayerType]:
        return parse_pattern(self.hybrid_layer_pattern)

    @property
    def num_layers(self) -> int:
        return len(self.hybrid_layer_pattern)

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the depthwise conv: x, B and C."""
        return self.mamba_intermediate_size + 2 * self.mamba_num_groups * self.ssm_state_size

    @property
    def mlp_in_proj_size(self) -> int:
        """Output width of the MLP's input projection: ``ffn_hidden_size``, or gate and up for SwiGLU."""
        return (2 if self.mlp_activation == "swiglu" else 1) * self.ffn_hidden_size

    @property
    def mamba_in_proj_size(self) -> int:
        """in_proj output width: [z | x B C | dt]."""
        return self.mamba_intermediate_size + self.mamba_conv_dim + self.mamba_num_heads

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming every field that is out of range or does not divide."""
        layer_types = parse_pattern(self.hybrid_layer_pattern)
        errors: list[str] = []
        positive = (
            "hidden_size",
            "vocab_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "attention_head_dim",
            "max_position_embeddings",
            "mamba_num_heads",
            "mamba_head_dim",
            "mamba_expand",
            "ssm_state_size",
            "mamba_num_groups",
            "conv_kernel",
            "chunk_size",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                errors.append(f"{name}={value!r} must be a positive int")
        for name in ("norm_eps", "init_std", "time_step_min", "time_step_max", "time_step_floor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                errors.append(f"{name}={value!r} must be a positive float")
        if self.head_precision not in HEAD_PRECISIONS:
            errors.append(
                f"head_precision={self.head_precision!r} must be one of {', '.join(HEAD_PRECISIONS)} "
                "(fp32: the paper's FP32 head, tf32: TF32 tensor cores, bf16: BF16 GEMMs, FP32 loss)"
            )
        if self.mlp_activation not in MLP_ACTIVATIONS:
            errors.append(
                f"mlp_activation={self.mlp_activation!r} must be one of {', '.join(MLP_ACTIVATIONS)} "
                "(relu2: Nemotron-H's squared-ReLU MLP, swiglu: a gated SiLU MLP, gate and up fused)"
            )
        if errors:
            raise ValueError("invalid NemotronHConfig: " + "; ".join(errors))

        if self.time_step_min > self.time_step_max:
            errors.append(f"time_step_min={self.time_step_min} exceeds time_step_max={self.time_step_max}")
        if LayerType.ATTENTION in layer_types and self.num_attention_heads % self.num_key_value_heads:
            errors.append(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if LayerType.MAMBA in layer_types:
            if self.mamba_num_heads * self.mamba_head_dim != self.mamba_expand * self.hidden_size:
                errors.append(
                    f"mamba_num_heads * mamba_head_dim = {self.mamba_num_heads} * {self.mamba_head_dim} = "
                    f"{self.mamba_intermediate_size} differs from mamba_expand * hidden_size = "
                    f"{self.mamba_expand} * {self.hidden_size} = {self.mamba_expand * self.hidden_size}"
                )
            if self.mamba_num_heads % self.mamba_num_groups:
                errors.append(
                    f"mamba_num_heads={self.mamba_num_heads} is not divisible by "
                    f"mamba_num_groups={self.mamba_num_groups}"
                )
            if self.hidden_size % self.mamba_num_groups:
                errors.append(
                    f"hidden_size={self.hidden_size} is not divisible by mamba_num_groups={self.mamba_num_groups}"
                )
        if errors:
            raise ValueError("invalid NemotronHConfig: " + "; ".join(errors))

    def replace(self, **overrides) -> NemotronHConfig:
        """A copy with some fields changed (validated); unknown names raise ValueError."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown NemotronHConfig fields {unknown}; valid fields are {sorted(names)}")
        return dataclasses.replace(self, **overrides)

    def trained_on(self, seq_len: int) -> NemotronHConfig:
        """This config as trained on `seq_len`-token sequences: max_position_embeddings raised to seq_len
        when it is shorter (the model has no positional embedding, so nothing limits the length; the
        field records the context trained for, which transformers and serving stacks read as the
        maximum length), else unchanged."""
        if seq_len <= self.max_position_embeddings:
            return self
        return self.replace(max_position_embeddings=seq_len)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ counts
    def _layer_parameters(self, layer_type: LayerType) -> int:
        d = self.hidden_size
        norm = d
        if layer_type is LayerType.MAMBA:
            d_inner, heads = self.mamba_intermediate_size, self.mamba_num_heads
            conv = self.mamba_conv_dim * self.conv_kernel + (self.mamba_conv_dim if self.use_conv_bias else 0)
            # in_proj, conv, dt_bias + A_log + D, gated norm, out_proj
            return norm + d * self.mamba_in_proj_size + conv + 3 * heads + d_inner + d_inner * d
        if layer_type is LayerType.ATTENTION:
            q = self.num_attention_heads * self.attention_head_dim
            kv = self.num_key_value_heads * self.attention_head_dim
            return norm + d * q + 2 * d * kv + q * d
        return norm + d * self.mlp_in_proj_size + self.ffn_hidden_size * d

    def num_non_embedding_parameters(self) -> int:
        """Parameters of the blocks and the final norm: everything but the embedding and LM head."""
        return sum(self._layer_parameters(t) for t in self.layer_types) + self.hidden_size

    def num_parameters(self) -> int:
        """Exact parameter count of the model this config builds (tied weights counted once)."""
        embedding = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embedding
        return self.num_non_embedding_parameters() + embedding + lm_head

    def flops_per_token(self, seq_len: int) -> int:
        """Training (forward + backward) FLOPs per token at sequence length ``seq_len``, for MFU.

        6N-style: each multiply-add is 2 FLOPs in the forward and 4 in the backward, so every term
        below is 3x its forward cost. Terms:
          * dense matmuls: 6 x (parameters of every linear, including the LM head; the embedding
            lookup and the elementwise parameters are free);
          * attention scores and values: 6 x heads x head_dim x seq_len per attention layer, the
            full 6 x 2 x heads x head_dim x seq_len halved for the causal mask: the FLOPs a causal
            flash kernel runs, FlashAttention's convention (Dao-AILab/flash-attention,
            benchmarks/benchmark_flash_attention.py, ``flops``: ``// (2 if causal else 1)``). PaLM's
            appendix B, Megatron-LM's ``num_floating_point_operations`` and TorchTitan's
            ``get_num_flop_per_token`` count it undiscounted; with their count a step that runs at
            peak reads above 100% MFU. The step-cost planner (nemofp4.planning) uses this count too;
          * SSD scan (chunked algorithm, chunk Q, no causal discount): forward 2QNG (C.B^T)
            + 2QPH (scores x values) + 4NPH (chunk states and state-to-output), plus the
            depthwise conv 2K x conv_dim, times 3.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        d = self.hidden_size
        matmul_params = self.vocab_size * d
        extra = 0
        for layer_type in self.layer_types:
            if layer_type is LayerType.MAMBA:
                matmul_params += d * self.mamba_in_proj_size + self.mamba_intermediate_size * d
                q = min(self.chunk_size, seq_len)
                n, g, p, h = (
                    self.ssm_state_size,
                    self.mamba_num_groups,
                    self.mamba_head_dim,
                    self.mamba_num_heads,
                )
                extra += 3 * (
                    2 * q * n * g + 2 * q * p * h + 4 * n * p * h + 2 * self.conv_kernel * self.mamba_conv_dim
                )
            elif layer_type is LayerType.ATTENTION:
                q_width = self.num_attention_heads * self.attention_head_dim
                kv_width = self.num_key_value_heads * self.attention_head_dim
                matmul_params += 2 * d * q_width + 2 * d * kv_width
                extra += 6 * q_width * seq_len  # causal: half of the 2 x q_width x seq_len scores and values
            else:
                matmul_params += d * self.mlp_in_proj_size + self.ffn_hidden_size * d
        return 6 * matmul_params + extra


# The Nemotron-H 8B layer pattern: 24 Mamba-2, 24 MLP, 4 attention (zero-based layers 7, 18, 29, 40).
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

PRESETS: dict[str, NemotronHConfig] = {
    # A few million parameters, all three layer types; trains on 2 CPU cores in minutes.
    "tiny": NemotronHConfig(
        hybrid_layer_pattern="M-*-M-",
        hidden_size=128,
        vocab_size=8192,
        ffn_hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_head_dim=32,
        max_position_embeddings=1024,
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=32,
        mamba_num_groups=2,
        chunk_size=64,
    ),
    # ~140M parameters (at vocab 8192) for recipe studies on one GPU; 8B ratios scaled down.
    "small": NemotronHConfig(
        hybrid_layer_pattern="M-M-M*-M-M-M-M*-M-M-M-M-",
        hidden_size=768,
        vocab_size=8192,
        ffn_hidden_size=4032,
        num_attention_heads=12,
        num_key_value_heads=4,
        attention_head_dim=64,
        max_position_embeddings=4096,
        mamba_num_heads=24,
        mamba_head_dim=64,
        ssm_state_size=128,
        mamba_num_groups=8,
        chunk_size=256,
    ),
    # The released nvidia/Nemotron-H-8B-Base-8K: 8 KV heads, 8.10B parameters.
    "nemotron_h_8b": NemotronHConfig(
        hybrid_layer_pattern=NEMOTRON_H_8B_PATTERN,
        hidden_size=4096,
        vocab_size=131072,
        ffn_hidden_size=21504,
        num_attention_heads=32,
        num_key_value_heads=8,
        attention_head_dim=128,
        max_position_embeddings=8192,
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        mamba_num_groups=8,
        chunk_size=256,
        clamp_dt_to_min=False,  # its time_step_limit is (0, inf)
    ),
}
# The 8B of the NVFP4 and UE5M3 papers: the released 8B with 4 KV heads, 8.08B parameters.
PRESETS["nemotron_h_8b_paper"] = PRESETS["nemotron_h_8b"].replace(num_key_value_heads=4)


def get_model_config(name: str, **overrides) -> NemotronHConfig:
    """A fresh copy of preset ``name`` with ``overrides`` applied (and validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets are {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
