"""Native low-precision linears through Transformer Engine: ``te.Linear`` under one of TE's recipes.

Used only by the Transformer Engine recipes (``nvfp4_te``, ``fp8_te``, ``mxfp8_te``) on machines with
TE and a GPU that runs the recipe. Each converted linear enters TE's autocast itself, so TE and BF16
layers mix freely (as Megatron does per layer). The TE recipe object is built from the recipe part's
dataclass fields, never from environment variables (TE reads some of its defaults from the
environment: those are passed explicitly). Nothing here imports TE until a TE linear is built or the
machine is checked.

Which GPUs run which recipe, as TE decides it (``pytorch/quantization.py``, ``_compute_fp8_support``,
``_compute_mxfp8_support``, ``_compute_nvfp4_support``): per-tensor FP8 from compute capability 8.9
(Ada, Hopper, Blackwell), MXFP8 on 10.x (Blackwell data-center GPUs; TE refuses 12.x), NVFP4 on 10.x.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "TE_RECIPES",
    "TELinear",
    "TENVFP4Linear",
    "TERecipe",
    "build_te_recipe",
    "fp8_gemm_any_layout",
    "transformer_engine_status",
]


@dataclass(frozen=True, kw_only=True)
class TERecipe:
    """One Transformer Engine recipe: the GEMMs it runs and the GPUs it runs on."""

    name: str
    """TE's recipe class (``transformer_engine.common.recipe``)."""
    gemm: str
    """The tensor-core precision of its GEMMs: 'fp4' or 'fp8'."""
    checker: str
    """TE's own availability check (``transformer_engine.pytorch.<checker>(return_reason=True)``), used
    where the installed TE has it."""
    needs: str
    """What a GPU needs, in words (for messages)."""
    min_capability: tuple[int, int]
    below_capability: tuple[int, int] | None = None
    """The first compute capability it does not run on again (None: every newer one runs it)."""

    def supports(self, capability: tuple[int, int]) -> bool:
        """Whether a GPU of compute ``capability`` (major, minor) runs it."""
        return capability >= self.min_capability and (
            self.below_capability is None or capability < self.below_capability
        )


TE_RECIPES: dict[str, TERecipe] = {
    r.name: r
    for r in (
        TERecipe(
            name="NVFP4BlockScaling",
            gemm="fp4",
            checker="is_nvfp4_available",
            needs="FP4 tensor cores (SM 10.x)",
            min_capability=(10, 0),
            below_capability=(11, 0),
        ),
        TERecipe(
            name="Float8CurrentScaling",
            gemm="fp8",
            checker="is_fp8_available",
            needs="FP8 tensor cores (SM 8.9 or newer: Ada, Hopper, Blackwell)",
            min_capability=(8, 9),
        ),
        TERecipe(
            name="MXFP8BlockScaling",
            gemm="fp8",
            checker="is_mxfp8_available",
            needs="MXFP8 tensor cores (SM 10.x: Blackwell)",
            min_capability=(10, 0),
            below_capability=(12, 0),
        ),
    )
}
"""The TE recipes a part can name (``part.te_recipe``), by TE's class name."""


def fp8_gemm_any_layout(capability: tuple[int, int]) -> bool:
    """Whether cuBLAS's FP8 GEMMs take any operand layout on a GPU of compute ``capability`` (TE's
    ``nvte_is_non_tn_fp8_gemm_supported``: SM 10.x, 11.x and 13+), so per-tensor FP8 keeps one copy for
    both directions; elsewhere (Hopper, Ada) they are TN-only and TE also writes the transpose."""
    return (10, 0) <= capability < (12, 0) or capability >= (13, 0)


_NVFP4 = "NVFP4BlockScaling"
_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
"""Float8CurrentScaling's quantizer settings for X, W and dY, which ``te.Linear`` reads
(``_customize_quantizers_float8_current_scaling``: ``power_2_scale``, ``amax_epsilon``)."""


def _te_recipe_name(part) -> str:
    return _NVFP4 if part is None else part.te_recipe


