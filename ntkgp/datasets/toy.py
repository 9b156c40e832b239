"""The toy benchmark sets of the data folder: Snelson's 1-D regression and the 2-D banana classification."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..validation import float_dtype
from .data_folder import PathType, _data_file
from .preprocessing import _encode_labels

__all__ = ["load_banana", "load_snelson"]

_SNELSON_LAYOUT = (
    "data_dir/toy/{snelson_train_inputs.dat, snelson_train_outputs.dat, snelson_test_inputs.dat}"
)
_BANANA_LAYOUT = (
    "data_dir/toy/{banana_400_X.csv, banana_400_y.csv} (full=False) or data_dir/toy/banana_5300.csv"
)


def load_snelson(data_dir: PathType, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """The Snelson 1-D regression set (Snelson & Ghahramani, 2006).

    Args:
        data_dir: the benchmark data folder (see :mod:`ntkgp.datasets` for its layout).
        dtype: floating-point dtype of the returned tensors.

    Returns:
        ``x_train`` ``(200, 1)``, ``y_train`` ``(200, 1)`` and ``x_test`` ``(301, 1)`` (a grid on
        [-3, 10]), unnormalized.

    Raises:
        FileNotFoundError: naming ``data_dir``, what it holds and the expected layout.
        ValueError: for a ``dtype`` that is not floating point.

    Example:
        >>> x_train, y_train, x_test = load_snelson(resolve_data_dir())  # doctest: +SKIP
    """
    float_dtype(dtype)
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
        data_dir: the benchmark data folder (see :mod:`ntkgp.datasets` for its layout).
        full: ``False`` for the 400-point subset (``banana_400_*.csv``), ``True`` for all 5300
            points (``banana_5300.csv``, labels 1/2).
        dtype: floating-point dtype of ``x``.

    Returns:
        ``x`` ``(N, 2)`` and labels ``y`` ``(N,)`` in ``{0, 1}``.

    Raises:
        FileNotFoundError: naming ``data_dir``, what it holds and the expected layout.
        ValueError: for a ``dtype`` that is not floating point.

    Example:
        >>> x, y = load_banana(resolve_data_dir())  # doctest: +SKIP
    """
    float_dtype(dtype)
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


def _column(values: np.ndarray, dtype: torch.dtype) -> Tensor:
    """``(N,)`` array to an ``(N, 1)`` tensor."""
    return torch.as_tensor(values, dtype=dtype).reshape(-1, 1)
