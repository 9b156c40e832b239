"""Audit cases of the command line ``python -m ntkgp demo`` with bad arguments and bad CSV files.

Documented (docs/cli_and_examples.md, "Exit status"): a usage or input error exits with status 2 and a message
on stderr before any training, with no traceback. One case runs the real entry point in a fresh interpreter;
the others call ``ntkgp.cli.main`` in-process (the same code, without an interpreter start per case), always
with ``--quick --epochs 1`` so that an argument accepted by mistake costs seconds, not minutes.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .framework import CLEAR, SilentWrong, case

AREA = "cli"
ROOT = Path(__file__).resolve().parents[2]


def _main(*argv: str, expect: tuple[str, ...] = ()) -> tuple[str, str]:
    """Run ``ntkgp demo ARGV --quick --epochs 1``; exit 2 with a message naming one of ``expect`` is CLEAR."""
    from ntkgp import cli

    stderr, stdout = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory() as folder:
        args = ["demo", *argv, "--quick", "--no-progress"]
        if "--epochs" not in argv:
            args += ["--epochs", "1"]
        if "--output-dir" not in argv:
            args += ["--output-dir", str(Path(folder) / "out")]
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            try:
                status = cli.main(args)
            except SystemExit as exit_:
                status = exit_.code
    return _judge(status, stderr.getvalue(), expect)


def _judge(status, message: str, expect: tuple[str, ...]) -> tuple[str, str]:
    if status == 0:
        raise SilentWrong("exit status 0: the demo ran on a bad argument")
    last = message.strip().splitlines()[-1][:200] if message.strip() else ""
    if status != 2:
        raise RuntimeError(f"exit status {status}: {last}")
    if "Traceback" in message:
        raise RuntimeError(f"exit status 2 but a traceback on stderr: {last}")
    if expect and not any(e in message for e in expect):
        raise RuntimeError(f"exit status 2 but the message names none of {expect}: {message.strip()[-200:]}")
    return CLEAR, "exit 2: " + message.strip().splitlines()[-1][:160]


def _csv(text: str, suffix: str = ".csv", mode: str = "w") -> Path:
    handle = tempfile.NamedTemporaryFile(mode, suffix=suffix, delete=False)
    with handle:
        handle.write(text)
    return Path(handle.name)


def _rows(n: int = 20, extra: str = "") -> str:
    return "a,b,y\n" + "".join(f"{i / n},{(i * 7 % n) / n},{(i % 3) / 2}\n" for i in range(n)) + extra


@case("cli-01", AREA, "python -m ntkgp demo --epochs abc (a fresh interpreter)")
def epochs_not_a_number():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "ntkgp", "demo", "--epochs", "abc", "--output-dir", folder]
        run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=folder)
    return _judge(run.returncode, run.stderr, ("--epochs",))


@case("cli-02", AREA, "--seed 1.5")
def fractional_seed():
    return _main("--seed", "1.5", expect=("--seed",))


@case("cli-03", AREA, "--csv naming a directory")
def csv_is_directory():
    with tempfile.TemporaryDirectory() as folder:
        return _main("--csv", folder, "--input-columns", "a", "--target-column", "y",
                     expect=(folder, "--csv"))


@case("cli-04", AREA, "--csv with a header row and no data rows")
def csv_header_only():
    path = _csv("a,b,y\n")
    try:
        return _main("--csv", str(path), "--input-columns", "a", "b", "--target-column", "y",
                     expect=(str(path),))
    finally:
        path.unlink()


@case("cli-05", AREA, "--target-column also listed in --input-columns")
def target_among_inputs():
    path = _csv(_rows())
    try:
        return _main("--csv", str(path), "--input-columns", "a", "y", "--target-column", "y",
                     expect=("'y'", "target"))
    finally:
        path.unlink()


@case("cli-06", AREA, "--input-columns a a (a column twice)")
def input_column_twice():
    path = _csv(_rows())
    try:
        return _main("--csv", str(path), "--input-columns", "a", "a", "--target-column", "y", expect=("'a'",))
    finally:
        path.unlink()


@case("cli-07", AREA, "--output-dir below a regular file (file.txt/sub)")
def output_dir_below_file():
    path = _csv("not a folder")
    try:
        return _main("--output-dir", str(path / "sub"), expect=("--output-dir",))
    finally:
        path.unlink()


@case("cli-08", AREA, "--csv with an empty input cell")
def csv_empty_cell():
    path = _csv(_rows(extra="0.5,,1\n"))
    try:
        return _main("--csv", str(path), "--input-columns", "a", "b", "--target-column", "y",
                     expect=("line 22", "'b'"))
    finally:
        path.unlink()


@case("cli-09", AREA, "python -m ntkgp with no subcommand")
def no_subcommand():
    from ntkgp import cli

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            status = cli.main([])
        except SystemExit as exit_:
            status = exit_.code
    return _judge(status, stderr.getvalue(), ("COMMAND", "command"))


@case("cli-10", AREA, "--task classification on a target column with a single class")
def single_class():
    path = _csv("a,b,y\n" + "".join(f"{i},{i * 2},cat\n" for i in range(20)))
    try:
        return _main("--csv", str(path), "--input-columns", "a", "b", "--target-column", "y", "--task",
                     "classification", expect=("class",))
    finally:
        path.unlink()


@case("cli-11", AREA, "--csv with a regression target that is text ('abc')")
def text_regression_target():
    path = _csv(_rows(extra="0.5,0.5,abc\n"))
    try:
        return _main("--csv", str(path), "--input-columns", "a", "b", "--target-column", "y",
                     expect=("'abc'", "line 22"))
    finally:
        path.unlink()


@case("cli-12", AREA, "--csv with a column index instead of a header name (--target-column 2)")
def column_index():
    path = _csv(_rows())
    try:
        return _main("--csv", str(path), "--input-columns", "a", "b", "--target-column", "2", expect=("'2'",))
    finally:
        path.unlink()
