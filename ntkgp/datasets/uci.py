r"""The UCI benchmark sets of the data folder: regression (standard 90/10 splits) and classification."""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..validation import float_dtype
from .data_folder import PathType, _data_file
from .preprocessing import _encode_labels, _mean_std, _stratified_split

__all__ = ["ClassificationSplit", "RegressionSplit", "load_uci_classification", "load_uci_regression"]

_UCI_REGRESSION_LAYOUT = (
    "data_dir/uci_regression/NAME/{data.txt, index_features.txt, index_target.txt, n_splits.txt, "
    "index_train_I.txt, index_test_I.txt}"
)
_UCI_CLASSIFICATION_LAYOUT = (
    "data_dir/uci_classification/{australian/australian_scale_{X,y}_{tr,te}.csv, "
    "breast_cancer/breast_cancer_scale_{X,y}_{tr,te}.csv, glass/X.txt, glass/Y.txt}"
)
_UCI_CLASSIFICATION_NAMES = ("australian", "breast_cancer", "glass")


class RegressionSplit(NamedTuple):
    """A normalized train/(validation/)test regression split; see :func:`load_uci_regression`."""

    x_train: Tensor
    """``(N_train, D)`` inputs, standardized with the training mean and std."""
    y_train: Tensor
    """``(N_train, 1)`` targets, standardized with :attr:`y_mean` and :attr:`y_std`."""
    x_test: Tensor
    """``(N_test, D)``, same transformation as the training inputs."""
    y_test: Tensor
    """``(N_test, 1)``, same transformation as the training targets."""
    y_mean: float
    """Mean of the training targets (original units)."""
    y_std: float
    """Std of the training targets in original units; original = normalized * y_std + y_mean."""
    x_val: Tensor | None = None
    """``(N_val, D)`` validation inputs drawn from the training split (``val_fraction > 0``), else ``None``."""
    y_val: Tensor | None = None
    """``(N_val, 1)`` validation targets, normalized like the training targets, else ``None``."""


class ClassificationSplit(NamedTuple):
    """A classification split; see :func:`load_uci_classification`."""

    x_train: Tensor
    """``(N_train, D)`` inputs."""
    y_train: Tensor
    """``(N_train,)`` labels in ``0..C-1``."""
    x_val: Tensor | None
    """``(N_val, D)`` validation inputs, ``None`` for ``split="distributed"``."""
    y_val: Tensor | None
    """``(N_val,)`` validation labels, ``None`` for ``split="distributed"``."""
    x_test: Tensor
    """``(N_test, D)`` inputs."""
    y_test: Tensor
    """``(N_test,)`` labels."""
    num_classes: int
    """``C``."""


