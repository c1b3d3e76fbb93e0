"""The registered recipes. Each is a builder function whose keyword arguments are its knobs.

``get_recipe(name, **overrides)`` calls the builder; an override it does not take is an error
naming the knobs it does take. The numbers and their sources are in docs/recipes.md.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from nemofp4.quant import LinearQuantConfig, OperandQuant

from .recipe import HighPrecision, Recipe, TransformerEngineNVFP4
from .rules import Rule, last_layers, layer_indices

__all__ = ["get_recipe", "list_recipes", "recipe_knobs", "register_recipe"]

_REGISTRY: dict[str, Callable[..., Recipe]] = {}

# Module globs of the model (nemofp4.models.nemotron_h): every eligible linear is a mixer projection.
ELIGIBLE = "layers.*.mixer.*"
LAYER_ELIGIBLE = "layers.{layer}.mixer.*"
LM_HEAD = "lm_head"
# The UE5M3 paper's targeted override: wgrad dY of down_proj in zero-based layers 45, 47, 49, 51.
TARGETED_LAYERS = (45, 47, 49, 51)


def register_recipe(name: str):
    """Register a builder under ``name`` (its docstring is the recipe's description)."""

    def deco(fn: Callable[..., Recipe]) -> Callable[..., Recipe]:
        if name in _REGISTRY:
            raise ValueError(f"recipe {name!r} is already registered")
        if not (fn.__doc__ or "").strip():
            raise ValueError(f"recipe builder {fn.__name__} needs a docstring (it is the recipe's description)")
        _REGISTRY[name] = fn
        return fn

    return deco


def list_recipes() -> list[str]:
    return sorted(_REGISTRY)


def recipe_knobs(name: str) -> dict[str, object]:
    """The overridable knobs of a recipe and their defaults."""
    builder = _builder(name)
    return {p.name: p.default for p in inspect.signature(builder).parameters.values()}


def get_recipe(name: str, **overrides) -> Recipe:
    """Build the registered recipe ``name`` with optional knob overrides (e.g. reference_interval=50)."""
    builder = _builder(name)
    knobs = recipe_knobs(name)
    unknown = sorted(set(overrides) - set(knobs))
    if unknown:
        raise ValueError(
            f"recipe {name!r} has no knob(s) {unknown}; its knobs are {sorted(knobs) or 'none'}"
        )
    return builder(**overrides)


def _builder(name: str) -> Callable[..., Recipe]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown precision recipe {name!r}; registered recipes are {list_recipes()}")
    return _REGISTRY[name]


def _description(fn: Callable) -> str:
    return inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0].replace("\n", " ")


def _fp4_linear(
    *,
    scale_format: str,
    block_size: int,
    two_d_weights: bool,
    dy_rounding: str,
    wgrad_hadamard: bool,
    scale_target: float,
    reference_interval: int,
    gemm: str,
) -> LinearQuantConfig:
    """The common shape of every FP4 recipe: RNE on X and W, ``dy_rounding`` on both dY operands,
    optional RHT on the two wgrad operands only."""

    def op(**kw) -> OperandQuant:
        base = dict(
            scale_format=scale_format,
            block_size=block_size,
            scale_target=scale_target,
            reference_interval=reference_interval,
        )
        base.update(kw)
        return OperandQuant(**base)

    return LinearQuantConfig(
        x=op(),
        w=op(two_d=two_d_weights),
        dy_dgrad=op(rounding=dy_rounding),
        dy_wgrad=op(rounding=dy_rounding, hadamard=wgrad_hadamard),
        x_wgrad=op(hadamard=wgrad_hadamard),
        gemm=gemm,
    )


def _bf16_tail_rules(num_bf16_last_layers: int, fp4_part: str = "fp4") -> tuple[Rule, ...]:
    rules = [Rule(pattern=LM_HEAD, part="fp32")]
    if num_bf16_last_layers:
        rules.append(Rule(pattern=LAYER_ELIGIBLE, layers=last_layers(num_bf16_last_layers, at_most_fifth=True), part="bf16"))
    rules.append(Rule(pattern=ELIGIBLE, part=fp4_part))
    return tuple(rules)


_HIGH = {"bf16": HighPrecision(compute="model"), "fp32": HighPrecision(compute="fp32")}


