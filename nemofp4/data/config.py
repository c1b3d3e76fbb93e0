"""Typed data configuration (``configs/data/*.yaml`` are instances of :class:`DataConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

SHIPPED_TRAIN_PREFIX = "data/tokens/austen_train"
SHIPPED_VALIDATION_PREFIX = "data/tokens/austen_validation"
SHIPPED_TOKENIZER = "data/tokenizer"
VERIFY_LEVELS = ("sizes", "index", "full")


@dataclass(kw_only=True)
class DataSourceConfig:
    """One dataset of the blend."""

    prefix: str
    """Training token files: ``<prefix>.manifest.json`` (output of nemofp4-preprocess, possibly
    sharded) or a bare Megatron ``<prefix>.bin``/``.idx`` pair."""
    weight: float = 1.0
    """Relative share of training samples (weights are normalized over the sources)."""
    validation_prefix: str = ""
    """Separate validation token files. When empty, validation documents are held out of
    ``prefix`` by ``DataConfig.validation_fraction``."""
    name: str = ""
    """Label for logs and error messages (default: the prefix)."""


def _shipped_sources() -> list[DataSourceConfig]:
    return [DataSourceConfig(prefix=SHIPPED_TRAIN_PREFIX, validation_prefix=SHIPPED_VALIDATION_PREFIX, name="austen")]


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokens come from and how they are split, cached and loaded.

    The sample order itself is fixed by the arguments of ``build_train_loader`` (seq_len,
    num_samples, seed); this config says which data and how to read it.
    """

    sources: list[DataSourceConfig] = field(default_factory=_shipped_sources)
    """The datasets and their blend weights (default: the shipped Austen corpus)."""
    tokenizer: str = SHIPPED_TOKENIZER
    """``tokenizer.json`` or a folder holding one; the data must have been tokenized with it
    (checked against the manifest's tokenizer hash and largest token id)."""
    tokenizer_mismatch: str = "error"
    """When a manifest records another tokenizer hash than ``tokenizer``'s: ``error`` (the ids
    would mean other tokens) or ``warn`` (for a tokenizer known to be equivalent)."""
    eod_token: str = ""
    """Override the tokenizer's end-of-document token."""
    seq_len: int = 0
    """Sequence length the data is meant for; 0 = whatever the trainer passes. When set, the
    trainer's value must agree (a guard against silently training on different packing)."""
    validation_fraction: float = 0.0
    """Fraction of documents held out for validation from sources without a validation_prefix.
    A document is held out by a hash of (its id, validation_split_seed), so the split never
    depends on the training seed."""
    validation_split_seed: int = 0
    """Salt of the held-out document hash."""
    validation_seed: int = 0
    """Seed of the validation sequences' document order (fixed, so every eval sees the same set)."""
    cache_dir: str = "data/cache"
    """Where sample/blend indices are cached (keyed by a hash of their description). Must be
    shared by all ranks of a node (rank 0 builds, others load)."""
    num_workers: int = 0
    """DataLoader worker processes reading samples (0 = in the training process)."""
    pin_memory: bool = True
    """Pin host batches (only when CUDA is available)."""
    prefetch_factor: int = 2
    """Micro-batches each worker prepares ahead (num_workers > 0)."""
    verify: str = "index"
    """Checks when opening sharded data: ``sizes`` (file sizes against the manifest), ``index``
    (also the .idx checksums) or ``full`` (also the .bin checksums: reads every token)."""

    def check(self) -> None:
        if not self.sources:
            raise ValueError("data.sources is empty: give at least one {prefix, weight} entry")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"data.validation_fraction must be in [0, 1), got {self.validation_fraction}")
        if self.verify not in VERIFY_LEVELS:
            raise ValueError(f"data.verify must be one of {VERIFY_LEVELS}, got {self.verify!r}")
        if self.num_workers < 0 or self.prefetch_factor < 1:
            raise ValueError(
                f"data.num_workers must be >= 0 and prefetch_factor >= 1, got {self.num_workers}, {self.prefetch_factor}"
            )
        if self.tokenizer_mismatch not in ("error", "warn"):
            raise ValueError(f"data.tokenizer_mismatch must be 'error' or 'warn', got {self.tokenizer_mismatch!r}")
        if self.seq_len < 0:
            raise ValueError(f"data.seq_len must be >= 0 (0 = set by the trainer), got {self.seq_len}")


def as_data_config(cfg) -> DataConfig:
    """Accept a DataConfig or an OmegaConf node / dict with its fields."""
    if isinstance(cfg, DataConfig):
        return cfg
    from omegaconf import OmegaConf

    node = OmegaConf.merge(OmegaConf.structured(DataConfig), cfg)
    return OmegaConf.to_object(node)
