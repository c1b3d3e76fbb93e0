"""Read the held tensor references of a checkpoint folder (its DCP "quant" entry), without a model."""

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader


def held_references(folder: Path) -> dict[str, torch.Tensor]:
    """'<canonical fqn>.<ref>.amax' / '.refresh_step' -> tensor, as :class:`nemofp4.quant.QuantState` saved them."""
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if k.startswith("quant.")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return {k.removeprefix("quant."): v for k, v in state.items()}
