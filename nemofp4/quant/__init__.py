"""FP4 training linears: QuantLinear (one autograd.Function, three quantized GEMMs), the tensor
reference (amax) state, and the model-level controls the trainer calls.

    from nemofp4.quant import QuantLinear, QuantTraining, QuantTrainingConfig
    quant = QuantTraining(model, QuantTrainingConfig(kernels="auto", seed=seed, rank=rank))   # once, at build
    with quant.step(step): ...   # each optimizer step's forward and backward passes
    get_model_state_dict(model)   # the weights and each FP4 linear's held references (its extra state)
    saved = snapshot(model); hold(model, "x", amaxes); ...; restore(model, saved)   # the quant-state API
"""

from .checkpoint import MODULE_STATE, read_references, references_layout_problem
from .config import GEMM_MODES, ROUNDING_MODES, SCALE_FORMATS, LinearQuantConfig, OperandQuant, Role
from .gemm import GemmOperand, decoded_gemm, gemm, reference_gemm, scaled_gemm
from .linear import FP32Linear, QuantLinear
from .linear_op import run_inside_for
from .reference import HeldReference, ReferenceState
from .state import (
    WRAPPER_SEGMENTS,
    QuantSnapshot,
    cached_weights,
    canonical_fqn,
    drop_nonfinite_references,
    held_amaxes,
    hold,
    load_reference_state_dict,
    override_interval,
    quant_linears,
    quant_stats,
    reference_state_dict,
    references_by_module,
    reset_references,
    restore,
    set_amax_reduce_group,
    set_held_reference_reduce_group,
    set_quant_backend,
    set_quant_stats,
    set_step,
    snapshot,
    without_quant_state,
)
from .te_linear import TE_RECIPES, TELinear, TENVFP4Linear, TERecipe, transformer_engine_status
from .training import QuantTraining, QuantTrainingConfig

__all__ = [
    "GEMM_MODES",
    "MODULE_STATE",
    "ROUNDING_MODES",
    "SCALE_FORMATS",
    "TE_RECIPES",
    "WRAPPER_SEGMENTS",
    "FP32Linear",
    "GemmOperand",
    "HeldReference",
    "LinearQuantConfig",
    "OperandQuant",
    "QuantLinear",
    "QuantSnapshot",
    "QuantTraining",
    "QuantTrainingConfig",
    "cached_weights",
    "ReferenceState",
    "Role",
    "TELinear",
    "TENVFP4Linear",
    "TERecipe",
    "canonical_fqn",
    "decoded_gemm",
    "gemm",
    "held_amaxes",
    "hold",
    "load_reference_state_dict",
    "override_interval",
    "quant_linears",
    "quant_stats",
    "read_references",
    "references_layout_problem",
    "reference_gemm",
    "reference_state_dict",
    "references_by_module",
    "drop_nonfinite_references",
    "reset_references",
    "restore",
    "scaled_gemm",
    "set_amax_reduce_group",
    "set_held_reference_reduce_group",
    "set_quant_backend",
    "set_quant_stats",
    "set_step",
    "snapshot",
    "transformer_engine_status",
    "without_quant_state",
    "run_inside_for",
]
