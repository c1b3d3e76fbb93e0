"""Packed ``seq_len + 1``-token samples of one source, and blends of several sources."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nemofp4.data.blending import build_blend_index, normalize_weights
from nemofp4.data.cache import cached_arrays, rank_zero_value
from nemofp4.data.indexed import CorruptDataError, bin_path
from nemofp4.data.manifest import TokenSource
from nemofp4.data.sample_index import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    plan_sample_index,
    read_sample,
)

log = logging.getLogger(__name__)
HOLDOUT_CHUNK = 1 << 24


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def holdout_mask(doc_ids: np.ndarray, fraction: float, salt: int) -> np.ndarray:
    """True for held-out (validation) documents: a hash of (id, salt) below ``fraction``."""
    hashed = _splitmix64(doc_ids.astype(np.uint64) ^ _splitmix64(np.array([salt], dtype=np.uint64)))
    return (hashed >> np.uint64(11)).astype(np.float64) < fraction * 2.0**53


def split_documents(num_documents: int, fraction: float, salt: int, validation: bool) -> np.ndarray:
    """Ids of the train (or validation) documents of a source, computed chunk by chunk."""
    dtype = np.int32 if num_documents < 2**31 else np.int64
    if fraction == 0.0:
        return np.arange(num_documents if not validation else 0, dtype=dtype)
    parts = []
    for start in range(0, num_documents, HOLDOUT_CHUNK):
        ids = np.arange(start, min(start + HOLDOUT_CHUNK, num_documents), dtype=dtype)
        mask = holdout_mask(ids, fraction, salt)
        parts.append(ids[mask if validation else ~mask])
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


class PackedSequences:
    """Samples of ``seq_len + 1`` tokens from one source's documents, in served order.

    ``documents`` selects the source's documents (an id array, a callable returning one, or a
    count for all of them); ``split`` describes that selection for the cache key. Under
    torch.distributed only rank 0 evaluates the selection and counts its tokens; the other ranks
    take the counts from it and load the cached index, computing the selection only if they must
    build the cache themselves. Item ``k`` is the ``k``-th served sample, as int64.
    """

    def __init__(
        self,
        source: TokenSource,
        *,
        split: dict,
        documents: np.ndarray | Callable[[], np.ndarray] | int,
        seq_len: int,
        num_samples: int,
        seed: int,
        cache_dir: str,
        vocab_size: int,
    ):
        self.source, self.seq_len, self.vocab_size = source, seq_len, vocab_size
        selected: list[np.ndarray] = []

        def selection() -> np.ndarray | int:
            if isinstance(documents, int) or not callable(documents):
                return documents
            if not selected:
                selected.append(documents())
            return selected[0]

        def count_tokens() -> tuple[int, int]:
            docs = selection()
            if isinstance(docs, int):  # all documents
                return docs, source.num_tokens
            all_lengths = source.all_document_lengths()
            tokens = int(
                sum(
                    int(all_lengths[docs[i : i + HOLDOUT_CHUNK]].sum(dtype=np.int64))
                    for i in range(0, docs.size, HOLDOUT_CHUNK)
                )
            )
            return docs.size, tokens

        count, tokens = rank_zero_value(count_tokens)
        if count == 0:
            raise ValueError(f"{source.name}: the {split} split selects no documents")
        if tokens == 0:
            raise ValueError(f"{source.name}: the {split} split has no tokens")
        self.plan = plan_sample_index(tokens, count, seq_len, num_samples)
        description = {
            "source": source.identity,
            "split": split,
            "seq_len": seq_len,
            "seed": seed,
            "samples_per_window": self.plan.samples_per_window,
            "num_windows": self.plan.num_windows,
        }

        def build() -> dict[str, np.ndarray]:
            document_index = build_document_index(selection(), self.plan.num_epochs, seed)
            all_lengths = source.all_document_lengths()
            sample_index = build_sample_index(
                document_index, lambda docs: all_lengths[docs].astype(np.int64), seq_len, self.plan.num_samples
            )
            shuffle_index = build_shuffle_index(self.plan.samples_per_window, self.plan.num_windows, seed)
            return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

        arrays, self.cache_folder = cached_arrays(
            cache_dir, "samples", description, ["document_index", "sample_index", "shuffle_index"], build
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self.epochs = self.plan.num_epochs

    def __getstate__(self):  # workers reopen the memory maps instead of pickling their contents
        state = dict(self.__dict__)
        for name in ("document_index", "sample_index", "shuffle_index"):
            state[name] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        for name in ("document_index", "sample_index", "shuffle_index"):
            setattr(self, name, np.load(Path(self.cache_folder) / f"{name}.npy", mmap_mode="r"))

    def __len__(self) -> int:
        return self.plan.num_samples

    def sample_tokens(self, sample: int) -> np.ndarray:
        """Unshuffled sample ``sample`` (stream order)."""
        return read_sample(
            sample, self.document_index, self.sample_index, self.source.get, self.source.lengths_of, self.seq_len
        )

    def __getitem__(self, k: int) -> np.ndarray:
        sample = int(self.shuffle_index[k])
        tokens = self.sample_tokens(sample)
        if int(tokens.max()) >= self.vocab_size or int(tokens.min()) < 0:
            self._raise_bad_token(sample)
        return tokens

    def _raise_bad_token(self, sample: int) -> None:
        first, last = int(self.sample_index[sample][0]), int(self.sample_index[sample + 1][0])
        for doc in self.document_index[first : last + 1]:
            shard, local = self.source.locate(int(doc))
            tokens = shard[local]
            bad = (tokens >= self.vocab_size) | (tokens < 0)
            if bad.any():
                raise CorruptDataError(
                    f"{bin_path(shard.prefix)}: document {local} holds token id {int(tokens[np.argmax(bad)])}, "
                    f"outside the tokenizer's vocabulary [0, {self.vocab_size})"
                )
        raise AssertionError("a bad token was seen but not found again")


class BlendedSequences:
    """Samples from several :class:`PackedSequences` interleaved by weight (deterministic)."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int, cache_dir: str, description: dict):
        self.datasets = datasets
        self.weights = normalize_weights(weights, what=f"blend of {[getattr(d.source, 'name', '?') for d in datasets]}")
        self.num_samples = num_samples
        if len(datasets) == 1:
            self.dataset_index = self.dataset_sample_index = None
            return
        arrays, self.cache_folder = cached_arrays(
            cache_dir,
            "blend",
            {**description, "weights": self.weights.tolist(), "num_samples": num_samples},
            ["dataset_index", "dataset_sample_index"],
            lambda: dict(
                zip(("dataset_index", "dataset_sample_index"), build_blend_index(list(self.weights), num_samples))
            ),
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def __getstate__(self):
        state = dict(self.__dict__)
        if self.dataset_index is not None:
            state["dataset_index"] = state["dataset_sample_index"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if len(self.datasets) > 1:
            for name in ("dataset_index", "dataset_sample_index"):
                setattr(self, name, np.load(Path(self.cache_folder) / f"{name}.npy", mmap_mode="r"))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, k: int) -> np.ndarray:
        if not 0 <= k < self.num_samples:
            raise IndexError(f"sample {k} out of range for {self.num_samples} samples")
        if self.dataset_index is None:
            return self.datasets[0][k]
        return self.datasets[int(self.dataset_index[k])][int(self.dataset_sample_index[k])]

    @staticmethod
    def samples_needed(weights: list[float], num_samples: int, cache_dir: str, description: dict) -> list[int]:
        """How many samples each dataset must provide for a blend of ``num_samples``."""
        if len(weights) == 1:
            return [num_samples]
        normalized = normalize_weights(weights)
        arrays, _ = cached_arrays(
            cache_dir,
            "blend",
            {**description, "weights": normalized.tolist(), "num_samples": num_samples},
            ["dataset_index", "dataset_sample_index"],
            lambda: dict(
                zip(("dataset_index", "dataset_sample_index"), build_blend_index(list(normalized), num_samples))
            ),
        )
        counts = np.bincount(np.asarray(arrays["dataset_index"]), minlength=len(weights))
        return [max(1, int(c)) for c in counts]
