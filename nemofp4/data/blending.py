"""Deterministic blending of several datasets by weight.

Dataset ``j``'s ``k``-th sample is given the ideal time ``(k + 1/2) / w_j``; the blend serves
samples in order of ideal time (ties to the lower dataset index). Every prefix of ``n`` samples
then holds ``n * w_j`` samples of dataset ``j`` up to about one, so the realized proportions over
any window of 10,000 samples stay within a few 1e-4 of the weights. The order does not depend on
the total requested, so the blend (like the sample index) can be extended.
"""

from __future__ import annotations

import heapq
import math

import numpy as np


def normalize_weights(weights: list[float], *, what: str = "blend") -> np.ndarray:
    array = np.asarray(weights, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what}: needs at least one weight, got {weights!r}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{what}: weights must be finite and >= 0, got {weights!r}")
    total = float(array.sum())
    if not total > 0:
        raise ValueError(f"{what}: weights {weights!r} must sum to a positive number, got {total}")
    return array / total


def build_blend_index(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)``: sample ``k`` of the blend is sample
    ``dataset_sample_index[k]`` of dataset ``dataset_index[k]``."""
    w = normalize_weights(weights)
    times, owners = [], []
    for j, weight in enumerate(w):
        if weight == 0:
            continue
        count = math.ceil(num_samples * weight) + 2  # enough for any prefix of num_samples
        times.append((np.arange(count, dtype=np.float64) + 0.5) / weight)
        owners.append(np.full(count, j, dtype=np.int16))
    all_times, all_owners = np.concatenate(times), np.concatenate(owners)
    order = np.lexsort((all_owners, all_times))[:num_samples]  # by time, then dataset
    dataset_index = all_owners[order]
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    for j in range(len(w)):
        mask = dataset_index == j
        dataset_sample_index[mask] = np.arange(int(mask.sum()), dtype=np.int64)
    return dataset_index, dataset_sample_index


def build_blend_index_reference(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Step-by-step version: repeatedly serve the dataset whose next sample is due first."""
    w = normalize_weights(weights)
    heap = [(0.5 / weight, j, 0) for j, weight in enumerate(w) if weight > 0]
    heapq.heapify(heap)
    dataset_index, dataset_sample_index = [], []
    for _ in range(num_samples):
        _, j, k = heapq.heappop(heap)
        dataset_index.append(j)
        dataset_sample_index.append(k)
        heapq.heappush(heap, ((k + 1 + 0.5) / w[j], j, k + 1))
    return np.asarray(dataset_index, dtype=np.int16), np.asarray(dataset_sample_index, dtype=np.int64)
