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

import pytest

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


# Docstring examples (``pytest --doctest-modules``, on in pyproject.toml) run with a small classification
# setting in their namespace: ``net`` (4 inputs, a hidden layer, a ``head`` layer of 10 logits, float64, eval
# mode), ``x``/``y`` = ``x_train``/``y_train`` (40 points), ``x_test`` (1000 points), ``x_new``/``y_new``,
# ``x_batch``/``y_batch``, ``x_context``, ``likelihood``, ``model`` (an FSVI of ``net``) and the usual imports.
collect_ignore = ["ntkgp/__main__.py"]



@pytest.fixture(autouse=True)
def _docstring_namespace(request):
    from _pytest.doctest import DoctestItem

    if not isinstance(request.node, DoctestItem):
        yield
        return
    from collections import OrderedDict

    import gpytorch
    import torch

    import ntkgp
    from ntkgp.fsvi import FSVI
    from ntkgp.likelihoods import SoftmaxLikelihood
    from ntkgp.laplace.weight_space import KFACLaplace

    generator = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(OrderedDict(body=torch.nn.Linear(4, 16), act=torch.nn.Tanh(),
                                          head=torch.nn.Linear(16, 10))).double().eval()
    x = torch.randn(40, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 10, (40,), generator=generator)
    namespace = request.getfixturevalue("doctest_namespace")
    namespace.update(
        torch=torch, gpytorch=gpytorch, ntkgp=ntkgp, SoftmaxLikelihood=SoftmaxLikelihood, KFACLaplace=KFACLaplace,
        GaussianLikelihood=gpytorch.likelihoods.GaussianLikelihood, net=net, x=x, y=y, x_train=x, y_train=y,
        x_test=torch.randn(1000, 4, generator=generator, dtype=torch.float64),
        x_new=torch.randn(8, 4, generator=generator, dtype=torch.float64),
        y_new=torch.randint(0, 10, (8,), generator=generator), x_batch=x[:16], y_batch=y[:16],
        x_context=torch.randn(8, 4, generator=generator, dtype=torch.float64),
        likelihood=SoftmaxLikelihood(10), model=FSVI(net, SoftmaxLikelihood(10), prior_precision=1.0),
    )
    yield
