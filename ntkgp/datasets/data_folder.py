"""The benchmark data folder: where it is (``--data-dir`` or ``NTKGP_DATA_DIR``) and finding a file in it."""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path

__all__ = ["DATA_DIR_VARIABLE", "resolve_data_dir"]

PathType = str | PathLike

DATA_DIR_VARIABLE = "NTKGP_DATA_DIR"
"""The environment variable :func:`resolve_data_dir` reads when no folder is passed."""

_LAYOUT = (
    "toy/ (snelson_*.dat, banana_*.csv), uci_regression/NAME/ (data.txt, index_*.txt, n_splits.txt), "
    "uci_classification/NAME/"
)


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
    if data_dir is None:
        raise FileNotFoundError(
            f"no data folder given: pass --data-dir PATH (or data_dir=) or set {DATA_DIR_VARIABLE}=PATH; "
            f"the folder holds {_LAYOUT}"
        )
    folder = Path(data_dir)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"data folder {str(folder)!r} not found: pass --data-dir PATH (or set {DATA_DIR_VARIABLE}) pointing "
            f"at a folder that holds {_LAYOUT}"
        )
    return folder.resolve()


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
        raise FileNotFoundError(
            f"{path} not found under data_dir={str(data_dir)!r} ({_listing(path.parent)}); expected layout: {layout}"
        )
    return path


def _listing(folder: Path) -> str:
    """``"FOLDER holds: a, b, ..."`` for the nearest existing folder at or above ``folder`` (20 names at most)."""
    while not folder.is_dir():
        folder = folder.parent
    names = sorted(p.name for p in folder.iterdir())
    listing = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
    return f"{folder} holds: {listing or 'nothing'}"
