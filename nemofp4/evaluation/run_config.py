"""The one reader of a training run's saved config, and the typed view evaluation takes of it.

A checkpoint's ``trainer_state['config']`` (and ``<run_dir>/config.yaml``) holds the run's full
resolved config. :func:`saved_config` parses it (every reader of a saved config goes through it:
this view, the trainer's full schema ``nemofp4.training.config.job_config_from_yaml``, the resume
check in ``training/run_identity.py``); :func:`read_step_config` reads it from a step folder and
:func:`read_saved_config` from a file (``config.yaml``), each naming the file when it cannot.
Evaluation and ``train.init_from`` need only the model, the recipe, the data, the backend and a few
train/eval settings; each is validated by its own dataclass, and those live below both packages
(models, recipes, data), so evaluation never imports the trainer's schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from nemofp4.checkpointing import TRAINER_STATE, load_tensors
from nemofp4.data import DataConfig
from nemofp4.models.nemotron_h.config import NemotronHConfig
from nemofp4.recipes import precision_config

__all__ = [
    "RunDistributedSettings",
    "RunEvalSettings",
    "RunTrainSettings",
    "TrainedRunConfig",
    "read_saved_config",
    "read_step_config",
    "run_config_from_yaml",
    "saved_config",
]


@dataclass(kw_only=True)
class RunTrainSettings:
    """The run's ``train`` settings that evaluation uses."""

    seq_len: int
    """Tokens per sequence in training (the default evaluation length)."""
    seed: int
    """The run's seed (the held-out stream's)."""
    dtype: str
    """Training compute dtype (float32 or bfloat16)."""


@dataclass(kw_only=True)
class RunEvalSettings:
    """The run's ``eval`` settings that evaluation uses."""

    num_sequences: int
    """Size of the held-out stream the trainer evaluated on."""
    batch_size: int


@dataclass(kw_only=True)
class RunDistributedSettings:
    """The run's ``distributed`` settings that evaluation and ``train.init_from`` use."""

    backend: str = "none"
    """Which engine wrote its checkpoints (DeepSpeed's are not in DCP)."""


@dataclass(kw_only=True)
class TrainedRunConfig:
    """A training run as evaluation sees it (the keys of its resolved config that it reads)."""

    name: str
    run_dir: str
    model: NemotronHConfig
    precision: Any
    """The recipe's own typed config (a nemofp4.recipes.PrecisionConfig subclass)."""
    data: DataConfig
    train: RunTrainSettings
    eval: RunEvalSettings
    distributed: RunDistributedSettings = field(default_factory=RunDistributedSettings)

    def __post_init__(self) -> None:
        self.precision = precision_config(self.precision)
        self.model = self.model.trained_on(self.train.seq_len)  # as the trainer records it (runs from before, too)


def saved_config(saved: str | Mapping[str, Any]) -> dict[str, Any]:
    """A run's saved (resolved) config, its YAML text or a mapping already read (:func:`read_saved_config`),
    as a plain mapping, before any schema validates it."""
    node = OmegaConf.create(saved if isinstance(saved, str) else dict(saved))
    container = OmegaConf.to_container(node, resolve=True)
    if not isinstance(container, dict):
        raise ValueError("a run's config must be a YAML mapping")
    return container


def read_saved_config(path: Path) -> dict[str, Any]:
    """The saved config in the file ``path`` (a run directory's ``config.yaml``) as :func:`saved_config`
    gives it: FileNotFoundError when there is none, ValueError naming the file when it does not parse."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no saved run config (the trainer writes it when a run starts)") from None
    try:
        return saved_config(text)
    except Exception as err:  # YAML's and omegaconf's parse and interpolation errors are several types
        raise ValueError(
            f"{path}: not a readable run config ({type(err).__name__}: {err}); the trainer wrote a "
            "YAML mapping there: restore it, or remove it to start the run directory over"
        ) from err


def run_config_from_yaml(text: str) -> TrainedRunConfig:
    """The :class:`TrainedRunConfig` of a run's resolved YAML; the keys evaluation does not read
    are left out before validation, the ones it reads are validated as at training time."""
    container = saved_config(text)
    picked: dict[str, Any] = {}
    for f in fields(TrainedRunConfig):
        if f.name in container:
            picked[f.name] = container[f.name]
        elif f.default_factory is MISSING:
            raise ValueError(f"the run's config has no {f.name!r} section: not written by nemofp4's trainer")
    for section, cls in (("train", RunTrainSettings), ("eval", RunEvalSettings)):
        picked[section] = {f.name: picked[section][f.name] for f in fields(cls)}
    if "distributed" in picked:
        picked["distributed"] = {
            f.name: picked["distributed"][f.name]
            for f in fields(RunDistributedSettings)
            if f.name in picked["distributed"]
        }
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainedRunConfig), picked))


def read_step_config(folder: Path) -> tuple[TrainedRunConfig, dict[str, Any]]:
    """The run config and the trainer state saved in a checkpoint's step folder; ValueError when the
    trainer state names no config (not written by nemofp4's trainer)."""
    trainer_state = load_tensors(Path(folder) / TRAINER_STATE)
    if not isinstance(trainer_state, dict) or "config" not in trainer_state:
        raise ValueError(f"{Path(folder) / TRAINER_STATE} has no 'config': not written by nemofp4's trainer")
    return run_config_from_yaml(trainer_state["config"]), trainer_state
