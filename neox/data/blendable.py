"""Weighted blending of several datasets into one deterministic sample stream."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Positions placed per step of the blend; bounds memory at a few times this many floats per dataset.
_CHUNK = 1 << 20
# Headroom on each dataset's share, as gpt-neox gives (0.5%), so a sub-dataset never runs short.
SHARE_MARGIN = 1.005


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights scaled to sum to 1; raises on negative weights or a zero total."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"weights must be a non-empty list, got {list(weights)}")
    if np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
        raise ValueError(
            f"dataset weights {list(weights)} must be finite, non-negative and not all zero"
        )
    return w / w.sum()


def weights_by_num_documents(num_documents: Sequence[int], alpha: float = 1.0) -> list[float]:
    """gpt-neox's `weight_by_num_documents` weights: p_i ~ (n_i / N) ** alpha, times (1 - n_i / N).

    alpha < 1 flattens the distribution, sampling small datasets more often than their size
    (the multinomial re-weighting of XLM-R, arXiv:1911.02116); the (1 - n_i / N) factor is the one
    gpt-neox applies on top, kept so a config means the same blend here.
    """
    n = np.asarray(num_documents, dtype=np.float64)
    if n.size == 0 or np.any(n <= 0):
        raise ValueError(f"every dataset needs documents to weigh by, got counts {list(n)}")
    if n.size == 1:
        return [1.0]
    share = n / n.sum()
    probs = share**alpha
    probs /= probs.sum()
    weights = probs * (1.0 - share)
    return list(weights / weights.sum())


def samples_per_dataset(weights: Sequence[float], num_samples: int) -> list[int]:
    """Samples to request from each dataset for a blend of `num_samples`: its share plus margin."""
    w = normalize_weights(weights)
    # + len(w) covers the blend running up to (1 + w_i * len(w)) / 2 samples ahead of a share.
    return [int(math.ceil(num_samples * wi * SHARE_MARGIN)) + len(w) if wi > 0 else 0 for wi in w]


def build_blend_index(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of `size` positions, which dataset it draws from and that dataset's sample number.

    Dataset i's k-th sample is due at position (k + 0.5) / w_i; positions are filled in order of
    due time (ties to the lower dataset index), so the dataset furthest behind its share goes next.
    After any n positions dataset i holds its share n * w_i to within (1 + w_i * m) / 2 samples
    for m datasets, and exactly when every n * w_i is whole.
    """
    w = normalize_weights(weights)
    if len(w) > np.iinfo(np.int16).max:
        raise ValueError(f"at most {np.iinfo(np.int16).max} datasets can be blended, got {len(w)}")
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    active = np.flatnonzero(w > 0)
    taken = np.zeros(len(w), dtype=np.int64)
    done = 0
    while done < size:
        chunk = min(_CHUNK, size - done)
        # Each dataset stays within (1 + w_i * m) / 2 of its share, so its next
        # w_i * chunk + m + 2 due times include every one among the next `chunk` positions.
        need = np.ceil(w[active] * chunk).astype(np.int64) + len(w) + 2
        owner = np.repeat(np.arange(len(active)), need)
        k = taken[active][owner] + np.arange(need.sum()) - np.repeat(np.cumsum(need) - need, need)
        due = (k + 0.5) / w[active][owner]
        # Stable sort over candidates grouped by dataset: equal due times go to the lower index.
        pick = np.argsort(due, kind="stable")[:chunk]
        dataset_index[done : done + chunk] = active[owner[pick]]
        sample_index[done : done + chunk] = k[pick]
        taken[active] += np.bincount(owner[pick], minlength=len(active))
        done += chunk
    return dataset_index, sample_index


class BlendableDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights`, in a fixed order."""

    def __init__(
        self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int
    ):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights; give one each")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blend_index(self.weights, self.size)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, (dataset, count) in enumerate(zip(self.datasets, counts)):
            if count > len(dataset):
                raise ValueError(
                    f"blended dataset {i} must supply {count} samples but has {len(dataset)}; "
                    "build it with samples_per_dataset(weights, size)"
                )
        logger.info(
            "blended %d datasets: weights %s, samples %s",
            len(self.datasets),
            np.round(self.weights, 4).tolist(),
            counts.tolist(),
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
