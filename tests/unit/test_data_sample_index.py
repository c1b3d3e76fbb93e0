"""Sample index: fast == step-by-step reference, determinism, coverage, prefix stability."""

import numpy as np
import pytest

from nemofp4.data.sample_index import (
    build_document_index,
    build_sample_index,
    build_sample_index_reference,
    build_shuffle_index,
    plan_sample_index,
    read_sample,
)


def make_lengths(seed, count, with_empty=True):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=count).astype(np.int64)
    if with_empty:
        lengths[rng.choice(count, size=count // 10, replace=False)] = 0
    return lengths


@pytest.mark.parametrize("seq_len", [1, 7, 32, 100])
@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_fast_sample_index_equals_reference(seq_len, chunk):
    lengths = make_lengths(0, 200)
    plan = plan_sample_index(int(lengths.sum()), 200, seq_len, num_samples=int(lengths.sum()) * 2 // seq_len)
    doc_index = build_document_index(np.arange(200), plan.num_epochs, seed=3)
    fast = build_sample_index(doc_index, lambda d: lengths[d], seq_len, plan.num_samples, chunk_documents=chunk)
    ref = build_sample_index_reference(doc_index, lengths, seq_len, plan.num_samples)
    np.testing.assert_array_equal(fast, ref)


def stream_and_samples(lengths, seq_len, num_samples, seed):
    """Documents of unique token ids; returns (explicit stream, served samples)."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.arange(starts[-1])
    plan = plan_sample_index(int(lengths.sum()), len(lengths), seq_len, num_samples)
    doc_index = build_document_index(np.arange(len(lengths)), plan.num_epochs, seed)
    sample_index = build_sample_index(doc_index, lambda d: lengths[d], seq_len, plan.num_samples)
    shuffle = build_shuffle_index(plan.samples_per_window, plan.num_windows, seed)
    stream = np.concatenate([tokens[starts[d] : starts[d + 1]] for d in doc_index])

    def get(doc, offset, count):
        return tokens[starts[doc] + offset : starts[doc] + offset + count]

    served = [read_sample(int(s), doc_index, sample_index, get, lambda d: lengths[d], seq_len) for s in shuffle]
    return stream, served, shuffle, plan


def test_samples_are_stream_slices_and_every_token_served_once_per_epoch():
    lengths, seq_len = make_lengths(1, 120), 16
    stream, served, shuffle, plan = stream_and_samples(lengths, seq_len, num_samples=500, seed=5)
    assert plan.num_epochs > 2  # the budget exceeds the data: epochs repeat
    for sample_id, tokens in zip(shuffle, served):
        np.testing.assert_array_equal(tokens, stream[sample_id * seq_len : sample_id * seq_len + seq_len + 1])
    inputs = np.concatenate([t[:-1] for t in served])
    assert inputs.size == plan.num_samples * seq_len
    # every token of each fully covered epoch is an input exactly once per epoch
    counts = np.bincount(inputs, minlength=int(lengths.sum()))
    full_epochs = inputs.size // int(lengths.sum())
    assert full_epochs >= 2 and counts.min() >= full_epochs and counts.max() <= full_epochs + 1
    assert int((counts == full_epochs + 1).sum()) == inputs.size - full_epochs * int(lengths.sum())
    for epoch in range(full_epochs):  # each epoch of the stream holds every token once
        part = stream[epoch * int(lengths.sum()) : (epoch + 1) * int(lengths.sum())]
        assert np.array_equal(np.sort(part), np.arange(int(lengths.sum())))


def test_one_window_serves_each_token_of_the_epoch_exactly_once():
    lengths, seq_len = make_lengths(2, 300), 8
    total = int(lengths.sum())
    _, served, shuffle, plan = stream_and_samples(lengths, seq_len, num_samples=1, seed=0)
    assert plan.num_windows == 1 and plan.num_epochs == 1
    inputs = np.concatenate([t[:-1] for t in served])
    counts = np.bincount(inputs, minlength=total)
    assert counts.max() == 1
    assert counts.sum() == total - (total - 1) % seq_len - 1  # all but the tail shorter than a sample


def test_same_inputs_same_bytes_different_seed_different_order():
    lengths = make_lengths(3, 500)
    doc_a = build_document_index(np.arange(500), 2, seed=7)
    doc_b = build_document_index(np.arange(500), 2, seed=7)
    doc_c = build_document_index(np.arange(500), 2, seed=8)
    assert doc_a.tobytes() == doc_b.tobytes() and doc_a.tobytes() != doc_c.tobytes()
    assert np.array_equal(np.sort(doc_a[:500]), np.arange(500))  # each epoch is a permutation
    assert not np.array_equal(doc_a[:500], doc_a[500:])  # epochs are shuffled independently
    fn = lambda d: lengths[d]  # noqa: E731
    assert build_sample_index(doc_a, fn, 16, 100).tobytes() == build_sample_index(doc_b, fn, 16, 100).tobytes()
    assert build_shuffle_index(50, 3, 7).tobytes() == build_shuffle_index(50, 3, 7).tobytes()
    assert build_shuffle_index(50, 3, 7).tobytes() != build_shuffle_index(50, 3, 8).tobytes()


def test_order_is_a_prefix_whatever_the_budget():
    lengths = make_lengths(4, 100)
    _, small, _, _ = stream_and_samples(lengths, 16, num_samples=50, seed=1)
    _, large, _, plan = stream_and_samples(lengths, 16, num_samples=2000, seed=1)
    assert plan.num_windows > 1
    for a, b in zip(small, large):
        np.testing.assert_array_equal(a, b)


def test_too_short_stream_is_an_error():
    lengths = np.array([5, 5])
    with pytest.raises(ValueError, match="fewer than"):
        build_sample_index(np.array([0, 1]), lambda d: lengths[d], 4, 3)