@register_recipe("bf16")
def bf16() -> Recipe:
    """BF16 baseline: every linear (LM head included) stays an nn.Linear in the model dtype.

    On GPU that is BF16 under autocast with FP32 master weights; on CPU it is float32.
    """
    return Recipe(
        name="bf16",
        description=_description(bf16),
        parts={"bf16": HighPrecision(compute="model")},
        rules=(Rule(pattern="*", part="bf16"),),
    )


@register_recipe("nvfp4")
def nvfp4(*, num_bf16_last_layers: int = 8, gemm: str = "scaled") -> Recipe:
    """NVIDIA's NVFP4 training recipe with Transformer Engine semantics, emulated in software.

    E2M1 values in 16-element blocks with E4M3 scales (T = 448) and a current FP32 tensor
    scale (amax of every quantized tensor), 16x16 2-D weight tiles, a 16x16 random Hadamard
    transform on both wgrad operands, stochastic rounding on dY (both backward GEMMs), the
    last 8 pattern layers in BF16 and the LM head in FP32.
    """
    fp4 = _fp4_linear(
        scale_format="e4m3", block_size=16, two_d_weights=True, dy_rounding="sr", wgrad_hadamard=True,
        scale_target=448.0, reference_interval=0, gemm=gemm,
    )  # fmt: skip
    return Recipe(
        name="nvfp4",
        description=_description(nvfp4),
        parts={"fp4": fp4, **_HIGH},
        rules=_bf16_tail_rules(num_bf16_last_layers),
        knobs={"num_bf16_last_layers": num_bf16_last_layers, "gemm": gemm},
    )


@register_recipe("nvfp4_te")
def nvfp4_te(*, num_bf16_last_layers: int = 8) -> Recipe:
    """NVFP4 run natively by Transformer Engine: te.Linear under NVFP4BlockScaling.

    Needs transformer_engine and a GPU with FP4 tensor cores (SM 10.x); elsewhere apply_recipe
    raises and suggests precision=nvfp4, the bit-faithful emulation. Same layer selection as
    nvfp4: the last 8 pattern layers in BF16, the LM head in FP32.
    """
    return Recipe(
        name="nvfp4_te",
        description=_description(nvfp4_te),
        parts={"fp4": TransformerEngineNVFP4(), **_HIGH},
        rules=_bf16_tail_rules(num_bf16_last_layers),
        knobs={"num_bf16_last_layers": num_bf16_last_layers},
    )


@register_recipe("ue5m3")
def ue5m3(
    *,
    reference_interval: int = 50,
    scale_target: float = 448.0,
    targeted_scale_target: float = 2048.0,
    block_size: int = 16,
    gemm: str = "scaled",
) -> Recipe:
    """The UE5M3 paper's proposed recipe (Hu, Luschi, Balanca 2026).

    E2M1 values in 16-element blocks with unsigned E5M3 scales (T = 448), tensor references
    sampled and held for D = 50 steps, 16x16 2-D weight tiles, no Hadamard transform, 8-bit
    stochastic rounding on dY only, all 112 eligible linears in FP4 and the LM head in FP32.
    The wgrad dY of down_proj in layers 45, 47, 49 and 51 uses T = 2048 when the model has them.
    """

    def linear(target_dy_wgrad: float) -> LinearQuantConfig:
        config = _fp4_linear(
            scale_format="ue5m3", block_size=block_size, two_d_weights=True, dy_rounding="sr8",
            wgrad_hadamard=False, scale_target=scale_target, reference_interval=reference_interval, gemm=gemm,
        )  # fmt: skip
        if target_dy_wgrad == scale_target:
            return config
        from dataclasses import replace

        return replace(config, dy_wgrad=replace(config.dy_wgrad, scale_target=target_dy_wgrad))

    parts = {"fp4": linear(scale_target), "fp4_t2048": linear(targeted_scale_target), **_HIGH}
    rules = (
        Rule(pattern=LM_HEAD, part="fp32"),
        Rule(
            pattern="layers.{layer}.mixer.down_proj",
            layers=layer_indices(*TARGETED_LAYERS),
            part="fp4_t2048",
            allow_empty=True,
        ),
        Rule(pattern=ELIGIBLE, part="fp4"),
    )
    return Recipe(
        name="ue5m3",
        description=_description(ue5m3),
        parts=parts,
        rules=rules,
        knobs=dict(
            reference_interval=reference_interval, scale_target=scale_target,
            targeted_scale_target=targeted_scale_target, block_size=block_size, gemm=gemm,
        ),  # fmt: skip
    )