def load_uci_regression(
    data_dir: PathType,
    name: str,
    split: int = 0,
    dtype: torch.dtype = torch.float64,
    val_fraction: float = 0.0,
    seed: int = 0,
) -> RegressionSplit:
    r"""One train/test split (90/10) of a UCI regression benchmark set, normalized.

    The test part is the standard split ``index_test_{split}.txt``. With ``val_fraction > 0``,
    ``round(val_fraction * N_train)`` rows of the standard training part (at least one, at most all but
    one), drawn with ``numpy.random.default_rng(seed)``, become the validation part and the rest the
    training part (the protocol of Foong et al. 2019 and of Immer et al. 2021's cross-validation
    baselines uses 10 %). Inputs and target are standardized with the statistics of the (remaining)
    training part, :math:`\tilde x = (x - \bar x_\text{train}) / s_\text{train}` (population std; a
    constant column gets :math:`s = 1`). Test NLPD in the original units is the normalized NLPD plus
    :math:`\log` ``y_std`` (``metrics.gaussian_nlpd(..., y_scale=y_std)``).

    Args:
        data_dir: the benchmark data folder (see :mod:`ntkgp.datasets` for its layout).
        name: a folder of ``data_dir/uci_regression`` (boston, concrete, energy, kin8nm, naval, power,
            protein, wine, yacht).
        split: split index, ``0 <= split < n_splits`` (20; 5 for protein).
        dtype: floating-point dtype of the returned tensors.
        val_fraction: fraction of the training part held out for validation, ``0 <= val_fraction < 1``
            (``0``: no validation part, ``x_val = y_val = None``).
        seed: seed of the validation draw (unused when ``val_fraction = 0``).

    Returns:
        :class:`RegressionSplit` ``(x_train, y_train, x_test, y_test, y_mean, y_std, x_val, y_val)``.

    Raises:
        FileNotFoundError: naming ``data_dir``, what it holds and the expected layout.
        ValueError: for a ``split`` that is not an integer or out of range, a ``val_fraction`` outside
            ``[0, 1)`` or a ``dtype`` that is not floating point.

    Example:
        >>> split = load_uci_regression(resolve_data_dir(), "boston", split=0)  # doctest: +SKIP
    """
    if not (isinstance(val_fraction, (int, float)) and math.isfinite(val_fraction) and 0 <= val_fraction < 1):
        raise ValueError(f"val_fraction must be in [0, 1); got {val_fraction!r}")
    float_dtype(dtype)
    if isinstance(split, bool) or not isinstance(split, numbers.Integral):
        raise ValueError(f"split must be an integer index; got {split!r}")
    folder = ("uci_regression", name)

    def file(filename: str) -> Path:
        return _data_file(data_dir, (*folder, filename), _UCI_REGRESSION_LAYOUT)

    n_splits = int(file("n_splits.txt").read_text().split()[0])
    if not 0 <= split < n_splits:
        raise ValueError(f"split must be in 0..{n_splits - 1} for {name}; got {split}")
    table = np.loadtxt(file("data.txt"), ndmin=2)
    features = np.loadtxt(file("index_features.txt"), dtype=int, ndmin=1)
    target = int(np.loadtxt(file("index_target.txt"), dtype=int, ndmin=1)[0])
    train = np.loadtxt(file(f"index_train_{split}.txt"), dtype=int, ndmin=1)
    test = np.loadtxt(file(f"index_test_{split}.txt"), dtype=int, ndmin=1)
    val = None
    if val_fraction > 0:
        if len(train) < 2:
            raise ValueError(
                f"val_fraction > 0 needs at least 2 training rows; {name} split {split} has {len(train)}"
            )
        n_val = min(max(round(val_fraction * len(train)), 1), len(train) - 1)
        order = np.random.default_rng(seed).permutation(len(train))
        val, train = np.sort(train[order[:n_val]]), np.sort(train[order[n_val:]])
    x, y = table[:, features], table[:, [target]]
    x_mean, x_std = _mean_std(x[train])
    y_mean, y_std = _mean_std(y[train])

    def tensor(array: np.ndarray) -> Tensor:
        return torch.as_tensor(array, dtype=dtype)

    return RegressionSplit(
        x_train=tensor((x[train] - x_mean) / x_std),
        y_train=tensor((y[train] - y_mean) / y_std),
        x_test=tensor((x[test] - x_mean) / x_std),
        y_test=tensor((y[test] - y_mean) / y_std),
        y_mean=float(y_mean[0]),
        y_std=float(y_std[0]),
        x_val=None if val is None else tensor((x[val] - x_mean) / x_std),
        y_val=None if val is None else tensor((y[val] - y_mean) / y_std),
    )


