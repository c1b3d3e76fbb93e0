"""Nemotron-H hybrid Mamba-2 / attention model."""

from .config import PRESETS, LayerType, NemotronHConfig, get_model_config, parse_pattern
from .hf_adapter import (
    export_hf,
    from_hf_config,
    from_hf_state_dict,
    import_hf,
    to_hf_config,
    to_hf_state_dict,
)
from .model import MLP, Attention, Block, Mamba2Mixer, NemotronHModel, build_model
from .ssd import ssd_chunked, ssd_reference, ssd_scan

__all__ = [
    "PRESETS",
    "Attention",
    "Block",
    "LayerType",
    "MLP",
    "Mamba2Mixer",
    "NemotronHConfig",
    "NemotronHModel",
    "build_model",
    "export_hf",
    "from_hf_config",
    "from_hf_state_dict",
    "get_model_config",
    "import_hf",
    "parse_pattern",
    "ssd_chunked",
    "ssd_reference",
    "ssd_scan",
    "to_hf_config",
    "to_hf_state_dict",
]
