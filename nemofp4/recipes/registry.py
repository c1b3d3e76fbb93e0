"""The registered recipes: one dataclass each, whose typed fields are its knobs (see :mod:`.config`).

``get_recipe(name, **knobs)`` builds one; a knob it does not have is an error naming its knobs.
The numbers and their sources are in docs/recipes.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nemofp4.quant import LinearQuantConfig, OperandQuant

from .config import PrecisionConfig, description, register_recipe
from .recipe import HighPrecision, Part, Recipe, TransformerEngineFP8, TransformerEngineNVFP4
from .rules import Rule, last_layers, layer_indices

__all__ = [
    "BF16",
    "FP8",
    "MXFP4",
    "MXFP8",
    "FP8TransformerEngine",
    "MXFP8TransformerEngine",
    "NVFP4",
    "UE5M3",
    "NVFP4AllFP4NoRHT",
    "NVFP4Delayed",
    "NVFP4TransformerEngine",
    "UE5M3TESettings",
    "emulated_config",
    "emulated_recipe",
]

# Module globs of the model (nemofp4.models.nemotron_h): every eligible linear is a mixer projection.
ELIGIBLE = "layers.*.mixer.*"
LAYER_ELIGIBLE = "layers.{layer}.mixer.*"
LM_HEAD = "lm_head"
# The UE5M3 paper's targeted override: wgrad dY of down_proj in zero-based layers 45, 47, 49, 51.
TARGETED_LAYERS = (45, 47, 49, 51)


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
        rules.append(
            Rule(pattern=LAYER_ELIGIBLE, layers=last_layers(num_bf16_last_layers, at_most_fifth=True), part="bf16")
        )
    rules.append(Rule(pattern=ELIGIBLE, part=fp4_part))
    return tuple(rules)


_HIGH = {"bf16": HighPrecision(compute="model"), "fp32": HighPrecision(compute="fp32")}


def _recipe(config: PrecisionConfig, parts: dict, rules: tuple[Rule, ...]) -> Recipe:
    return Recipe(
        name=config.name, description=description(type(config)), parts=parts, rules=rules, knobs=config.knobs()
    )


@register_recipe
@dataclass(kw_only=True)
class BF16(PrecisionConfig):
    """BF16 baseline: every linear (LM head included) stays an nn.Linear in the model dtype.

    On GPU that is BF16 under autocast with FP32 master weights; on CPU it is float32.
    """

    name: str = "bf16"

    def build(self) -> Recipe:
        return _recipe(self, {"bf16": HighPrecision(compute="model")}, (Rule(pattern="*", part="bf16"),))


@dataclass(kw_only=True)
class _NVFP4Knobs(PrecisionConfig):
    reference_interval: int = 0
    """D: steps a tensor reference (amax) is held; 0 = current scaling at every quantization."""
    scale_target: float = 448.0
    """T: block code of a block whose amax equals the tensor reference (TE's fixed 448 = E4M3's
    max; a smaller T leaves headroom for a held reference, a larger one saturates at once)."""
    num_bf16_last_layers: int = 8
    """Pattern layers at the end of the stack kept in BF16 (at most a fifth of the layers)."""
    gemm: str = "scaled"
    """'scaled' (block-scaled operands, BF16-speed), 'decoded' (FP32 dequantized) or 'hardware'."""
    disable_rht: bool = False
    """No random Hadamard transform on the wgrad operands (TE's ``NVFP4BlockScaling.disable_rht``)."""

    def build(self) -> Recipe:
        fp4 = _fp4_linear(
            scale_format="e4m3",
            block_size=16,
            two_d_weights=True,
            dy_rounding="sr",
            wgrad_hadamard=not self.disable_rht,
            scale_target=self.scale_target,
            reference_interval=self.reference_interval,
            gemm=self.gemm,
        )
        return _recipe(self, {"fp4": fp4, **_HIGH}, _bf16_tail_rules(self.num_bf16_last_layers))


@register_recipe
@dataclass(kw_only=True)
class NVFP4(_NVFP4Knobs):
    """NVIDIA's NVFP4 training recipe with Transformer Engine semantics, emulated in software.

    E2M1 values in 16-element blocks with E4M3 scales (T = 448) and a current FP32 tensor
    scale (amax of every quantized tensor), 16x16 2-D weight tiles, a 16x16 random Hadamard
    transform on both wgrad operands, stochastic rounding on dY (both backward GEMMs), the
    last 8 pattern layers in BF16 and the LM head in FP32.
    """

    name: str = "nvfp4"


@register_recipe
@dataclass(kw_only=True)
class NVFP4Delayed(_NVFP4Knobs):
    """NVFP4 exactly, but with the UE5M3 recipe's sample-and-hold tensor references (D = 50).

    The scale-format control: E4M3 block scales (T = 448) under a tensor reference sampled and
    held for D = 50 steps, with every other NVFP4 setting unchanged (16x16 2-D weight tiles,
    RHT on both wgrad operands, stochastic rounding on dY, the last 8 pattern layers in BF16,
    the LM head in FP32). Set against ue5m3 it isolates what UE5M3's range buys under a held
    reference: a block that outgrows the held amax saturates E4M3's 448 at once.
    """

    name: str = "nvfp4_delayed"
    reference_interval: int = 50


@register_recipe
@dataclass(kw_only=True)
class NVFP4TransformerEngine(PrecisionConfig):
    """NVFP4 run natively by Transformer Engine: te.Linear under NVFP4BlockScaling.

    Needs transformer_engine and a GPU with FP4 tensor cores (SM 10.x); elsewhere apply_recipe
    raises and suggests precision=nvfp4, the bit-faithful emulation. Same layer selection as
    nvfp4: the last 8 pattern layers in BF16, the LM head in FP32.
    """

    name: str = "nvfp4_te"
    num_bf16_last_layers: int = 8
    """Pattern layers at the end of the stack kept in BF16 (at most a fifth of the layers)."""
    disable_rht: bool = False
    """No random Hadamard transform on the wgrad operands (``NVFP4BlockScaling(disable_rht=True)``)."""

    def build(self) -> Recipe:
        part = TransformerEngineNVFP4(disable_rht=self.disable_rht)
        return _recipe(self, {"fp4": part, **_HIGH}, _bf16_tail_rules(self.num_bf16_last_layers))


@register_recipe
@dataclass(kw_only=True)
class FP8TransformerEngine(PrecisionConfig):
    """Per-tensor FP8 run natively by Transformer Engine: te.Linear under Float8CurrentScaling.

    TE's default HYBRID format (E4M3 for X and W, E5M2 for dY), one FP32 scale per tensor from its
    current amax. Needs transformer_engine and an FP8 GPU (SM 8.9+: Hopper, Blackwell); elsewhere
    apply_recipe raises and suggests precision=fp8, the bit-faithful emulation. Every linear but the
    LM head in FP8, as Megatron (without ``--first-last-layers-bf16``) and TE do by default; the LM
    head in FP32.
    """

    name: str = "fp8_te"
    fp8_format: str = "hybrid"
    """TE's Format: 'hybrid' (E4M3 forward, E5M2 gradients; TE's default) or 'e4m3' (E4M3 everywhere)."""
    power_of_two_scales: bool = False
    """Per-tensor scales rounded down to a power of two (TE's ``QParams.power_2_scale``)."""
    num_bf16_last_layers: int = 0
    """Pattern layers at the end of the stack kept in BF16 (Megatron's ``--first-last-layers-bf16
    --num-layers-at-end-in-bf16``; at most a fifth of the layers)."""

    def build(self) -> Recipe:
        part = TransformerEngineFP8(
            scaling="current", fp8_format=self.fp8_format, power_of_two_scales=self.power_of_two_scales
        )
        return _recipe(self, {"fp8": part, **_HIGH}, _bf16_tail_rules(self.num_bf16_last_layers, "fp8"))


@register_recipe
@dataclass(kw_only=True)
class MXFP8TransformerEngine(PrecisionConfig):
    """MXFP8 run natively by Transformer Engine: te.Linear under MXFP8BlockScaling.

    E4M3 everywhere (TE's MXFP8 default format) in 32-element blocks along each GEMM's reduction
    dimension, an E8M0 (power-of-two) scale per block, each operand's row-wise and column-wise copies
    quantized from the BF16 tensor. Needs transformer_engine and a Blackwell GPU (SM 10.x); elsewhere
    apply_recipe raises and suggests precision=mxfp8, the bit-faithful emulation. Every linear but the
    LM head in MXFP8, as Megatron (without ``--first-last-layers-bf16``) and TE do by default; the LM
    head in FP32.
    """

    name: str = "mxfp8_te"
    fp8_format: str = "e4m3"
    """TE's Format: 'e4m3' (TE's MXFP8 default) or 'hybrid' (E5M2 gradients)."""
    num_bf16_last_layers: int = 0
    """Pattern layers at the end of the stack kept in BF16 (Megatron's ``--first-last-layers-bf16
    --num-layers-at-end-in-bf16``; at most a fifth of the layers)."""

    def build(self) -> Recipe:
        part = TransformerEngineFP8(scaling="mxfp8", fp8_format=self.fp8_format)
        return _recipe(self, {"fp8": part, **_HIGH}, _bf16_tail_rules(self.num_bf16_last_layers, "fp8"))


@register_recipe
@dataclass(kw_only=True)
class UE5M3(PrecisionConfig):
    """The UE5M3 paper's proposed recipe (Hu, Luschi, Balanca 2026).

    E2M1 values in 16-element blocks with unsigned E5M3 scales (T = 448), tensor references
    sampled and held for D = 50 steps, 16x16 2-D weight tiles, no Hadamard transform, 8-bit
    stochastic rounding on dY only, all 112 eligible linears in FP4 and the LM head in FP32.
    The wgrad dY of down_proj in layers 45, 47, 49 and 51 uses T = 2048 when the model has them.
    """

    name: str = "ue5m3"
    reference_interval: int = 50
    """D: steps a tensor reference (amax) is held; 0 = current scaling at every quantization."""
    scale_target: float = 448.0
    """T: block code of a block whose amax equals the tensor reference."""
    targeted_scale_target: float = 2048.0
    """T of the wgrad dY of down_proj in layers 45, 47, 49, 51."""
    block_size: int = 16
    """Elements per block along the reduction dimension."""
    gemm: str = "scaled"
    """'scaled' (block-scaled operands, BF16-speed), 'decoded' (FP32 dequantized) or 'hardware'."""

    def build(self) -> Recipe:
        def linear(target_dy_wgrad: float) -> LinearQuantConfig:
            config = _fp4_linear(
                scale_format="ue5m3",
                block_size=self.block_size,
                two_d_weights=True,
                dy_rounding="sr8",
                wgrad_hadamard=False,
                scale_target=self.scale_target,
                reference_interval=self.reference_interval,
                gemm=self.gemm,
            )
            if target_dy_wgrad == self.scale_target:
                return config
            return replace(config, dy_wgrad=replace(config.dy_wgrad, scale_target=target_dy_wgrad))

        parts = {"fp4": linear(self.scale_target), "fp4_t2048": linear(self.targeted_scale_target), **_HIGH}
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
        return _recipe(self, parts, rules)


@register_recipe
@dataclass(kw_only=True)
class UE5M3TESettings(PrecisionConfig):
    """UE5M3 scales with Transformer Engine's other settings (the paper's best-loss ablation).

    UE5M3 block scales (T = 448) with the reference refreshed every step (D = 1), 16x16 2-D
    weight tiles, a Hadamard transform on both wgrad operands, 8-bit stochastic rounding on dY,
    the last 8 pattern layers in BF16 and the LM head in FP32. The amaxes of the transformed X^T
    and dY^T are current (measured at every call, as the paper's ``_ProbeMatchedUE5M3LinearFunction``
    does), not held for the step.
    """

    name: str = "ue5m3_te_settings"
    reference_interval: int = 1
    """D: steps a tensor reference (amax) is held; 0 = current scaling at every quantization."""
    scale_target: float = 448.0
    """T: block code of a block whose amax equals the tensor reference."""
    num_bf16_last_layers: int = 8
    """Pattern layers at the end of the stack kept in BF16 (at most a fifth of the layers)."""
    gemm: str = "scaled"
    """'scaled' (block-scaled operands, BF16-speed), 'decoded' (FP32 dequantized) or 'hardware'."""

    def build(self) -> Recipe:
        fp4 = _fp4_linear(
            scale_format="ue5m3",
            block_size=16,
            two_d_weights=True,
            dy_rounding="sr8",
            wgrad_hadamard=True,
            scale_target=self.scale_target,
            reference_interval=self.reference_interval,
            gemm=self.gemm,
        )
        fp4 = replace(  # the transformed operands' amaxes are current, as the paper measures them
            fp4,
            x_wgrad=replace(fp4.x_wgrad, reference_interval=0),
            dy_wgrad=replace(fp4.dy_wgrad, reference_interval=0),
        )
        return _recipe(self, {"fp4": fp4, **_HIGH}, _bf16_tail_rules(self.num_bf16_last_layers))


@register_recipe
@dataclass(kw_only=True)
class NVFP4AllFP4NoRHT(PrecisionConfig):
    """The paper's unstable ablation: NVFP4 without the Hadamard transform and with all linears in FP4.

    E4M3 scales with current tensor scaling, 16x16 2-D weights and stochastic rounding on dY
    as in nvfp4, but no RHT and no BF16 tail: all 112 eligible linears in FP4, LM head in FP32.
    """

    name: str = "nvfp4_all_fp4_no_rht"
    reference_interval: int = 0
    """D: steps a tensor reference (amax) is held; 0 = current scaling at every quantization."""
    scale_target: float = 448.0
    """T: block code of a block whose amax equals the tensor reference (TE's fixed 448)."""
    gemm: str = "scaled"
    """'scaled' (block-scaled operands, BF16-speed), 'decoded' (FP32 dequantized) or 'hardware'."""

    def build(self) -> Recipe:
        fp4 = _fp4_linear(
            scale_format="e4m3",
            block_size=16,
            two_d_weights=True,
            dy_rounding="sr",
            wgrad_hadamard=False,
            scale_target=self.scale_target,
            reference_interval=self.reference_interval,
            gemm=self.gemm,
        )
        return _recipe(self, {"fp4": fp4, **_HIGH}, _bf16_tail_rules(0))


@register_recipe
@dataclass(kw_only=True)
class MXFP4(PrecisionConfig):
    """OCP MXFP4 with the NVFP4 paper's training methodology, for comparison studies.

    E2M1 values in 32-element blocks with power-of-two UE8M0 scales and no tensor scale, 1-D
    blocks along each GEMM's reduction dimension for every operand (weights included, as the
    MX format defines), stochastic rounding on dY, a Hadamard transform on both wgrad
    operands, the last 8 pattern layers in BF16 and the LM head in FP32.
    """

    name: str = "mxfp4"
    block_size: int = 32
    """Elements per block along the reduction dimension."""
    num_bf16_last_layers: int = 8
    """Pattern layers at the end of the stack kept in BF16 (at most a fifth of the layers)."""
    gemm: str = "scaled"
    """'scaled' (block-scaled operands, BF16-speed), 'decoded' (FP32 dequantized) or 'hardware'."""

    def build(self) -> Recipe:
        # No tensor reference (UE8M0 scales are absolute): no reference_interval or scale_target knob.
        fp4 = _fp4_linear(
            scale_format="ue8m0",
            block_size=self.block_size,
            two_d_weights=False,
            dy_rounding="sr",
            wgrad_hadamard=True,
            scale_target=448.0,
            reference_interval=0,
            gemm=self.gemm,
        )
        return _recipe(self, {"fp4": fp4, **_HIGH}, _bf16_tail_rules(self.num_bf16_last_layers))


FP8_FORMATS = ("hybrid", "e4m3")
"""Transformer Engine's ``Format`` choices for FP8 training: HYBRID (E4M3 forward, E5M2 gradients) or E4M3."""


def _fp8_linear(*, scale_format: str, block_size: int, fp8_format: str, gemm: str, **scaling) -> LinearQuantConfig:
    """One FP8 linear as Transformer Engine quantizes it: X and W in E4M3, dY in E5M2 (``hybrid``) or
    E4M3, round-to-nearest-even, each operand along its own GEMM's reduction dim, current scaling."""
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format={fp8_format!r}; valid: {', '.join(FP8_FORMATS)}")

    def op(element: str) -> OperandQuant:
        return OperandQuant(scale_format=scale_format, block_size=block_size, element_format=element, **scaling)

    forward, backward = op("e4m3"), op("e5m2" if fp8_format == "hybrid" else "e4m3")
    return LinearQuantConfig(x=forward, w=forward, dy_dgrad=backward, dy_wgrad=backward, x_wgrad=forward, gemm=gemm)


@register_recipe
@dataclass(kw_only=True)
class FP8(PrecisionConfig):
    """Per-tensor FP8 with current scaling, as Transformer Engine's Float8CurrentScaling, emulated.

    X and W in E4M3, dY in E5M2 (TE's default HYBRID format), one float32 scale per tensor from its
    current amax (``scale = max / amax``; 448 for E4M3, 57,344 for E5M2), round-to-nearest-even with
    saturation; every linear but the LM head in FP8 (Megatron's and TE's default), the LM head in FP32.
    """

    name: str = "fp8"
    fp8_format: str = "hybrid"
    """'hybrid' (E4M3 forward, E5M2 gradients; TE's default) or 'e4m3' (E4M3 everywhere)."""
    power_of_two_scales: bool = False
    """Per-tensor scales rounded down to a power of two (TE's ``use_power_2_scales``)."""
    num_bf16_last_layers: int = 0
    """Pattern layers at the end of the stack kept in BF16 (at most a fifth of the layers)."""
    gemm: str = "scaled"
    """'scaled' (FP8 operands, FP32 accumulation, the scale product after it) or 'decoded'."""

    def build(self) -> Recipe:
        fp8 = _fp8_linear(
            scale_format="fp32",
            block_size=16,
            fp8_format=self.fp8_format,
            gemm=self.gemm,
            power_of_two_scale=self.power_of_two_scales,
        )
        return _recipe(self, {"fp8": fp8, **_HIGH}, _bf16_tail_rules(self.num_bf16_last_layers, "fp8"))


@register_recipe
@dataclass(kw_only=True)
class MXFP8(PrecisionConfig):
    """OCP MXFP8 as Transformer Engine's MXFP8BlockScaling, emulated.

    E4M3 values (gradients too: TE's default E4M3 format) in 32-element blocks along each GEMM
    operand's own reduction dimension, a power-of-two UE8M0 scale per block rounded up from
    ``amax * fp32(1/448)`` (TE's and cuBLAS's rule; torchao's default is OCP's floor exponent:
    ``mx_scale_mode=floor``), no tensor scale, round-to-nearest-even with saturation; every linear
    but the LM head in MXFP8, the LM head in FP32.
    """

    name: str = "mxfp8"
    fp8_format: str = "e4m3"
    """'e4m3' (TE's MXFP8 default) or 'hybrid' (E5M2 gradients)."""
    mx_scale_mode: str = "ceil"
    """'ceil' (Transformer Engine: the block scale never lets a value saturate) or 'floor' (OCP's
    reference and torchao's default: ``floor(log2(amax)) - 8``, which can saturate the block's largest)."""
    num_bf16_last_layers: int = 0
    """Pattern layers at the end of the stack kept in BF16 (at most a fifth of the layers)."""
    gemm: str = "scaled"
    """'scaled' (block-scaled operands, FP32 accumulation) or 'decoded'."""

    def build(self) -> Recipe:
        fp8 = _fp8_linear(
            scale_format="ue8m0",
            block_size=32,
            fp8_format=self.fp8_format,
            gemm=self.gemm,
            mx_scale_mode=self.mx_scale_mode,
        )
        return _recipe(self, {"fp8": fp8, **_HIGH}, _bf16_tail_rules(self.num_bf16_last_layers, "fp8"))


def emulated_recipe(part: Part) -> PrecisionConfig | None:
    """The emulated recipe, at the part's settings, that computes what a Transformer Engine part runs
    natively: nvfp4 for NVFP4BlockScaling, fp8 for Float8CurrentScaling, mxfp8 for MXFP8BlockScaling
    (TE's round-up E8M0 scales); None for any other part."""
    if part.kind == "te_nvfp4":
        return NVFP4(disable_rht=part.disable_rht)
    if part.kind == "te_fp8" and part.scaling == "current":
        return FP8(fp8_format=part.fp8_format, power_of_two_scales=part.power_of_two_scales)
    if part.kind == "te_fp8":
        return MXFP8(fp8_format=part.fp8_format)
    return None


def emulated_config(part: Part) -> LinearQuantConfig | None:
    """The emulated config whose numerics and saves stand for ``part``: itself for an emulated part, the
    linear config of :func:`emulated_recipe` for a Transformer Engine part, None for BF16/FP32."""
    if part.kind == "fp4":
        return part
    emulation = emulated_recipe(part)
    if emulation is None:
        return None
    return next(p for p in emulation.build().parts.values() if p.kind == "fp4")