def load_uci_classification(
    data_dir: PathType,
    name: Literal["australian", "breast_cancer", "glass"],
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    split: Literal["random", "distributed"] = "random",
    fractions: tuple[float, float] = (0.7, 0.15),
) -> ClassificationSplit:
    """A UCI classification set as used by Immer et al. (2021) and the SFR paper.

    * ``split="random"`` (default, the papers' protocol): all rows of the set (for ``australian`` and
      ``breast_cancer`` the distributed train and test files pooled) are split 70/15/15 into
      train/validation/test, stratified by class (per class: ``round(0.7 n_c)`` train,
      ``round(0.15 n_c)`` validation, the rest test; ``fractions`` changes the first two), drawn with
      ``numpy.random.default_rng(seed)``. Inputs are standardized with the training part's mean and
      population std (a constant column gets std 1).
    * ``split="distributed"``: ``australian`` (690 x 14) and ``breast_cancer`` (683 x 10) as distributed
      (the ``_tr``/``_te`` files, inputs already scaled to [-1, 1], unchanged), no validation part
      (``x_val = y_val = None``), ``seed`` unused. ``glass`` has no distributed split.

    Labels (±1, 1-based or 0-based in the files) are mapped to ``0..C-1`` in sorted order.

    Args:
        data_dir: the benchmark data folder (see :mod:`ntkgp.datasets` for its layout).
        name: ``"australian"``, ``"breast_cancer"`` or ``"glass"``.
        seed: seed of the random split.
        dtype: floating-point dtype of the inputs.
        split: ``"random"`` or ``"distributed"``.
        fractions: ``(train, validation)`` fractions of the random split, both positive, sum below 1.

    Returns:
        :class:`ClassificationSplit` ``(x_train, y_train, x_val, y_val, x_test, y_test, num_classes)``.

    Raises:
        FileNotFoundError: naming ``data_dir``, what it holds and the expected layout.
        ValueError: for an unknown ``name`` or ``split``, ``split="distributed"`` with ``glass``, bad
            ``fractions`` or a ``dtype`` that is not floating point.

    Example:
        >>> split = load_uci_classification(resolve_data_dir(), "glass", seed=0)  # doctest: +SKIP
    """
    if name not in _UCI_CLASSIFICATION_NAMES:
        raise ValueError(f"name must be one of {_UCI_CLASSIFICATION_NAMES}; got {name!r}")
    float_dtype(dtype)
    if split not in ("random", "distributed"):
        raise ValueError(f"split must be 'random' or 'distributed'; got {split!r}")
    if split == "distributed" and name == "glass":
        raise ValueError("glass has no distributed train/test split; use split='random'")
    try:
        train_fraction, val_fraction = (float(f) for f in fractions)
    except (TypeError, ValueError):
        raise ValueError(f"fractions must be two numbers (train, validation); got {fractions!r}") from None
    if not (train_fraction > 0 and val_fraction > 0 and train_fraction + val_fraction < 1):
        raise ValueError(
            f"fractions must be positive with a sum below 1 (the rest is the test part); got {fractions!r}"
        )

    def load(filename: str) -> np.ndarray:
        return np.loadtxt(
            _data_file(data_dir, ("uci_classification", name, filename), _UCI_CLASSIFICATION_LAYOUT), ndmin=1
        )

    def floats(array: np.ndarray) -> Tensor:
        return torch.as_tensor(array, dtype=dtype)

    def longs(array: np.ndarray) -> Tensor:
        return torch.as_tensor(array, dtype=torch.long)

    if name == "glass":
        x, raw = load("X.txt"), load("Y.txt")
    else:
        x_tr, x_te = load(f"{name}_scale_X_tr.csv"), load(f"{name}_scale_X_te.csv")
        raw_tr, raw_te = load(f"{name}_scale_y_tr.csv"), load(f"{name}_scale_y_te.csv")
        x = np.concatenate([x_tr.reshape(len(raw_tr), -1), x_te.reshape(len(raw_te), -1)])
        raw = np.concatenate([raw_tr, raw_te])
        if split == "distributed":
            labels, classes = _encode_labels(raw)
            n_train = len(raw_tr)
            return ClassificationSplit(
                x_train=floats(x[:n_train]),
                y_train=longs(labels[:n_train]),
                x_val=None,
                y_val=None,
                x_test=floats(x[n_train:]),
                y_test=longs(labels[n_train:]),
                num_classes=len(classes),
            )
    labels, classes = _encode_labels(raw)
    x = x.reshape(len(labels), -1)
    train, val, test = _stratified_split(labels, (train_fraction, val_fraction), seed)
    x_mean, x_std = _mean_std(x[train])
    x = (x - x_mean) / x_std
    return ClassificationSplit(
        x_train=floats(x[train]),
        y_train=longs(labels[train]),
        x_val=floats(x[val]),
        y_val=longs(labels[val]),
        x_test=floats(x[test]),
        y_test=longs(labels[test]),
        num_classes=len(classes),
    )
