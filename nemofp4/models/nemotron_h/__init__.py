"""Nemotron-H hybrid Mamba-2 / attention model."""

from .config import MLP_ACTIVATIONS, PRESETS, LayerType, NemotronHConfig, get_model_config, parse_pattern
from .hf_adapter import (
    INIT_ONLY_FIELDS,
    check_exportable,
    config_mismatches,
    export_hf,
    from_hf_config,
    from_hf_state_dict,
    hf_names,
    hf_tensor_headers,
    hf_weight_files,
    import_hf,
    read_hf_config,
    to_hf_config,
    to_hf_state_dict,
)
from .model import MLP, Attention, Block, Mamba2Mixer, NemotronHModel, SwiGLUMLP, build_model
from .ssd import ssd_chunked, ssd_reference, ssd_scan

__all__ = [
    "INIT_ONLY_FIELDS",
    "MLP_ACTIVATIONS",
    "PRESETS",
    "Attention",
    "Block",
    "LayerType",
    "MLP",
    "Mamba2Mixer",
    "NemotronHConfig",
    "NemotronHModel",
    "SwiGLUMLP",
    "build_model",
    "check_exportable",
    "config_mismatches",
    "export_hf",
    "from_hf_config",
    "from_hf_state_dict",
    "get_model_config",
    "hf_names",
    "hf_tensor_headers",
    "hf_weight_files",
    "import_hf",
    "parse_pattern",
    "read_hf_config",
    "ssd_chunked",
    "ssd_reference",
    "ssd_scan",
    "to_hf_config",
    "to_hf_state_dict",
]
