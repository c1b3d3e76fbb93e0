"""What evaluation reads of a training run's resolved config, typed, without the training schema.

A checkpoint's ``trainer_state['config']`` (and ``<run_dir>/config.yaml``) holds the run's full
resolved config. Evaluation needs only the model, the recipe, the data and a few train/eval
settings; each is validated by its own dataclass, and those live below both packages (models,
recipes, data), so evaluation never imports the trainer's schema. The full schema is
``nemofp4.training.config.JobConfig`` (``job_config_from_yaml`` there).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from omegaconf import OmegaConf

from nemofp4.data import DataConfig
from nemofp4.models.nemotron_h.config import NemotronHConfig
from nemofp4.recipes import precision_config

__all__ = ["RunEvalSettings", "RunTrainSettings", "TrainedRunConfig", "run_config_from_yaml"]


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

    def __post_init__(self) -> None:
        self.precision = precision_config(self.precision)
        self.model = self.model.trained_on(self.train.seq_len)  # as the trainer records it (runs from before, too)


def run_config_from_yaml(text: str) -> TrainedRunConfig:
    """The :class:`TrainedRunConfig` of a run's resolved YAML; the keys evaluation does not read
    are left out before validation, the ones it reads are validated as at training time."""
    container = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    if not isinstance(container, dict):
        raise ValueError("a run's config must be a YAML mapping")
    picked: dict[str, Any] = {}
    for f in fields(TrainedRunConfig):
        if f.name not in container:
            raise ValueError(f"the run's config has no {f.name!r} section: not written by nemofp4's trainer")
        picked[f.name] = container[f.name]
    for section, cls in (("train", RunTrainSettings), ("eval", RunEvalSettings)):
        picked[section] = {f.name: picked[section][f.name] for f in fields(cls)}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainedRunConfig), picked))
