r"""Small data helpers: synthetic sets and loaders for the benchmark data and user CSV files.

Every function returns torch tensors. Floating-point tensors take the ``dtype`` argument (default
``torch.float64``); class labels are ``torch.long`` in ``0..C-1``. Regression targets have shape
``(N, 1)``, class labels shape ``(N,)``.

Loaders for the benchmark data take ``data_dir``, a data folder that is not part of the repository (the
scripts take it as ``--data-dir PATH``, or from the ``NTKGP_DATA_DIR`` environment variable; see
:func:`resolve_data_dir`). It is laid out as::

    data_dir/toy/snelson_{train_inputs,train_outputs,test_inputs}.dat
    data_dir/toy/banana_400_{X,y}.csv, data_dir/toy/banana_5300.csv
    data_dir/uci_regression/NAME/{data.txt, index_features.txt, index_target.txt, n_splits.txt,
                                  index_train_I.txt, index_test_I.txt}
    data_dir/uci_classification/{australian,breast_cancer}/NAME_scale_{X,y}_{tr,te}.csv
    data_dir/uci_classification/glass/{X.txt, Y.txt}

A missing folder or file raises ``FileNotFoundError`` naming ``data_dir`` and the expected layout.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "GAP_REGRESSION_INTERVALS",
    "GAP_REGRESSION_TEST_RANGE",
    "ClassificationSplit",
    "DATA_DIR_VARIABLE",
    "CsvData",
    "GapRegression",
    "RegressionSplit",
    "gap_regression",
    "gap_regression_function",
    "load_banana",
    "load_csv",
    "load_snelson",
    "load_uci_classification",
    "load_uci_regression",
    "resolve_data_dir",
    "two_moons",
]

PathType = str | PathLike

DATA_DIR_VARIABLE = "NTKGP_DATA_DIR"
"""The environment variable :func:`resolve_data_dir` reads when no folder is passed."""

GAP_REGRESSION_INTERVALS: tuple[tuple[float, float], tuple[float, float]] = ((-1.0, -0.35), (0.35, 1.0))
"""The two intervals the training inputs of :func:`gap_regression` are drawn from; (-0.35, 0.35) is empty."""

GAP_REGRESSION_TEST_RANGE: tuple[float, float] = (-1.5, 1.5)
"""The interval covered by the test grid of :func:`gap_regression`."""

_SNELSON_LAYOUT = (
    "data_dir/toy/{snelson_train_inputs.dat, snelson_train_outputs.dat, snelson_test_inputs.dat}"
)
_BANANA_LAYOUT = (
    "data_dir/toy/{banana_400_X.csv, banana_400_y.csv} (full=False) or data_dir/toy/banana_5300.csv"
)
_UCI_REGRESSION_LAYOUT = (
    "data_dir/uci_regression/NAME/{data.txt, index_features.txt, index_target.txt, n_splits.txt, "
    "index_train_I.txt, index_test_I.txt}"
)
_UCI_CLASSIFICATION_LAYOUT = (
    "data_dir/uci_classification/{australian/australian_scale_{X,y}_{tr,te}.csv, "
    "breast_cancer/breast_cancer_scale_{X,y}_{tr,te}.csv, glass/X.txt, glass/Y.txt}"
)
_UCI_CLASSIFICATION_NAMES = ("australian", "breast_cancer", "glass")


class GapRegression(NamedTuple):
    """Output of :func:`gap_regression`."""

    x_train: Tensor
    """``(n, 1)`` training inputs, sorted, none inside the gap."""
    y_train: Tensor
    """``(n, 1)`` noisy targets :math:`f(x) + \\varepsilon`."""
    x_test: Tensor
    """``(n_test, 1)`` evenly spaced grid over :data:`GAP_REGRESSION_TEST_RANGE`."""
    f_test: Tensor
    """``(n_test, 1)`` noise-free function values on the grid."""
    noise_std: float
    """Standard deviation of the observation noise :math:`\\varepsilon`."""


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


class CsvData(NamedTuple):
    """Output of :func:`load_csv`."""

    x: Tensor
    """``(N, D)`` inputs, in the order of ``input_columns``."""
    y: Tensor
    """``(N, 1)`` float targets (regression) or ``(N,)`` long labels in ``0..C-1`` (classification)."""
    input_names: list[str]
    """Header names of the input columns."""
    class_names: list[str] | None
    """The text of each class for classification (``class_names[k]`` is label ``k``); ``None`` for regression."""


def resolve_data_dir(data_dir: PathType | None = None) -> Path:
    """The benchmark data folder: ``data_dir`` when given, else the ``NTKGP_DATA_DIR`` environment variable.

    Args:
        data_dir: the folder (e.g. a script's ``--data-dir``), or ``None`` to read
            :data:`DATA_DIR_VARIABLE` from the environment.

    Returns:
        The folder as an absolute path.

    Raises:
        FileNotFoundError: when neither is set or the folder does not exist; the message names the
            ``--data-dir`` option, the environment variable and the expected layout.

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> resolve_data_dir(folder) == Path(folder).resolve()
        True
    """
    if data_dir is None:
        data_dir = os.environ.get(DATA_DIR_VARIABLE) or None
    layout = "toy/ (snelson_*.dat, banana_*.csv), uci_regression/NAME/ (data.txt, index_*.txt, n_splits.txt), " \
        "uci_classification/NAME/"
    if data_dir is None:
        raise FileNotFoundError(
            f"no data folder given: pass --data-dir PATH (or data_dir=) or set {DATA_DIR_VARIABLE}=PATH; "
            f"the folder holds {layout}"
        )
    folder = Path(data_dir)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"data folder {str(folder)!r} not found: pass --data-dir PATH (or set {DATA_DIR_VARIABLE}) pointing "
            f"at a folder that holds {layout}"
        )
    return folder.resolve()


def gap_regression_function(x: Tensor) -> Tensor:
    r"""The noise-free function of :func:`gap_regression`, :math:`f(x) = \sin(4x)`, elementwise.

    Args:
        x: inputs of any shape.

    Returns:
        :math:`\sin(4x)`, same shape and dtype.

    Example:
        >>> gap_regression_function(torch.zeros(2))
        tensor([0., 0.])
    """
    return torch.sin(4.0 * x)


def gap_regression(
    n: int = 100,
    seed: int = 0,
    noise_std: float = 0.1,
    n_test: int = 300,
    dtype: torch.dtype = torch.float64,
) -> GapRegression:
    r"""1-D regression with a gap in the inputs, for checking "in-between" uncertainty.

    Inputs: ``n // 2`` points uniform on :math:`[-1, -0.35]` and ``n - n // 2`` uniform on
    :math:`[0.35, 1]` (:data:`GAP_REGRESSION_INTERVALS`), sorted. Targets:
    :math:`y = \sin(4x) + \varepsilon`, :math:`\varepsilon \sim \mathcal N(0, \sigma^2)`,
    :math:`\sigma` = ``noise_std``. The test grid has ``n_test`` evenly spaced points on
    :math:`[-1.5, 1.5]`, so it covers the gap and extrapolation on both sides. Sampling uses a private
    ``torch.Generator`` seeded with ``seed`` (the global RNG is left untouched); the values do not
    depend on ``dtype`` beyond rounding.

    Args:
        n: number of training points, at least 2 (one on each side of the gap).
        seed: seed of the private generator.
        noise_std: :math:`\sigma \ge 0`.
        n_test: number of test grid points, at least 1.
        dtype: floating-point dtype of the returned tensors.

    Returns:
        :class:`GapRegression` ``(x_train, y_train, x_test, f_test, noise_std)``.

    Raises:
        ValueError: naming the argument, for ``n < 2``, ``n_test < 1`` or a negative or non-finite
            ``noise_std``.

    Example:
        >>> data = gap_regression(n=20, n_test=50)
        >>> data.x_train.shape, data.x_test.shape
        (torch.Size([20, 1]), torch.Size([50, 1]))
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an integer >= 2 (one point on each side of the gap); got {n!r}")
    if isinstance(n_test, bool) or not isinstance(n_test, int) or n_test < 1:
        raise ValueError(f"n_test must be a positive integer; got {n_test!r}")
    if not (math.isfinite(noise_std) and noise_std >= 0):
        raise ValueError(f"noise_std must be finite and >= 0; got {noise_std!r}")
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    (left_lo, left_hi), (right_lo, right_hi) = GAP_REGRESSION_INTERVALS
    n_left = n // 2
    left = left_lo + (left_hi - left_lo) * u[:n_left]
    right = right_lo + (right_hi - right_lo) * u[n_left:]
    x = torch.cat([left, right]).sort().values[:, None]
    noise = noise_std * torch.randn(n, 1, generator=generator, dtype=torch.float64)
    y = gap_regression_function(x) + noise
    x_test = torch.linspace(*GAP_REGRESSION_TEST_RANGE, n_test, dtype=torch.float64)[:, None]
    return GapRegression(
        x_train=x.to(dtype),
        y_train=y.to(dtype),
        x_test=x_test.to(dtype),
        f_test=gap_regression_function(x_test).to(dtype),
        noise_std=float(noise_std),
    )


def two_moons(
    n: int = 200, noise: float = 0.1, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """Two interleaving half circles, from ``sklearn.datasets.make_moons``.

    Args:
        n: number of points (half per class, scikit-learn's split), at least 2.
        noise: standard deviation of the Gaussian noise added to the points, ``>= 0``.
        seed: scikit-learn's ``random_state``.
        dtype: floating-point dtype of ``x``.

    Returns:
        ``x`` of shape ``(n, 2)`` and labels ``y`` of shape ``(n,)`` in ``{0, 1}``.

    Raises:
        ImportError: without scikit-learn (the ``examples`` extra).
        ValueError: naming the argument, for ``n < 2`` or a negative ``noise``.

    Example:
        >>> x, y = two_moons(n=10, seed=1)
        >>> x.shape, sorted(y.unique().tolist())
        (torch.Size([10, 2]), [0, 1])
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an integer >= 2; got {n!r}")
    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise must be finite and >= 0; got {noise!r}")
    try:
        from sklearn.datasets import make_moons
    except ImportError as error:
        raise ImportError(
            "two_moons needs scikit-learn; install it with the examples extra: pip install 'ntkgp[examples]'"
        ) from error
    x, y = make_moons(n_samples=n, noise=noise, random_state=seed)
    return torch.as_tensor(x, dtype=dtype), torch.as_tensor(y, dtype=torch.long)


def load_snelson(data_dir: PathType, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """The Snelson 1-D regression set (Snelson & Ghahramani, 2006).

    Args:
        data_dir: the benchmark data folder (see the module docstring for its layout).
        dtype: floating-point dtype of the returned tensors.

    Returns:
        ``x_train`` ``(200, 1)``, ``y_train`` ``(200, 1)`` and ``x_test`` ``(301, 1)`` (a grid on
        [-3, 10]), unnormalized.

    Raises:
        FileNotFoundError: naming ``data_dir``, what it holds and the expected layout.

    Example:
        >>> x_train, y_train, x_test = load_snelson(resolve_data_dir())  # doctest: +SKIP
    """
    files = [
        _data_file(data_dir, ("toy", f"snelson_{stem}.dat"), _SNELSON_LAYOUT)
        for stem in ("train_inputs", "train_outputs", "test_inputs")
    ]
    x_train, y_train, x_test = (_column(np.loadtxt(file, ndmin=1), dtype) for file in files)
    return x_train, y_train, x_test


def load_banana(
    data_dir: PathType, full: bool = False, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """The 2-D banana classification set.

    Args:
        data_dir: the benchmark data folder (see the module docstring for its layout).
        full: ``False`` for the 400-point subset (``banana_400_*.csv``), ``True`` for all 5300
            points (``banana_5300.csv``, labels 1/2).
        dtype: floating-point dtype of ``x``.

    Returns:
        ``x`` ``(N, 2)`` and labels ``y`` ``(N,)`` in ``{0, 1}``.

    Raises:
        FileNotFoundError: naming ``data_dir``, what it holds and the expected layout.

    Example:
        >>> x, y = load_banana(resolve_data_dir())  # doctest: +SKIP
    """
    if full:
        table = np.loadtxt(_data_file(data_dir, ("toy", "banana_5300.csv"), _BANANA_LAYOUT), delimiter=",")
        x, raw_labels = table[:, :2], table[:, 2]
    else:
        x = np.loadtxt(_data_file(data_dir, ("toy", "banana_400_X.csv"), _BANANA_LAYOUT), delimiter=",")
        raw_labels = np.loadtxt(
            _data_file(data_dir, ("toy", "banana_400_y.csv"), _BANANA_LAYOUT), delimiter=","
        )
    labels, _ = _encode_labels(raw_labels)
    return torch.as_tensor(x, dtype=dtype), torch.as_tensor(labels, dtype=torch.long)


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
        data_dir: the benchmark data folder (see the module docstring for its layout).
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
        ValueError: for a ``split`` out of range or a ``val_fraction`` outside ``[0, 1)``.

    Example:
        >>> split = load_uci_regression(resolve_data_dir(), "boston", split=0)  # doctest: +SKIP
    """
    if not (isinstance(val_fraction, (int, float)) and math.isfinite(val_fraction) and 0 <= val_fraction < 1):
        raise ValueError(f"val_fraction must be in [0, 1); got {val_fraction!r}")
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
        data_dir: the benchmark data folder (see the module docstring for its layout).
        name: ``"australian"``, ``"breast_cancer"`` or ``"glass"``.
        seed: seed of the random split.
        dtype: floating-point dtype of the inputs.
        split: ``"random"`` or ``"distributed"``.
        fractions: ``(train, validation)`` fractions of the random split, both positive, sum below 1.

    Returns:
        :class:`ClassificationSplit` ``(x_train, y_train, x_val, y_val, x_test, y_test, num_classes)``.

    Raises:
        FileNotFoundError: naming ``data_dir``, what it holds and the expected layout.
        ValueError: for an unknown ``name`` or ``split``, ``split="distributed"`` with ``glass``, or bad
            ``fractions``.

    Example:
        >>> split = load_uci_classification(resolve_data_dir(), "glass", seed=0)  # doctest: +SKIP
    """
    if name not in _UCI_CLASSIFICATION_NAMES:
        raise ValueError(f"name must be one of {_UCI_CLASSIFICATION_NAMES}; got {name!r}")
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


def load_csv(
    path: PathType,
    input_columns: Sequence[str | int] | str | int,
    target_column: str | int,
    task: Literal["regression", "classification"] = "regression",
    delimiter: str = ",",
    dtype: torch.dtype = torch.float64,
) -> CsvData:
    """Load a user's CSV file with a header row, checking every cell before returning.

    Columns are chosen by header name or by 0-based index (negative indices count from the end). Input
    cells (and regression targets) must be finite numbers. For ``task="classification"`` the target cells
    may be any text; the classes are sorted (numerically when every label is a finite number, e.g.
    ``2 < 10``, otherwise alphabetically) and mapped to ``0..C-1``. Blank lines are skipped; a UTF-8 byte
    order mark is dropped from the first header name; no normalization is applied.

    Args:
        path: the CSV file.
        input_columns: header names or indices of the input columns (one name or index is accepted too).
        target_column: header name or index of the target column.
        task: ``"regression"`` (float targets) or ``"classification"`` (class labels).
        delimiter: the field separator.
        dtype: floating-point dtype of ``x`` (and of regression targets).

    Returns:
        :class:`CsvData` ``(x, y, input_names, class_names)``.

    Raises:
        FileNotFoundError: if ``path`` is not a file.
        ValueError: naming the file, the line and the column: a file that is not UTF-8 text, an empty file, a duplicated header name, an
            unknown column, a row with the wrong number of fields, a cell that is not a number, a NaN or
            infinite cell, a missing label, a NaN or infinite label among numeric ones; or an unknown ``task``.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "data.csv"
        >>> _ = path.write_text("a,b,label\\n0.5,1,cat\\n1.5,2,dog\\n")
        >>> data = load_csv(path, ["a", "b"], "label", task="classification")
        >>> data.x.shape, data.y.tolist(), data.class_names
        (torch.Size([2, 2]), [0, 1], ['cat', 'dog'])
    """
    if task not in ("regression", "classification"):
        raise ValueError(f"task must be 'regression' or 'classification'; got {task!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CSV file {str(path)!r} not found")
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle, delimiter=delimiter)
            numbered = [(reader.line_num, row) for row in reader if any(cell.strip() for cell in row)]
    except UnicodeDecodeError as problem:
        raise ValueError(f"{path} is not UTF-8 text ({problem.reason} at byte {problem.start})") from None
    except csv.Error as problem:
        raise ValueError(f"{path}, line {reader.line_num}: {problem}") from None
    if not numbered:
        raise ValueError(f"{path} is empty; expected a header row followed by data rows")
    header = [name.strip() for name in numbered[0][1]]
    seen: dict[str, int] = {}
    for position, name in enumerate(header):
        if name in seen:
            raise ValueError(
                f"{path}, line {numbered[0][0]}: header name {name!r} appears twice (columns {seen[name]} and "
                f"{position}, 0-based); header names must be unique"
            )
        seen[name] = position
    lines = [line for line, _ in numbered[1:]]
    body = [row for _, row in numbered[1:]]
    if isinstance(input_columns, (str, int)):
        input_columns = [input_columns]
    inputs = [_column_index(header, column, path) for column in input_columns]
    target = _column_index(header, target_column, path)
    if target in inputs:
        raise ValueError(f"target column {header[target]!r} is also listed among the input columns")
    for line, row in zip(lines, body):
        if len(row) != len(header):
            raise ValueError(f"{path}, line {line}: {len(row)} fields, but the header has {len(header)}")
    x_values = [[_number(row[i], line, header[i], path) for i in inputs] for line, row in zip(lines, body)]
    x = torch.tensor(x_values, dtype=dtype).reshape(len(body), len(inputs))
    input_names = [header[i] for i in inputs]
    if task == "regression":
        y_values = [_number(row[target], line, header[target], path) for line, row in zip(lines, body)]
        return CsvData(x, torch.tensor(y_values, dtype=dtype).reshape(-1, 1), input_names, None)
    texts = [row[target].strip() for row in body]
    for line, text in zip(lines, texts):
        if not text:
            raise ValueError(f"{path}, line {line}, column {header[target]!r}: missing label")
    try:
        keys: list[float] | list[str] = [float(text) for text in texts]
    except ValueError:
        keys = texts
    else:
        # numeric labels: a NaN or infinite one is a missing or corrupt value, not a class of its own
        for line, key, text in zip(lines, keys, texts):
            if not math.isfinite(key):
                raise ValueError(
                    f"{path}, line {line}, column {header[target]!r}: label {text!r} is NaN or infinite while the "
                    "other labels are numbers"
                )
    classes = sorted(set(keys))
    first_text: dict[float | str, str] = {}
    for key, text in zip(keys, texts):
        first_text.setdefault(key, text)
    code = {key: k for k, key in enumerate(classes)}
    y = torch.tensor([code[key] for key in keys], dtype=torch.long)
    return CsvData(x, y, input_names, [first_text[key] for key in classes])


def _data_file(data_dir: PathType, parts: tuple[str, ...], layout: str) -> Path:
    """Return ``data_dir/parts``, or raise ``FileNotFoundError`` naming ``data_dir`` and ``layout``."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"data_dir={str(data_dir)!r} is not a directory. Pass the benchmark data folder "
            f"(--data-dir PATH or {DATA_DIR_VARIABLE}=PATH), laid out as {layout}"
        )
    path = root.joinpath(*parts)
    if not path.is_file():
        folder = path.parent
        while not folder.is_dir():
            folder = folder.parent
        names = sorted(p.name for p in folder.iterdir())
        listing = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
        hint = f"{folder} holds: {listing or 'nothing'}"
        raise FileNotFoundError(
            f"{path} not found under data_dir={str(data_dir)!r} ({hint}); expected layout: {layout}"
        )
    return path


def _column(values: np.ndarray, dtype: torch.dtype) -> Tensor:
    """``(N,)`` array to an ``(N, 1)`` tensor."""
    return torch.as_tensor(values, dtype=dtype).reshape(-1, 1)


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


def _column_index(header: list[str], column: str | int, path: Path) -> int:
    """Resolve a header name or a (possibly negative) index to a 0-based column index."""
    if isinstance(column, int):
        if not -len(header) <= column < len(header):
            raise ValueError(f"column index {column} out of range: {path} has {len(header)} columns")
        return column % len(header)
    if column not in header:
        raise ValueError(f"column {column!r} not in the header of {path}: {header}")
    return header.index(column)


def _number(text: str, line: int, column: str, path: Path) -> float:
    """Parse one numeric cell, with a message pointing at the cell on failure."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{path}, line {line}, column {column!r}: cannot read {text!r} as a number"
        ) from None
    if math.isnan(value):
        raise ValueError(f"{path}, line {line}, column {column!r}: missing value ({text.strip()!r}, NaN)")
    if math.isinf(value):
        raise ValueError(f"{path}, line {line}, column {column!r}: {text.strip()!r} is not a finite number")
    return value
