"""Deterministic sample indices over packed documents (after Megatron's GPTDataset).

A token source's training documents are laid end to end in a *stream*: epoch ``e`` is a
permutation of the documents drawn from ``(seed, e)``, and epochs follow one another. Sample
``i`` is stream tokens ``[i * L, i * L + L + 1)`` for sequence length ``L`` (``L + 1`` tokens,
so inputs and labels overlap by one). Three arrays describe it:

* ``document_index[p]``: the document at stream position ``p`` (epochs concatenated);
* ``sample_index[i] = (p, offset)``: where sample ``i`` starts (row ``i + 1`` is where it ends);
* ``shuffle_index[k]``: the sample served ``k``-th. Samples are shuffled inside consecutive
  windows of ``W`` samples (``W`` = the samples in one epoch), each window by its own
  ``(seed, window)`` generator.

Nothing depends on the number of samples requested beyond how many windows get built, so the
first ``N`` served samples are the same whatever budget is asked for: a run can be extended
without changing the data it already saw. Builds are linear in the stream length and walk the
stream in chunks, so memory stays bounded by the output arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

CHUNK_DOCUMENTS = 1 << 22


def _generator(seed: int, *stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *stream])))


SEED_STREAM_DOCUMENTS = 0
SEED_STREAM_SHUFFLE = 1


@dataclass(frozen=True)
class SampleIndexPlan:
    """How many windows, samples and epochs a request needs (all derived, nothing stored)."""

    seq_len: int
    tokens_per_epoch: int
    num_documents: int
    samples_per_window: int
    num_windows: int

    @property
    def num_samples(self) -> int:
        return self.samples_per_window * self.num_windows

    @property
    def num_epochs(self) -> int:
        needed = self.num_samples * self.seq_len + 1
        return -(-needed // self.tokens_per_epoch)


def plan_sample_index(tokens_per_epoch: int, num_documents: int, seq_len: int, num_samples: int) -> SampleIndexPlan:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    if tokens_per_epoch < 1:
        raise ValueError("the token source has no tokens in this split")
    window = max(1, (tokens_per_epoch - 1) // seq_len)
    return SampleIndexPlan(seq_len, tokens_per_epoch, num_documents, window, -(-num_samples // window))


def build_document_index(documents: np.ndarray | int, num_epochs: int, seed: int) -> np.ndarray:
    """Epoch permutations of ``documents`` (an array of ids, or a count ``n`` for ids ``0..n-1``),
    concatenated; int32 when the ids fit."""
    count = documents if isinstance(documents, int) else documents.size
    largest = count - 1 if isinstance(documents, int) else (int(documents.max()) if count else 0)
    dtype = np.int32 if largest < 2**31 else np.int64
    out = np.empty(count * num_epochs, dtype=dtype)
    for epoch in range(num_epochs):
        view = out[epoch * count : (epoch + 1) * count]
        if isinstance(documents, int):
            view[:] = np.arange(count, dtype=dtype)
        else:
            view[:] = documents
        _generator(seed, SEED_STREAM_DOCUMENTS, epoch).shuffle(view)
    return out


def build_sample_index(
    document_index: np.ndarray,
    lengths_of: Callable[[np.ndarray], np.ndarray],
    seq_len: int,
    num_samples: int,
    chunk_documents: int = CHUNK_DOCUMENTS,
) -> np.ndarray:
    """``[num_samples + 1, 2]`` rows ``(stream position, offset)`` of tokens ``0, L, 2L, ...``.

    Walks the stream a chunk of documents at a time: the cumulative token count of the chunk
    locates (``searchsorted``) every sample boundary that falls inside it.
    """
    dtype = np.int32 if document_index.size < 2**31 else np.int64
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    next_boundary = 0  # row of `out` to fill next
    tokens_before = 0  # stream tokens before the current chunk
    for start in range(0, document_index.size, chunk_documents):
        lengths = lengths_of(document_index[start : start + chunk_documents])
        ends = np.cumsum(lengths, dtype=np.int64) + tokens_before  # stream end of each document
        chunk_end = int(ends[-1])
        # boundaries b with b * seq_len < chunk_end are located in this chunk
        last = min(num_samples, (chunk_end - 1) // seq_len) if chunk_end > 0 else -1
        if last >= next_boundary:
            positions = np.arange(next_boundary, last + 1, dtype=np.int64) * seq_len
            doc_in_chunk = np.searchsorted(ends, positions, side="right")
            doc_start = ends[doc_in_chunk] - lengths[doc_in_chunk]
            out[next_boundary : last + 1, 0] = start + doc_in_chunk
            out[next_boundary : last + 1, 1] = positions - doc_start
            next_boundary = last + 1
        tokens_before = chunk_end
        if next_boundary > num_samples:
            break
    if next_boundary <= num_samples:
        raise ValueError(
            f"the document stream has {tokens_before} tokens, fewer than the {num_samples * seq_len + 1} "
            f"needed for {num_samples} samples of {seq_len} + 1 tokens"
        )
    return out


def build_sample_index_reference(
    document_index: np.ndarray, lengths: np.ndarray, seq_len: int, num_samples: int
) -> np.ndarray:
    """Step-by-step version of :func:`build_sample_index` (Megatron's loop), for tests."""
    position, offset = 0, 0
    while int(lengths[document_index[position]]) == 0:  # rows point at a real token
        position += 1
    rows = [(position, offset)]
    for _ in range(num_samples):
        remaining = seq_len
        while remaining > 0:
            available = int(lengths[document_index[position]]) - offset
            if available > remaining:
                offset += remaining
                remaining = 0
            else:
                remaining -= available
                position += 1
                offset = 0
        # skip documents that end exactly here, or are empty, so rows point at a real token
        while int(lengths[document_index[position]]) == offset:
            position += 1
            offset = 0
        rows.append((position, offset))
    return np.asarray(rows, dtype=np.int64)


def build_shuffle_index(samples_per_window: int, num_windows: int, seed: int) -> np.ndarray:
    total = samples_per_window * num_windows
    dtype = np.int32 if total < 2**31 else np.int64
    out = np.empty(total, dtype=dtype)
    for window in range(num_windows):
        view = out[window * samples_per_window : (window + 1) * samples_per_window]
        view[:] = np.arange(window * samples_per_window, (window + 1) * samples_per_window, dtype=dtype)
        _generator(seed, SEED_STREAM_SHUFFLE, window).shuffle(view)
    return out


def read_sample(
    sample: int,
    document_index: np.ndarray,
    sample_index: np.ndarray,
    get_tokens: Callable[[int, int, int], np.ndarray],
    lengths_of: Callable[[np.ndarray], np.ndarray],
    seq_len: int,
) -> np.ndarray:
    """The ``seq_len + 1`` tokens of ``sample`` as int64, gathered across document boundaries."""
    first_pos, first_offset = (int(v) for v in sample_index[sample])
    last_pos, last_offset = (int(v) for v in sample_index[sample + 1])
    out = np.empty(seq_len + 1, dtype=np.int64)
    if first_pos == last_pos:
        out[:] = get_tokens(int(document_index[first_pos]), first_offset, seq_len + 1)
        return out
    docs = document_index[first_pos : last_pos + 1]
    lengths = lengths_of(np.asarray(docs))
    filled = 0
    for i, doc in enumerate(docs):
        begin = first_offset if i == 0 else 0
        end = last_offset + 1 if i == len(docs) - 1 else int(lengths[i])
        if end > begin:
            out[filled : filled + end - begin] = get_tokens(int(doc), begin, end - begin)
            filled += end - begin
    assert filled == seq_len + 1, (sample, filled)
    return out
