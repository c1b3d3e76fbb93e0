"""Per-rank training loader and fixed validation batches.

Global batch ``g`` is samples ``[g * B, (g + 1) * B)`` of the blend (``B`` = global batch). It
is cut into ``dp_size`` contiguous rank slices, each slice into micro-batches that a rank
yields in order, so any (dp_size, micro_batch) with the same ``B`` sees the same global
batches. The resume state is the number of consumed samples (a multiple of ``B``) plus a
fingerprint of what fixes the sample order (data identity and split, seed, seq_len, ``B``);
loading a state with another fingerprint is an error that names what changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from nemofp4.data.config import DataConfig, as_data_config
from nemofp4.data.datasets import BlendedSequences, PackedSequences, split_documents
from nemofp4.data.manifest import open_token_source
from nemofp4.data.paths import resolve_path
from nemofp4.data.tokenizer import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)
STATE_VERSION = 1


def _check_tokenizer(source, tokenizer: LoadedTokenizer, mismatch: str = "error") -> None:
    source.check_vocab(tokenizer.vocab_size)
    if source.tokenizer_hash is not None and source.tokenizer_hash != tokenizer.hash:
        message = (
            f"{source.name} was tokenized with another tokenizer: its manifest records tokenizer hash "
            f"{source.tokenizer_hash[:12]}, data.tokenizer={tokenizer.path} has hash {tokenizer.hash[:12]}"
        )
        if mismatch == "error":
            raise ValueError(
                f"{message}; use the tokenizer the data was made with, or data.tokenizer_mismatch=warn "
                "for one known to be equivalent"
            )
        warnings.warn(message, stacklevel=3)


def check_model_vocab(cfg: DataConfig, vocab_size: int) -> None:
    """The model's embedding must cover every id the data's tokenizer can produce (checked at start).

    Otherwise the first out-of-range id is an IndexError deep in the embedding (a device-side
    assert on GPU), steps into the run.
    """
    cfg = as_data_config(cfg)
    tokenizer = load_tokenizer(resolve_path(cfg.tokenizer), eod_token=cfg.eod_token or None)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"model.vocab_size={vocab_size} is smaller than the vocabulary of data.tokenizer={tokenizer.path} "
            f"({tokenizer.vocab_size} tokens): ids up to {tokenizer.vocab_size - 1} would index past the "
            f"embedding; set model.vocab_size >= {tokenizer.vocab_size}"
        )


def _split_spec(cfg: DataConfig, source_cfg, validation: bool) -> tuple[str, dict]:
    """(prefix, split description) of a source's train or validation documents."""
    if validation and source_cfg.validation_prefix:
        return source_cfg.validation_prefix, {"all": True}
    if cfg.validation_fraction > 0 and not source_cfg.validation_prefix:
        part = "validation" if validation else "train"
        return source_cfg.prefix, {
            "holdout": part,
            "fraction": cfg.validation_fraction,
            "salt": cfg.validation_split_seed,
        }
    if validation:
        raise ValueError(
            f"data source {source_cfg.name or source_cfg.prefix!r} has no validation documents: "
            "set its validation_prefix or data.validation_fraction > 0"
        )
    return source_cfg.prefix, {"all": True}


