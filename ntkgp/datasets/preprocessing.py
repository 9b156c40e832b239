"""Standardization, label encoding and stratified splits shared by the tabular loaders (numpy in, numpy out)."""

from __future__ import annotations

import numpy as np


def _mean_std(train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column means and population stds of ``(N, D)`` ``train``.

    A constant column gets its value as mean (exactly, so it normalizes to exact zeros) and std 1.
    """
    constant = train.max(axis=0) == train.min(axis=0)
    mean = np.where(constant, train[0], train.mean(axis=0))
    std = np.where(constant, 1.0, train.std(axis=0))
    return mean, std


def _encode_labels(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map labels to ``0..C-1`` in sorted order; return the codes and the sorted distinct labels."""
    classes, codes = np.unique(np.asarray(raw).reshape(-1), return_inverse=True)
    return codes, classes


def _stratified_split(
    labels: np.ndarray, fractions: tuple[float, float], seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices (sorted) of a per-class random train/validation/test split; test takes the remainder."""
    rng = np.random.default_rng(seed)
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_train = round(fractions[0] * len(members))
        n_val = round(fractions[1] * len(members))
        for part, chunk in zip(parts, np.split(members, [n_train, n_train + n_val])):
            part.append(chunk)
    train, val, test = (np.sort(np.concatenate(part)) for part in parts)
    return train, val, test
