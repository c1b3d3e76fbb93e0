"""FP4 training linears: QuantLinear (one autograd.Function, three quantized GEMMs), the tensor
reference (amax) state, and the model-level controls the trainer calls.

    from nemofp4.quant import QuantLinear, QuantState, set_step
    set_step(model, step, seed=seed, rank=rank)   # once per optimizer step, before forward
    dcp.save({"model": ..., "quant": QuantState(model)}, ...)   # held references, canonical names
    saved = snapshot(model); hold(model, "x", amaxes); ...; restore(model, saved)   # the quant-state API
"""

from .config import GEMM_MODES, ROUNDING_MODES, SCALE_FORMATS, LinearQuantConfig, OperandQuant, Role
from .gemm import GemmOperand, decoded_gemm, gemm, reference_gemm, scaled_gemm
from .linear import FP32Linear, QuantLinear
from .reference import HeldReference, ReferenceState
from .state import (
    WRAPPER_SEGMENTS,
    QuantSnapshot,
    QuantState,
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
    reset_references,
    restore,
    set_amax_reduce_group,
    set_held_reference_reduce_group,
    set_quant_backend,
    set_quant_stats,
    set_step,
    snapshot,
)
from .te_linear import TENVFP4Linear, transformer_engine_status

__all__ = [
    "GEMM_MODES",
    "ROUNDING_MODES",
    "SCALE_FORMATS",
    "WRAPPER_SEGMENTS",
    "FP32Linear",
    "GemmOperand",
    "HeldReference",
    "LinearQuantConfig",
    "OperandQuant",
    "QuantLinear",
    "QuantSnapshot",
    "QuantState",
    "cached_weights",
    "ReferenceState",
    "Role",
    "TENVFP4Linear",
    "canonical_fqn",
    "decoded_gemm",
    "gemm",
    "held_amaxes",
    "hold",
    "load_reference_state_dict",
    "override_interval",
    "quant_linears",
    "quant_stats",
    "reference_gemm",
    "reference_state_dict",
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
]
