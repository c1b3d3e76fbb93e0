"""Nemotron-H hybrid Mamba-2 / attention / MLP language model.

Single-device and precision-free: every GEMM-eligible projection (``in_proj``, ``out_proj``,
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``up_proj`` or SwiGLU's ``gate_up_proj``,
``down_proj``, ``lm_head``) is a plain ``nn.Linear`` called as a module, so a precision recipe can
swap it from outside and no fused kernel reads its ``.weight`` behind its back.

Module tree (recipe globs match these names)::

    embeddings                      nn.Embedding
    layers.{i}.norm                 RMSNorm            (pre-norm of every block)
    layers.{i}.mixer                Mamba2Mixer | Attention | MLP | SwiGLUMLP
    norm_f                          RMSNorm
    lm_head                         nn.Linear (untied unless config.tie_word_embeddings)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import LayerType, NemotronHConfig
from .ssd import ssd_scan

try:  # optional CUDA kernel for the depthwise conv; never required
    from causal_conv1d import causal_conv1d_fn as _causal_conv1d_fn
except Exception:
    _causal_conv1d_fn = None


def _copy_full_(param: torch.Tensor, value: torch.Tensor) -> None:
    """param.copy_(value) where value is the full tensor, also when param is a sharded DTensor (FSDP2)."""
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value, param.device_mesh, param.placements)
    param.copy_(value)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back to the input dtype (as transformers' NemotronH)."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        x_f32 = x_BLD.float()
        normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x_BLD.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedRMSNorm(nn.Module):
    """Mamba-2's grouped gated RMSNorm with the gate applied before the norm (norm_before_gate=False).

    y = weight * RMSNorm_per_group(x * silu(z)); statistics over contiguous groups of
    ``group_size`` channels, in float32.
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        assert hidden_size % group_size == 0, (hidden_size, group_size)
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))

    def forward(self, x_BLE: torch.Tensor, z_BLE: torch.Tensor) -> torch.Tensor:
        gated = x_BLE.float() * F.silu(z_BLE.float())
        grouped = gated.unflatten(-1, (-1, self.group_size))
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.flatten(-2).to(x_BLE.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def causal_depthwise_conv1d(x_BLC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise conv along L followed by SiLU: out_t depends on x_{t-K+1..t} only."""
    if _causal_conv1d_fn is not None and x_BLC.is_cuda:
        return _causal_conv1d_fn(x_BLC.transpose(1, 2), weight_CK, bias_C, activation="silu").transpose(1, 2)
    kernel = weight_CK.shape[-1]
    x_BCL = F.pad(x_BLC.transpose(1, 2), (kernel - 1, 0))
    out_BCL = F.conv1d(x_BCL, weight_CK.unsqueeze(1), bias_C, groups=weight_CK.shape[0])
    return F.silu(out_BCL).transpose(1, 2)


class Mamba2Mixer(nn.Module):
    """in_proj -> causal conv + SiLU -> SSD scan (softplus dt + bias, A = -exp(A_log), D skip)
    -> gated grouped RMSNorm -> out_proj."""

    def __init__(self, config: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.num_groups = config.mamba_num_groups
        self.state_size = config.ssm_state_size
        self.intermediate_size = config.mamba_intermediate_size
        self.conv_dim = config.mamba_conv_dim
        self.chunk_size = config.chunk_size
        self.dt_min_clamp = config.time_step_min if config.clamp_dt_to_min else 0.0

        self.in_proj = nn.Linear(config.hidden_size, config.mamba_in_proj_size, bias=False, **factory)
        # Depthwise conv kept as nn.Conv1d so its parameter names match transformers and mamba_ssm.
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=config.conv_kernel,
            groups=self.conv_dim,
            padding=config.conv_kernel - 1,
            bias=config.use_conv_bias,
            **factory,
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, **factory))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, **factory))
        self.D = nn.Parameter(torch.empty(self.num_heads, **factory))
        self.norm = GatedRMSNorm(
            self.intermediate_size, self.intermediate_size // self.num_groups, config.norm_eps, **factory
        )
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False, **factory)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        z_BLE, xBC_BLC, dt_BLH = self.in_proj(x_BLD).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        xBC_BLC = causal_depthwise_conv1d(xBC_BLC, self.conv1d.weight.squeeze(1), self.conv1d.bias)
        x_BLE, B_BLGN, C_BLGN = xBC_BLC.split(
            [self.intermediate_size, self.num_groups * self.state_size, self.num_groups * self.state_size],
            dim=-1,
        )
        x_BLHP = x_BLE.unflatten(-1, (self.num_heads, self.head_dim))
        B_BLGN = B_BLGN.unflatten(-1, (self.num_groups, self.state_size))
        C_BLGN = C_BLGN.unflatten(-1, (self.num_groups, self.state_size))

        dt_BLH = F.softplus(dt_BLH.float() + self.dt_bias.float())
        if self.dt_min_clamp > 0:
            dt_BLH = dt_BLH.clamp(min=self.dt_min_clamp)
        A_H = -torch.exp(self.A_log.float())
        y_BLHP, _ = ssd_scan(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, self.chunk_size)
        # x stays in its dtype: the product promotes to float32 (the same bits as x.float()), and autograd
        # keeps x itself for D's gradient, already saved by the scan, not a float32 copy (256 MiB a layer at 8B).
        y_BLHP = y_BLHP.float() + self.D.float()[:, None] * x_BLHP
        y_BLE = self.norm(y_BLHP.flatten(-2), z_BLE)
        return self.out_proj(y_BLE.to(x_BLD.dtype))

    @torch.no_grad()
    def reset_parameters(self, config: NemotronHConfig, generator: torch.Generator | None = None) -> None:
        """transformers' NemotronH init: A_log = log(1..H), D = 1, dt_bias = softplus^-1(dt) with
        dt log-uniform in [time_step_min, time_step_max] floored at time_step_floor."""
        heads, device = self.num_heads, self.dt_bias.device
        _copy_full_(self.A_log, torch.log(torch.arange(1, heads + 1, dtype=torch.float32, device=device)))
        nn.init.ones_(self.D)
        u = torch.rand(heads, generator=generator, device=device)
        log_min, log_max = math.log(config.time_step_min), math.log(config.time_step_max)
        dt = torch.exp(u * (log_max - log_min) + log_min).clamp(min=config.time_step_floor)
        _copy_full_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        self.norm.reset_parameters()


class Attention(nn.Module):
    """Causal grouped-query attention without positional embedding (NoPE), via SDPA."""

    def __init__(self, config: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        d, q_width, kv_width = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(d, q_width, bias=False, **factory)
        self.k_proj = nn.Linear(d, kv_width, bias=False, **factory)
        self.v_proj = nn.Linear(d, kv_width, bias=False, **factory)
        self.o_proj = nn.Linear(q_width, d, bias=False, **factory)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        q_BHLK = self.q_proj(x_BLD).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        k_BGLK = self.k_proj(x_BLD).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v_BGLK = self.v_proj(x_BLD).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        out_BHLK = F.scaled_dot_product_attention(
            q_BHLK, k_BGLK, v_BGLK, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out_BHLK.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    """down_proj(relu(up_proj(x))^2): squared ReLU, no gate, no bias (``mlp_activation=relu2``, Nemotron-H's)."""

    def __init__(self, config: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x_BLD))))


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate) * up) with [gate | up] = gate_up_proj(x): Llama's gated MLP, no bias.

    Gate and up are one linear of ``2 * ffn_hidden_size`` rows, as Megatron's ``--swiglu`` fc1, so a
    recipe quantizes them as one GEMM of the shape such runs had (and the first half gates, as there).
    """

    def __init__(self, config: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        self.gate_up_proj = nn.Linear(
            config.hidden_size, config.mlp_in_proj_size, bias=False, device=device, dtype=dtype
        )
        self.down_proj = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        gate_BLF, up_BLF = self.gate_up_proj(x_BLD).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate_BLF) * up_BLF)


_MIXERS = {LayerType.MAMBA: Mamba2Mixer, LayerType.ATTENTION: Attention}
_MLPS = {"relu2": MLP, "swiglu": SwiGLUMLP}
"""The MLP mixer of each ``config.mlp_activation``."""


class Block(nn.Module):
    """x + mixer(norm(x)): one symbol of the layer pattern."""

    def __init__(self, config: NemotronHConfig, layer_idx: int, device=None, dtype=None):
        super().__init__()
        layer_type = config.layer_types[layer_idx]
        self.layer_idx = layer_idx
        self.block_type = layer_type.block_type
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, device=device, dtype=dtype)
        mixer = _MLPS[config.mlp_activation] if layer_type is LayerType.MLP else _MIXERS[layer_type]
        self.mixer = mixer(config, device=device, dtype=dtype)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return x_BLD + self.mixer(self.norm(x_BLD))


def _is_projection_or_conv(module: nn.Module) -> bool:
    """A linear-like module (weight ``[out, in]``) or the depthwise conv, whatever its class.

    A precision recipe may swap a projection for a module that is not an ``nn.Linear`` (e.g.
    Transformer Engine's ``te.Linear``); it must get the same init as the plain linear, so this
    tests the parameter, not the type. Norm weights are 1-D and are excluded.
    """
    if isinstance(module, (nn.Linear, nn.Conv1d)):
        return True
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 2


class NemotronHModel(nn.Module):
    """The causal LM: embeddings -> blocks -> norm_f -> lm_head."""

    def __init__(self, config: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": dtype}
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(Block(config, i, **factory) for i in range(config.num_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.norm_eps, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight

    def _apply(self, fn, recurse=True):
        # to_empty()/to() may replace parameters one module at a time, which unties shared ones.
        module = super()._apply(fn, recurse)
        self._tie_weights()
        return module

    def forward(self, input_ids_BL: torch.Tensor, return_hidden: bool = False) -> torch.Tensor:
        """Logits [B, L, vocab] in float32, or with ``return_hidden=True`` the final-normed hidden
        states [B, L, hidden] so a trainer can apply ``lm_head`` and the loss in chunks.

        ``return_hidden`` is a forward argument rather than a separate method so that module
        hooks (FSDP2, activation checkpointing, compile) see one entry point either way.
        """
        if input_ids_BL.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids_BL.shape)}")
        h_BLD = self.embeddings(input_ids_BL)
        for block in self.layers:
            h_BLD = block(h_BLD)
        h_BLD = self.norm_f(h_BLD)
        if return_hidden:
            return h_BLD
        return self.lm_head(h_BLD).float()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialize every parameter in place (works after ``to_empty()`` from meta).

        transformers' NemotronH convention: linears, conv and embeddings N(0, init_std), biases 0,
        norms 1, Mamba A_log/D/dt_bias as in :meth:`Mamba2Mixer.reset_parameters`, and with
        ``rescale_prenorm_residual`` every Mamba ``out_proj`` kaiming-uniform(a=sqrt(5)) / sqrt(num_layers).
        Draws come from ``generator`` (on the parameters' device; default: torch's global
        generator, so ``torch.manual_seed`` makes it deterministic), in module order.
        """
        cfg = self.config
        std = cfg.init_std
        nn.init.normal_(self.embeddings.weight, mean=0.0, std=std, generator=generator)
        for block in self.layers:
            block.norm.reset_parameters()
            mixer = block.mixer
            for module in mixer.modules():
                if _is_projection_or_conv(module):
                    nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
                    bias = getattr(module, "bias", None)
                    if isinstance(bias, torch.Tensor) and bias.numel():
                        nn.init.zeros_(bias)
            if isinstance(mixer, Mamba2Mixer):
                mixer.reset_parameters(cfg, generator=generator)
                if cfg.rescale_prenorm_residual:
                    nn.init.kaiming_uniform_(mixer.out_proj.weight, a=math.sqrt(5), generator=generator)
                    mixer.out_proj.weight.div_(math.sqrt(cfg.num_layers))
        self.norm_f.reset_parameters()
        if not cfg.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=std, generator=generator)


def build_model(
    config: NemotronHConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> NemotronHModel:
    """Construct the model on ``device``. On "meta" nothing is allocated: call ``to_empty`` and
    ``init_weights`` after any module swaps. On a real device the weights are initialized here."""
    device = torch.device(device)
    # Always construct on meta: no allocation or default init is wasted, and the weights on a real
    # device are exactly what to_empty() + init_weights() gives under the same seed.
    model = NemotronHModel(config, device="meta", dtype=dtype)
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model
