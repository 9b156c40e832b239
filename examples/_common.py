"""Helpers shared by the example scripts (run them from the repository root: ``python examples/NAME.py``).

Python puts the script's folder first on ``sys.path``, so the examples import this module as ``_common``.
The table and the network come from :mod:`ntkgp.demo` (the ``ntkgp demo`` command uses the same ones).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ntkgp.datasets import DATA_DIR_VARIABLE, resolve_data_dir
from ntkgp.demo import format_table, mlp

__all__ = ["add_data_arguments", "format_table", "load_data", "mlp"]

T = TypeVar("T")


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--data-dir`` and ``--output-dir`` (default ``examples-output``) to an example's parser."""
    parser.add_argument("--data-dir", help=f"the benchmark data folder (default: ${DATA_DIR_VARIABLE})")
    parser.add_argument("--output-dir", type=Path, default=Path("examples-output"),
                        help="folder for the figure (default: %(default)s)")


def load_data(data_dir: str | None, loader: Callable[[Path], T]) -> T:
    """``loader(folder)`` for the folder of ``--data-dir`` (or ``NTKGP_DATA_DIR``); on a missing folder or
    file, print the message (naming the path and the expected layout) and exit with status 1."""
    try:
        return loader(resolve_data_dir(data_dir))
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