def transformer_engine_status(part=None) -> tuple[bool, str]:
    """(True, '') when ``te.Linear`` can run ``part``'s TE recipe here (None: NVFP4 at its defaults),
    else (False, what is missing)."""
    spec = TE_RECIPES[_te_recipe_name(part)]
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipes

        getattr(te_recipes, spec.name)
    except Exception as exc:  # ImportError, AttributeError, or a broken install raising anything else
        return False, f"transformer_engine with {spec.name} is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible"
    checker = getattr(te, spec.checker, None)
    if checker is not None:
        try:
            available, reason = checker(return_reason=True)
        except TypeError:
            available, reason = bool(checker()), ""
        if not available:
            return False, f"Transformer Engine reports {spec.name} unavailable ({reason or 'no reason given'})"
    else:
        capability = torch.cuda.get_device_capability()
        if not spec.supports(capability):
            name, (major, minor) = torch.cuda.get_device_name(), capability
            return False, f"the GPU ({name}, SM {major}.{minor}) cannot run {spec.name}, which needs {spec.needs}"
    if part is not None:
        try:
            build_te_recipe(part)
        except ValueError as exc:
            return False, str(exc)
    return True, ""


def _explicit(cls, **kwargs):
    """``cls(**kwargs)`` with TE's environment-read ``backward_override`` set to its default where the
    installed TE has that field (``NVTE_BACKWARD_OVERRIDE`` would otherwise change the backward)."""
    import dataclasses

    if "backward_override" in {f.name for f in dataclasses.fields(cls)}:
        kwargs["backward_override"] = None
    return cls(**kwargs)


def build_te_recipe(part):
    """TE's recipe object for a Transformer Engine part (``part.te_recipe`` and its fields).

    ``Float8CurrentScaling``'s power-of-two scales are its three ``QParams.power_2_scale`` (what
    ``te.Linear`` reads; the ``use_power_2_scales`` field only seeds their class defaults from
    ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`` at import), set on the object either way. A TE without
    them refuses ``power_of_two_scales=True`` with a ValueError.
    """
    from transformer_engine.common import recipe as te_recipes

    name = part.te_recipe
    if name == _NVFP4:
        return _explicit(
            te_recipes.NVFP4BlockScaling,
            disable_rht=part.disable_rht,
            disable_stochastic_rounding=part.disable_stochastic_rounding,
            disable_2d_quantization=part.disable_2d_quantization,
        )
    fp8_format = getattr(te_recipes.Format, part.fp8_format.upper())
    if name == "MXFP8BlockScaling":
        return _explicit(te_recipes.MXFP8BlockScaling, fp8_format=fp8_format)
    if name != "Float8CurrentScaling":
        raise ValueError(f"te_recipe={name!r}; valid: {', '.join(TE_RECIPES)}")
    recipe = _explicit(te_recipes.Float8CurrentScaling, fp8_format=fp8_format)
    qparams = getattr(te_recipes, "QParams", None)
    if qparams is None or not all(hasattr(recipe, q) for q in _QPARAMS):
        if part.power_of_two_scales:
            raise ValueError(
                "precision.power_of_two_scales=true: the installed Transformer Engine's "
                "Float8CurrentScaling has no power-of-two scale setting (QParams.power_2_scale); "
                "use power_of_two_scales=false"
            )
        return recipe
    for q in _QPARAMS:
        setattr(recipe, q, qparams(power_2_scale=part.power_of_two_scales, amax_epsilon=0.0))
    if hasattr(recipe, "use_power_2_scales"):
        recipe.use_power_2_scales = part.power_of_two_scales
    return recipe


def _autocast(recipe) -> contextlib.AbstractContextManager:
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


class TELinear(nn.Module):
    """Marker base of the TE-backed linears; :meth:`from_linear` builds the real ``te.Linear`` subclass."""

    @staticmethod
    def from_linear(linear: nn.Linear, part) -> nn.Module:
        """A ``te.Linear`` with the same parameter objects as ``linear``, run under ``part``'s TE recipe."""
        import transformer_engine.pytorch as te

        class _TELinear(te.Linear, TELinear):
            def forward(self, x, *args, **kwargs):
                with _autocast(self.te_recipe):
                    return super().forward(x, *args, **kwargs)

        _TELinear.__name__ = _TELinear.__qualname__ = "TELinear"
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
        module.te_recipe = build_te_recipe(part)
        return module


TENVFP4Linear = TELinear
"""The name of :class:`TELinear` from when NVFP4 was its only recipe."""