@register_recipe("ue5m3_te_settings")
def ue5m3_te_settings(
    *,
    reference_interval: int = 1,
    scale_target: float = 448.0,
    num_bf16_last_layers: int = 8,
    gemm: str = "scaled",
) -> Recipe:
    """UE5M3 scales with Transformer Engine's other settings (the paper's best-loss ablation).

    UE5M3 block scales (T = 448) with the reference refreshed every step (D = 1), 16x16 2-D
    weight tiles, a Hadamard transform on both wgrad operands, 8-bit stochastic rounding on dY,
    the last 8 pattern layers in BF16 and the LM head in FP32. The amaxes of the transformed X^T
    and dY^T are current (measured at every call, as the paper's ``_ProbeMatchedUE5M3LinearFunction``
    does), not held for the step.
    """
    fp4 = _fp4_linear(
        scale_format="ue5m3", block_size=16, two_d_weights=True, dy_rounding="sr8", wgrad_hadamard=True,
        scale_target=scale_target, reference_interval=reference_interval, gemm=gemm,
    )  # fmt: skip
    fp4 = dataclasses.replace(
        fp4,
        x_wgrad=dataclasses.replace(fp4.x_wgrad, reference_interval=0),
        dy_wgrad=dataclasses.replace(fp4.dy_wgrad, reference_interval=0),
    )
    return Recipe(
        name="ue5m3_te_settings",
        description=_description(ue5m3_te_settings),
        parts={"fp4": fp4, **_HIGH},
        rules=_bf16_tail_rules(num_bf16_last_layers),
        knobs=dict(
            reference_interval=reference_interval, scale_target=scale_target,
            num_bf16_last_layers=num_bf16_last_layers, gemm=gemm,
        ),  # fmt: skip
    )


@register_recipe("nvfp4_all_fp4_no_rht")
def nvfp4_all_fp4_no_rht(*, gemm: str = "scaled") -> Recipe:
    """The paper's unstable ablation: NVFP4 without the Hadamard transform and with all linears in FP4.

    E4M3 scales with current tensor scaling, 16x16 2-D weights and stochastic rounding on dY
    as in nvfp4, but no RHT and no BF16 tail: all 112 eligible linears in FP4, LM head in FP32.
    """
    fp4 = _fp4_linear(
        scale_format="e4m3", block_size=16, two_d_weights=True, dy_rounding="sr", wgrad_hadamard=False,
        scale_target=448.0, reference_interval=0, gemm=gemm,
    )  # fmt: skip
    return Recipe(
        name="nvfp4_all_fp4_no_rht",
        description=_description(nvfp4_all_fp4_no_rht),
        parts={"fp4": fp4, **_HIGH},
        rules=_bf16_tail_rules(0),
        knobs={"gemm": gemm},
    )


@register_recipe("mxfp4")
def mxfp4(*, block_size: int = 32, num_bf16_last_layers: int = 8, gemm: str = "scaled") -> Recipe:
    """OCP MXFP4 with the NVFP4 paper's training methodology, for comparison studies.

    E2M1 values in 32-element blocks with power-of-two UE8M0 scales and no tensor scale, 1-D
    blocks along each GEMM's reduction dimension for every operand (weights included, as the
    MX format defines), stochastic rounding on dY, a Hadamard transform on both wgrad
    operands, the last 8 pattern layers in BF16 and the LM head in FP32.
    """
    fp4 = _fp4_linear(
        scale_format="ue8m0", block_size=block_size, two_d_weights=False, dy_rounding="sr",
        wgrad_hadamard=True, scale_target=448.0, reference_interval=0, gemm=gemm,
    )  # fmt: skip
    return Recipe(
        name="mxfp4",
        description=_description(mxfp4),
        parts={"fp4": fp4, **_HIGH},
        rules=_bf16_tail_rules(num_bf16_last_layers),
        knobs={"block_size": block_size, "num_bf16_last_layers": num_bf16_last_layers, "gemm": gemm},
    )
