"""Native NVFP4 through Transformer Engine: ``te.Linear`` under ``NVFP4BlockScaling``.

Used only by the ``nvfp4_te`` recipe on machines with TE and an FP4-capable GPU (SM 10.x).
Each converted linear enters TE's autocast itself, so FP4 and BF16 layers mix freely (as
Megatron does per layer). The recipe settings are passed as dataclass fields, never through
environment variables. Nothing here is imported unless TE is present.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["TENVFP4Linear", "transformer_engine_status"]


def transformer_engine_status() -> tuple[bool, str]:
    """(True, '') when te.Linear can run NVFP4 here, else (False, what is missing)."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import NVFP4BlockScaling  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return False, f"transformer_engine with NVFP4BlockScaling is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible"
    checker = getattr(te, "is_nvfp4_available", None)
    if checker is not None:
        try:
            available, reason = checker(return_reason=True)
        except TypeError:
            available, reason = bool(checker()), ""
        if not available:
            return False, f"Transformer Engine reports NVFP4 unavailable ({reason or 'no reason given'})"
        return True, ""
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        name = torch.cuda.get_device_name()
        return False, f"the GPU ({name}, SM {major}.{minor}) has no FP4 tensor cores for training (needs SM 10.x)"
    return True, ""


def _nvfp4_autocast(recipe) -> contextlib.AbstractContextManager:
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


class TENVFP4Linear(nn.Module):
    """Marker base of the TE-backed linear; :meth:`from_linear` builds the real ``te.Linear`` subclass."""

    @staticmethod
    def from_linear(linear: nn.Linear, part) -> nn.Module:
        """A ``te.Linear`` with the same parameter objects as ``linear``, run under NVFP4BlockScaling."""
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import NVFP4BlockScaling

        class _TELinear(te.Linear, TENVFP4Linear):
            def forward(self, x, *args, **kwargs):
                with _nvfp4_autocast(self.nvfp4_recipe):
                    return super().forward(x, *args, **kwargs)

        _TELinear.__name__ = _TELinear.__qualname__ = "TENVFP4Linear"
        module = _TELinear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            params_dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        module.weight = linear.weight  # keep the parameter objects (FSDP2 shards them later)
        if linear.bias is not None:
            module.bias = linear.bias
        module.nvfp4_recipe = NVFP4BlockScaling(
            disable_rht=part.disable_rht,
            disable_stochastic_rounding=part.disable_stochastic_rounding,
            disable_2d_quantization=part.disable_2d_quantization,
        )
        return module