def _build_blend(
    cfg: DataConfig, *, seq_len: int, num_samples: int, seed: int, validation: bool
) -> tuple[BlendedSequences, list[dict]]:
    cfg.check()
    if cfg.seq_len and cfg.seq_len != seq_len:
        raise ValueError(f"data.seq_len={cfg.seq_len} disagrees with the trainer's seq_len={seq_len}")
    tokenizer = load_tokenizer(resolve_path(cfg.tokenizer), eod_token=cfg.eod_token or None)
    weights = [s.weight for s in cfg.sources]
    prepared = []
    identities = []
    for source_cfg in cfg.sources:
        prefix, split = _split_spec(cfg, source_cfg, validation)
        source = open_token_source(prefix, verify=cfg.verify)
        if source_cfg.name:
            source.name = source_cfg.name
        _check_tokenizer(source, tokenizer, cfg.tokenizer_mismatch)
        prepared.append((source, split))
        identities.append({"source": source.identity, "split": split, "weight": source_cfg.weight})
    blend_description = {"sources": identities, "seed": seed, "seq_len": seq_len}
    cache_dir = str(resolve_path(cfg.cache_dir))
    needed = BlendedSequences.samples_needed(weights, num_samples, cache_dir, blend_description)
    datasets = []
    for (source, split), count in zip(prepared, needed):
        if split.get("all"):
            documents = source.num_documents  # ids 0..n-1, never materialized
        else:  # computed on rank 0 only, unless a rank has to build the cache itself
            documents = functools.partial(
                split_documents,
                source.num_documents,
                split["fraction"],
                split["salt"],
                split["holdout"] == "validation",
            )
        datasets.append(
            PackedSequences(
                source,
                split=split,
                documents=documents,
                seq_len=seq_len,
                num_samples=count,
                seed=seed,
                cache_dir=cache_dir,
                vocab_size=tokenizer.vocab_size,
            )
        )
        if validation and datasets[-1].epochs > 1:
            log.warning(
                "%s: %d validation sequences of %d tokens repeat its documents (%d passes)",
                source.name,
                count,
                seq_len,
                datasets[-1].epochs,
            )
    return BlendedSequences(datasets, weights, num_samples, cache_dir, blend_description), identities


def _to_batch(samples: list[np.ndarray]) -> dict[str, torch.Tensor]:
    tokens = torch.from_numpy(np.stack(samples))
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


class _RankMicroBatches(torch.utils.data.Dataset):
    """Micro-batch ``j`` (counted from step 0) of one data-parallel rank, as a batch dict."""

    def __init__(self, blend: BlendedSequences, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int):
        self.blend, self.global_batch, self.micro_batch = blend, global_batch, micro_batch
        self.rank_samples = global_batch // dp_size
        self.rank_offset = dp_rank * self.rank_samples
        self.per_step = self.rank_samples // micro_batch

    def sample_ids(self, j: int) -> range:
        step, micro = divmod(j, self.per_step)
        first = step * self.global_batch + self.rank_offset + micro * self.micro_batch
        return range(first, first + self.micro_batch)

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        return _to_batch([self.blend[k] for k in self.sample_ids(j)])


