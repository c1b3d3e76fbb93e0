"""Load a trained model for evaluation or export: our DCP checkpoints and transformers folders.

A checkpoint of ours is rebuilt exactly as the trainer built it: the model from the run's
saved config on the meta device, the run's precision recipe applied (so the FP4 linears are
there for the inference policies), then only the ``model`` part of the DCP state is read: the
weights and, under the run's own recipe, the FP4 linears' held references, read as the trainer's
resume reads them (:func:`nemofp4.quant.read_references`). The optimizer state, usually twice the
model's size, is never loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from nemofp4.checkpointing import (
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_tensors,
    read_marker,
    resolve_checkpoint,
    verify_files,
)
from nemofp4.models import NemotronHModel, build_model
from nemofp4.models.nemotron_h import import_hf
from nemofp4.quant import read_references
from nemofp4.recipes import PrecisionConfig, apply_recipe, recipe_from_config

from .run_config import TrainedRunConfig, read_step_config

__all__ = [
    "is_hf_folder",
    "load_checkpoint_model",
    "load_hf_model",
    "resolve_checkpoint",
    "resolve_device",
]

log = logging.getLogger("nemofp4")


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' -> the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def is_hf_folder(path: str | Path) -> bool:
    """A transformers model folder: config.json next to safetensors weights."""
    path = Path(path)
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def load_checkpoint_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    precision: PrecisionConfig | str | None = None,
    verify: bool = True,
    log_loaded: bool = True,
) -> tuple[NemotronHModel, TrainedRunConfig, dict[str, Any]]:
    """(model, the run's config as evaluation reads it, trainer_state) of a checkpoint of ours, in eval mode.

    Args:
        path: a step folder, a checkpoints folder or a run directory (its latest complete step).
        device: where the model is materialized.
        precision: apply this recipe (name or PrecisionConfig) instead of the run's own, e.g. "bf16"
            to evaluate FP4-trained weights in high precision.
        verify: check the files' sizes and checksums against the checkpoint's marker first.
        log_loaded: log what was loaded and the recipe it is evaluated under (a caller that does not
            evaluate, such as the export, says what it does itself).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    folder = resolve_checkpoint(path)
    if verify:
        marker = read_marker(folder)
        problems = verify_files(folder, sorted(marker["files"]), marker, checksums=True)
        if problems:
            raise CheckpointError(f"checkpoint {folder} is damaged: " + "; ".join(problems))
    cfg, trainer_state = read_step_config(folder)
    if isinstance(precision, str):
        precision = PrecisionConfig(name=precision)
    model = build_model(cfg.model, device="meta")
    apply_recipe(model, recipe_from_config(precision or cfg.precision), log=False)
    model.to_empty(device=device)
    state = {"model": get_model_state_dict(model)}
    rank_file = folder / "rank" / "rank-00000.pt"  # per-rank references: rank 0's, as a rank new to a run takes

    def read(state: dict[str, Any] | None) -> None:
        # the optimizer state is not read; nothing is unpickled beyond DCP's metadata types and tensors
        reader = SafeFileSystemReader(str(folder))
        reader.read_metadata()  # a planted metadata pickle fails here, by name
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())

    # the model state as the trainer reads it (any layout), its references under the run's own recipe only
    try:
        read_references(
            model,
            state,
            read,
            trainer_state=trainer_state,
            restore=precision is None,
            rank_state=load_tensors(rank_file) if rank_file.is_file() else {},
        )
    except ValueError as err:
        raise ValueError(f"checkpoint {folder}: {err}") from None
    set_model_state_dict(model, state["model"])
    model.eval()
    used = (precision or cfg.precision).name
    if log_loaded:
        log.info(
            "loaded %s (step %s, trained with recipe %s%s)",
            folder,
            trainer_state.get("step"),
            cfg.precision.name,
            "" if used == cfg.precision.name else f", evaluated as {used}",
        )
    return model, cfg, trainer_state


def load_hf_model(
    path: str | Path, *, device: str | torch.device = "cpu", precision: PrecisionConfig | str = "bf16"
) -> NemotronHModel:
    """Our model from a transformers NemotronH folder, with ``precision`` applied, in eval mode."""
    if isinstance(precision, str):
        precision = PrecisionConfig(name=precision)
    imported = import_hf(path, device="cpu")
    model = build_model(imported.config, device="meta")
    apply_recipe(model, recipe_from_config(precision), log=False)
    model.to_empty(device=device)
    model.load_state_dict(imported.state_dict(), strict=True)
    model.eval()
    return model
