"""The ``ntkgp`` command line: argument parsing, input checks and exit codes (the demo is :mod:`ntkgp.demo`).

``ntkgp demo`` (also ``python -m ntkgp demo``) runs :func:`ntkgp.demo.run_demo` on the built-in problems or
on a CSV file. Exit status:

- ``0``: the demo ran; the table went to stdout, the figures to ``--output-dir``.
- ``2``: a usage or input error, reported on stderr before any training: an unknown option, a missing or
  unreadable CSV file, an unknown column, a cell that is not a finite number (naming file, line and column),
  a column whose values overflow when standardized, a duplicated header name, too few rows or a single class,
  ``--epochs`` < 1, a ``--seed`` outside ``0..4294967294``, an ``--output-dir`` that is not a folder or cannot be
  created or written to, or a missing optional dependency (matplotlib, scikit-learn).
- ``1``: anything else (an unexpected error, with its traceback).

See ``docs/cli_and_examples.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from . import demo, plotting

__all__ = ["build_parser", "main"]

_MAX_SEED = 2**32 - 2
"""Largest ``--seed``: the demo seeds scikit-learn's ``make_moons`` (a NumPy ``RandomState``, ``0..2**32 - 1``)
with ``seed`` and ``seed + 1``."""


def build_parser() -> argparse.ArgumentParser:
    """The ``ntkgp`` argument parser (one subcommand, ``demo``).

    Returns:
        The parser; ``parse_args`` exits with status 2 on a usage error.
    """
    parser = argparse.ArgumentParser(prog="ntkgp", description="Trained PyTorch networks as Gaussian processes.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="train, build NTKGP and SFR, update with new data, print a table and save figures",
        description="Train a small network with online evidence optimization (Algorithm 1), build NTKGP and SFR, "
        "condition both on a new batch, print evidence / test metrics / timings and save before/after figures. "
        "Runs on a 1-D gap regression and two-moons classification, or on your own CSV file (--csv).")
    demo.add_argument("--output-dir", type=Path, default=Path("ntkgp-demo-output"),
                      help="folder for the PNG figures (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="seed of data, initialization and splits (default: 0)")
    demo.add_argument("--quick", action="store_true", help="a tiny configuration (seconds; for tests)")
    demo.add_argument("--epochs", type=int, help="training epochs (default: 1000, or 30 with --quick)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars or status lines")
    own = demo.add_argument_group("your own data (replaces the built-in problems)")
    own.add_argument("--csv", type=Path, metavar="PATH", help="a CSV file with a header row")
    own.add_argument("--input-columns", nargs="+", metavar="NAME", help="header names of the input columns")
    own.add_argument("--target-column", metavar="NAME", help="header name of the target column")
    own.add_argument("--task", choices=("regression", "classification"), default="regression",
                     help="what the target is (default: regression)")
    demo.set_defaults(error=demo.error)
    return parser


def _demo(args: argparse.Namespace) -> int:
    """Run ``ntkgp demo`` with parsed ``args``; every input is checked first, errors exit with status 2."""
    error: Callable[[str], NoReturn] = args.error
    if args.csv is None and (args.input_columns or args.target_column):
        error("--input-columns and --target-column need --csv")
    if args.csv is not None and not (args.input_columns and args.target_column):
        error("--csv needs --input-columns and --target-column")
    if args.epochs is not None and args.epochs < 1:
        error(f"--epochs must be positive, got {args.epochs}")
    if not 0 <= args.seed <= _MAX_SEED:
        error(f"--seed must be >= 0 and <= {_MAX_SEED}, got {args.seed}")
    if args.output_dir.exists() and not args.output_dir.is_dir():
        error(f"--output-dir {str(args.output_dir)!r} exists and is not a folder")

    config = replace(demo.QUICK if args.quick else demo.DEFAULT, seed=args.seed, progress=not args.no_progress)
    if args.epochs is not None:
        config = replace(config, epochs=args.epochs)
    try:
        plotting.require_matplotlib()
        if args.csv is not None:
            tasks = [demo.csv_task(args.csv, args.input_columns, args.target_column, args.task, seed=args.seed)]
        else:
            tasks = [demo.gap_regression_task(config), demo.two_moons_task(config)]
    except (ImportError, OSError, ValueError) as problem:
        error(str(problem))
    _prepare_output_dir(args.output_dir, error)

    def log(message: str) -> None:
        if config.progress:
            print(message, file=sys.stderr, flush=True)

    result = demo.run_demo(tasks, config, args.output_dir, log)
    print(result.report())
    return 0


def _prepare_output_dir(output_dir: Path, error: Callable[[str], NoReturn]) -> None:
    """Create ``output_dir`` (with its parents) and check that a file can be written in it, before training."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as problem:
        reason = problem.strerror or str(problem)
        error(f"--output-dir {str(output_dir)!r} cannot be created or written to: {reason}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ntkgp`` console script.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status, ``0`` on success (usage and input errors raise ``SystemExit(2)`` through argparse).
    """
    args = build_parser().parse_args(argv)
    return _demo(args)