class TrainLoader:
    """Iterable over this rank's micro-batches, from the resume point to the end of the budget.

    Each item is ``{"input_ids": LongTensor[micro_batch, seq_len], "labels": ...}``. The state is
    valid between global batches (after the last micro-batch of a step).
    """

    def __init__(
        self,
        blend: BlendedSequences,
        *,
        fingerprint_fields: dict,
        global_batch: int,
        micro_batch: int,
        num_samples: int,
        dp_rank: int,
        dp_size: int,
        num_workers: int = 0,
        pin_memory: bool = True,
        prefetch_factor: int = 2,
        device: torch.device | str | None = None,
    ):
        self.micro_batches = _RankMicroBatches(blend, global_batch, micro_batch, dp_rank, dp_size)
        self.fingerprint_fields = fingerprint_fields
        self.fingerprint = hashlib.sha256(json.dumps(fingerprint_fields, sort_keys=True).encode()).hexdigest()
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_steps = num_samples // global_batch
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.device = torch.device(device) if device is not None else None
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.consumed_samples = 0
        self._yielded_in_step = 0

    @property
    def micro_batches_per_step(self) -> int:
        return self.micro_batches.per_step

    def __len__(self) -> int:
        """Micro-batches left to yield from the current position."""
        return (self.num_steps - self.consumed_samples // self.global_batch) * self.micro_batches_per_step

    def _host_batches(self, first_micro: int) -> Iterator[dict[str, torch.Tensor]]:
        total = self.num_steps * self.micro_batches_per_step
        if self.num_workers == 0:
            for j in range(first_micro, total):
                batch = self.micro_batches[j]
                yield {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch
            return
        loader = torch.utils.data.DataLoader(
            self.micro_batches,
            batch_size=None,
            sampler=range(first_micro, total),
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
        )
        yield from loader

    def _device_batches(self, host: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """Copy the next micro-batch to the GPU on a side stream while the current one is used."""
        if self.device is None or self.device.type != "cuda":
            yield from host if self.device is None else ({k: v.to(self.device) for k, v in b.items()} for b in host)
            return
        stream = torch.cuda.Stream(device=self.device)

        def launch(batch):
            with torch.cuda.stream(stream):
                return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

        pending = None
        for batch in host:
            ready = launch(batch)
            if pending is not None:
                torch.cuda.current_stream(self.device).wait_stream(stream)
                yield pending
            pending = ready
        if pending is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            yield pending

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._yielded_in_step:
            raise RuntimeError("a TrainLoader is iterated once per resume point; build a new one or load_state_dict")
        first_micro = self.consumed_samples // self.global_batch * self.micro_batches_per_step
        for batch in self._device_batches(self._host_batches(first_micro)):
            self._yielded_in_step += 1
            if self._yielded_in_step == self.micro_batches_per_step:
                self._yielded_in_step = 0
                self.consumed_samples += self.global_batch
            yield batch

    def state_dict(self) -> dict:
        if self._yielded_in_step:
            raise ValueError(
                f"state_dict() after {self._yielded_in_step} of {self.micro_batches_per_step} micro-batches of a "
                "global batch; save the loader state between optimizer steps"
            )
        return {
            "version": STATE_VERSION,
            "consumed_samples": self.consumed_samples,
            "fingerprint": self.fingerprint,
            "fingerprint_fields": self.fingerprint_fields,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')!r}, expected {STATE_VERSION}")
        if state["fingerprint"] != self.fingerprint:
            saved = state.get("fingerprint_fields", {})
            changed = sorted(
                k for k in set(saved) | set(self.fingerprint_fields) if saved.get(k) != self.fingerprint_fields.get(k)
            )
            details = "; ".join(f"{k}: saved {saved.get(k)!r}, now {self.fingerprint_fields.get(k)!r}" for k in changed)
            raise ValueError(
                f"the checkpoint's data loader state was made for other data settings ({details}); resuming would "
                "silently change the sample order. Restore those settings, or start a new run"
            )
        consumed = int(state["consumed_samples"])
        if consumed % self.global_batch or consumed > self.num_steps * self.global_batch:
            raise ValueError(f"consumed_samples={consumed} is not a step boundary within this loader's budget")
        self.consumed_samples = consumed
        self._yielded_in_step = 0


def build_train_loader(
    cfg: DataConfig,
    *,
    seq_len: int,
    global_batch: int,
    micro_batch: int,
    num_samples: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    device: torch.device | str | None = None,
) -> TrainLoader:
    """A resumable per-rank loader over ``num_samples`` blended samples (``num_samples // global_batch`` steps)."""
    cfg = as_data_config(cfg)
    if global_batch % (dp_size * micro_batch):
        raise ValueError(
            f"global_batch={global_batch} must be a multiple of dp_size * micro_batch = {dp_size} * {micro_batch}"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if num_samples < global_batch:
        raise ValueError(f"num_samples={num_samples} is less than one global batch ({global_batch})")
    blend, identities = _build_blend(cfg, seq_len=seq_len, num_samples=num_samples, seed=seed, validation=False)
    fields = {"data": identities, "seed": seed, "seq_len": seq_len, "global_batch": global_batch}
    return TrainLoader(
        blend,
        fingerprint_fields=fields,
        global_batch=global_batch,
        micro_batch=micro_batch,
        num_samples=num_samples,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory,
        prefetch_factor=cfg.prefetch_factor,
        device=device,
    )


def build_validation_batches(
    cfg: DataConfig, *, seq_len: int, num_sequences: int, batch_size: int
) -> list[dict[str, torch.Tensor]]:
    """The fixed validation set: ``ceil(num_sequences / batch_size)`` batches (the last may be smaller)."""
    cfg = as_data_config(cfg)
    if num_sequences < 1 or batch_size < 1:
        raise ValueError(f"num_sequences and batch_size must be positive, got {num_sequences}, {batch_size}")
    blend, _ = _build_blend(cfg, seq_len=seq_len, num_samples=num_sequences, seed=cfg.validation_seed, validation=True)
    samples = [blend[k] for k in range(num_sequences)]
    return [_to_batch(samples[i : i + batch_size]) for i in range(0, num_sequences, batch_size)]
