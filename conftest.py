"""Run every code block of README.md and docs/ (sybil): one namespace per page, top to bottom.

A ``python`` block is executed; a ``bash`` block is run with ``bash -euo pipefail`` from the repository
root, with this interpreter's folder first on ``PATH``. A block whose first line starts with
``# illustrative`` is shown to the reader as such and not run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
ILLUSTRATIVE = "# illustrative"

try:
    from sybil import Sybil
    from sybil.evaluators.python import PythonEvaluator
    from sybil.parsers.markdown import CodeBlockParser
except ImportError:  # sybil is a test dependency; without it the docs are simply not collected
    Sybil = None


def _is_illustrative(example) -> bool:
    return str(example.parsed).lstrip().startswith(ILLUSTRATIVE)


def _python(example):
    if _is_illustrative(example):
        return None
    return PythonEvaluator()(example)


def _bash(example):
    if _is_illustrative(example):
        return None
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("MPLBACKEND", "Agg")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", str(example.parsed)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"bash block at {example.path}:{example.line} exited {done.returncode}\n"
                             f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}")
    return None


def _setup(namespace):
    import matplotlib

    matplotlib.use("Agg")
    import torch

    namespace["__name__"] = "__doc__"
    namespace["_dtype"] = torch.get_default_dtype()
    namespace["_cwd"] = os.getcwd()
    os.chdir(ROOT)
    torch.manual_seed(0)


def _teardown(namespace):
    import torch

    torch.set_default_dtype(namespace["_dtype"])
    os.chdir(namespace["_cwd"])
    try:
        import matplotlib.pyplot as plt

        plt.close("all")
    except ImportError:  # pragma: no cover
        pass


if Sybil is not None:
    pytest_collect_file = Sybil(
        parsers=[CodeBlockParser("python", _python), CodeBlockParser("bash", _bash), CodeBlockParser("sh", _bash)],
        patterns=["*.md"],
        excludes=["_build/*", "*/_build/*"],
        setup=_setup,
        teardown=_teardown,
    ).pytest()
