r"""The idx format of MNIST and Fashion-MNIST (LeCun et al.), plain or gzip-compressed.

An idx file is a 4-byte magic number ``00 00 08 D`` (``08``: unsigned bytes, ``D``: the number of dimensions),
``D`` big-endian 32-bit sizes, then the bytes in C order. Image files have ``D = 3`` (``N, 28, 28``), label files
``D = 1`` (``N``). A file starting with the gzip magic ``1f 8b`` is decompressed first, whatever its name.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np

IDX_STEMS = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
"""The names of the four files (each ``NAME.gz`` or ``NAME``), as distributed and as torchvision stores them."""

_GZIP_MAGIC = b"\x1f\x8b"
_UNSIGNED_BYTE = 0x08


def _read_bytes(path: Path) -> bytes:
    """The contents of ``path``, gunzipped when it starts with the gzip magic."""
    raw = path.read_bytes()
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as problem:
        raise ValueError(f"{path}: a corrupt or truncated gzip file ({problem})") from None


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """The ``uint8`` array of the idx file ``path``, which must have ``ndim`` dimensions."""
    raw = _read_bytes(path)
    header = 4 + 4 * ndim
    expected_magic = bytes([0, 0, _UNSIGNED_BYTE, ndim])
    if raw[:4] != expected_magic:
        raise ValueError(
            f"{path}: not an idx file of unsigned bytes with {ndim} dimension(s): it starts with "
            f"{raw[:4].hex(' ') or 'nothing'}, expected {expected_magic.hex(' ')}"
        )
    if len(raw) < header:
        raise ValueError(f"{path}: truncated idx header ({len(raw)} bytes, expected at least {header})")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    size = math.prod(shape)
    if len(raw) != header + size:
        raise ValueError(
            f"{path}: the header announces shape {shape} ({header + size} bytes) but the file holds {len(raw)} "
            "bytes (truncated or corrupt)"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _idx_files(folder: Path) -> dict[str, Path] | None:
    """The four idx files in ``folder`` (``NAME.gz`` preferred to ``NAME``); ``None`` when none is there.

    Raises ``FileNotFoundError`` naming the missing ones when some but not all four are there.
    """
    found: dict[str, Path] = {}
    for key, stem in IDX_STEMS.items():
        for name in (f"{stem}.gz", stem):
            if (folder / name).is_file():
                found[key] = folder / name
                break
    if not found:
        return None
    missing = [IDX_STEMS[key] for key in IDX_STEMS if key not in found]
    if missing:
        raise FileNotFoundError(
            f"{folder} holds some of the four idx files but not {', '.join(missing)} (with or without .gz)"
        )
    return found


def _read_idx_split(files: dict[str, Path], num_classes: int = 10) -> tuple[np.ndarray, ...]:
    """``(train_images, train_labels, test_images, test_labels)`` from the four files, checked.

    Images are ``uint8`` ``(N, 28, 28)``; labels ``uint8`` ``(N,)`` in ``0..num_classes-1``, as many as images.
    """
    arrays = []
    for part in ("train", "test"):
        images = _read_idx(files[f"{part}_images"], 3)
        labels = _read_idx(files[f"{part}_labels"], 1)
        if images.shape[1:] != (28, 28):
            raise ValueError(f"{files[f'{part}_images']}: images of {images.shape[1:]} pixels, expected (28, 28)")
        if len(labels) != len(images):
            raise ValueError(
                f"{files[f'{part}_labels']} holds {len(labels)} labels but {files[f'{part}_images']} holds "
                f"{len(images)} images"
            )
        if len(labels) and int(labels.max()) >= num_classes:
            raise ValueError(
                f"{files[f'{part}_labels']}: label {int(labels.max())} outside 0..{num_classes - 1}"
            )
        arrays += [images, labels]
    return tuple(arrays)
