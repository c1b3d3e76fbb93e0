"""Blending: fast == reference, proportions over every window, bad weights."""

import numpy as np
import pytest

from nemofp4.data.blending import build_blend_index, build_blend_index_reference

OLMO_LIKE = [3710.0, 83.0, 58.6, 20.8, 12.2, 11.8, 3.7]


@pytest.mark.parametrize("weights", [[1.0], [1, 1], [0.7, 0.2, 0.1], [5, 0, 3], OLMO_LIKE])
def test_fast_equals_reference(weights):
    fast = build_blend_index(weights, 5000)
    ref = build_blend_index_reference(weights, 5000)
    np.testing.assert_array_equal(fast[0], ref[0])
    np.testing.assert_array_equal(fast[1], ref[1])


@pytest.mark.parametrize("weights", [[0.7, 0.2, 0.1], OLMO_LIKE, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
def test_proportions_within_0p1_percent_over_every_10000_window(weights):
    dataset_index, dataset_sample_index = build_blend_index(weights, 100_000)
    w = np.asarray(weights) / np.sum(weights)
    for j in range(len(w)):
        hits = np.concatenate([[0], np.cumsum(dataset_index == j)])
        window = hits[10_000:] - hits[:-10_000]  # every window of 10,000 consecutive samples
        assert np.abs(window / 10_000 - w[j]).max() <= 1e-3, (j, np.abs(window / 10_000 - w[j]).max())
        # each dataset's samples are used in order 0, 1, 2, ...
        np.testing.assert_array_equal(dataset_sample_index[dataset_index == j], np.arange(hits[-1]))


def test_blend_is_a_prefix_whatever_the_budget():
    small, large = build_blend_index(OLMO_LIKE, 1000), build_blend_index(OLMO_LIKE, 50_000)
    np.testing.assert_array_equal(small[0], large[0][:1000])


@pytest.mark.parametrize("weights", [[0, 0], [], [1, -1], [1, float("nan")]])
def test_bad_weights_are_named(weights):
    with pytest.raises(ValueError, match="weights|at least one"):
        build_blend_index(weights, 10)
