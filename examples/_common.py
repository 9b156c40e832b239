"""Helpers shared by the example scripts (run them from the repository root: ``python examples/NAME.py``).

Python puts the script's folder first on ``sys.path``, so the examples import this module as ``_common``.
The table and the network come from :mod:`ntkgp.demo` (the ``ntkgp demo`` command uses the same ones).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ntkgp.datasets import DATA_DIR_VARIABLE, resolve_data_dir
from ntkgp.demo import format_table, mlp

__all__ = ["add_data_arguments", "format_table", "load_data", "load_data_or_stand_in", "mlp"]

T = TypeVar("T")


def add_data_arguments(parser: argparse.ArgumentParser, quick_help: str | None = None) -> None:
    """Add ``--data-dir``, ``--output-dir`` (default ``examples-output``) and, when ``quick_help`` is given,
    ``--quick`` to an example's parser."""
    parser.add_argument("--data-dir", help=f"the benchmark data folder (default: ${DATA_DIR_VARIABLE}; without "
                        "either, a synthetic or bundled stand-in data set is used and named in the output)")
    parser.add_argument("--output-dir", type=Path, default=Path("examples-output"),
                        help="folder for the figure (default: %(default)s)")
    if quick_help is not None:
        parser.add_argument("--quick", action="store_true", help=quick_help)


def load_data(data_dir: str | None, loader: Callable[[Path], T]) -> T:
    """``loader(folder)`` for the folder of ``--data-dir`` (or ``NTKGP_DATA_DIR``); on a missing folder or
    file, print the message (naming the path and the expected layout) and exit with status 1."""
    try:
        return loader(resolve_data_dir(data_dir))
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def load_data_or_stand_in(data_dir: str | None, loader: Callable[[Path], T], real: str,
                          stand_in: Callable[[], T], stand_in_name: str) -> tuple[T, str]:
    """The real data set when a data folder is given (``--data-dir`` or ``NTKGP_DATA_DIR``), else a stand-in.

    A data folder that is given but missing (or lacks the files) is an error: the message names the path and
    the expected layout, and the script exits with status 1. With no folder given at all, ``stand_in()`` is
    used and a note on stderr says so (the example still runs without the benchmark data).

    Returns:
        The data and a line naming them (``real`` or ``stand_in_name``), which the example prints.
    """
    if data_dir is None and not os.environ.get(DATA_DIR_VARIABLE):
        print(f"note: no data folder given (--data-dir PATH or {DATA_DIR_VARIABLE}=PATH); using {stand_in_name} "
              f"instead of {real}", file=sys.stderr)
        return stand_in(), f"{stand_in_name} (stand-in: no data folder given)"
    return load_data(data_dir, loader), real
