"""QuantLinear: a drop-in ``nn.Linear`` whose three GEMMs run on FP4 block-quantized operands (its
programs and custom ops: :mod:`nemofp4.quant.linear_op`; its operands:
:mod:`nemofp4.quant.linear_operands`; its state: :mod:`nemofp4.quant.linear_state`), and FP32Linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import LinearQuantConfig
from .linear_op import fp4_linear, register_ops
from .linear_operands import _Quantizer
from .linear_state import QuantCall, QuantLinearState, _mix_seed
from .reference import ReferenceState
from .stats import OperandStats

__all__ = ["FP32Linear", "QuantCall", "QuantLinear", "QuantLinearState"]
__all__ += ["_mix_seed", "_Quantizer"]  # test seams


class QuantLinear(nn.Linear):
    """``nn.Linear`` with emulated FP4 fprop, dgrad and wgrad GEMMs (see :mod:`nemofp4.quant.linear_op`).

    Usually made by :func:`nemofp4.recipes.apply_recipe` as a class swap of an existing
    ``nn.Linear`` (:meth:`from_linear`: no reallocation, same parameter objects, works on the
    meta device). Inputs may have any leading dims. It computes in the input dtype, or in the
    autocast dtype when autocast is on (BF16 on GPU); the block-quantized operands are exact
    in either, and products accumulate in FP32.
    """

    quant_config: LinearQuantConfig
    quant_index: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        config: LinearQuantConfig,
        index: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_quant(config, index)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: LinearQuantConfig, *, index: int = 0) -> QuantLinear:
        """Turn ``linear`` into a QuantLinear in place (class swap) and return it."""
        if type(linear) is not nn.Linear:
            raise ValueError(f"QuantLinear.from_linear needs a plain nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        linear._setup_quant(config, index)
        return linear

    def _setup_quant(self, config: LinearQuantConfig, index: int) -> None:
        if not isinstance(config, LinearQuantConfig):
            raise ValueError(f"config must be a LinearQuantConfig, got {type(config).__name__}")
        self.quant_config = config
        self.quant_index = index
        references = ReferenceState({ref: config.reference_interval(ref) for ref in config.reference_roles()})
        self.quant_state = QuantLinearState(references, index, config)
        register_ops()  # when the first QuantLinear is made, not at import (see register_ops)

    @property
    def quant_backend(self) -> str:
        """The kernels setting, one of :data:`nemofp4.kernels.BACKENDS` (kept in :attr:`quant_state`)."""
        return self.quant_state.backend

    @quant_backend.setter
    def quant_backend(self, backend: str) -> None:
        self.quant_state.set_backend(backend)

    @property
    def collect_stats(self) -> bool:
        """Whether quantizations keep their statistics (kept in :attr:`quant_state`)."""
        return self.quant_state.collect_stats

    @collect_stats.setter
    def collect_stats(self, enabled: bool) -> None:
        self.quant_state.collect_stats = enabled

    # ----------------------------------------------------------------- step, seeds, references
    def set_step(self, step: int, *, seed: int = 0, rank: int = 0) -> None:
        """Enter optimizer step ``step`` (1-based): drives reference refresh and reseeds SR."""
        self.quant_state.set_step(step, seed=seed, rank=rank)

    @property
    def references(self) -> ReferenceState:
        return self.quant_state.references

    # ----------------------------------------------------------------- module state
    def get_extra_state(self) -> dict[str, torch.Tensor]:
        """The held references (:meth:`ReferenceState.state_dict`), as the module's extra state: the
        model's state dict carries them, under the module's own name, through FSDP2, DeepSpeed,
        activation checkpointing and ``torch.compile`` (``get_model_state_dict`` drops the wrappers'
        segments), replicated like every unsharded tensor; weights-only consumers drop them
        (:func:`nemofp4.quant.without_quant_state`). The SR generators are not state: they are
        reseeded from (seed, rank, step, module index) every step; neither are the statistics."""
        return self.references.state_dict(device=self.weight.device)

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.references.load_state_dict(state, device=self.weight.device)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """A state without held references (the weights alone: a transformers import, a checkpoint
        written before references were module state) is a complete one: the module keeps what it holds
        (a fresh one: nothing, sampled at first use)."""
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        key = prefix + torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
        if key in missing_keys:
            missing_keys.remove(key)

    # ----------------------------------------------------------------- statistics and test hooks
    @property
    def _stats(self) -> dict[str, OperandStats]:
        return self.quant_state.stats

    @_stats.setter
    def _stats(self, value: dict[str, OperandStats]) -> None:
        self.quant_state.stats = value

    @property
    def _capture(self) -> list | None:
        """Test hook: set a list to collect every GEMM (name, operands, product)."""
        return self.quant_state.capture

    @_capture.setter
    def _capture(self, value: list | None) -> None:
        self.quant_state.capture = value

    def quant_stats(self) -> dict[str, float]:
        """Fractions of the last quantization of each role, and rho = current / held amax for roles with
        a held reference (:mod:`nemofp4.quant.stats`): '<role>/<stat>' -> value."""
        return {f"{role}/{k}": v for role, s in self._stats.items() for k, v in s.read().items()}

    # ----------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            compute_dtype = torch.get_autocast_dtype(device_type)
        else:
            compute_dtype = x.dtype
        grad = torch.is_grad_enabled()
        with torch.autocast(device_type, enabled=False):
            return fp4_linear(
                x,
                self.weight,
                self.bias,
                self.quant_state,
                self.training,
                compute_dtype,
                grad and x.requires_grad,
                grad and self.weight.requires_grad,
            )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quant=[{self.quant_config.summary()}]"


class FP32Linear(nn.Linear):
    """``nn.Linear`` that computes in float32 even under autocast (the LM head of FP4 recipes).

    Output is float32, which is what the loss wants. With FSDP2 mixed precision the weight
    may arrive in BF16; it is upcast here, so keep the LM head's params in FP32 for a true
    FP32 head.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP32Linear:
        if type(linear) is not nn.Linear:
            raise ValueError(f"FP32Linear.from_linear needs a plain nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)
