"""Function space or weight space: the Laplace wing chooses in one place (``ntkgp.laplace.ggn.space``), and its two
spaces stand on ``ntkgp.laplace.ggn`` without importing each other.

The import checks read the package's source (``ast``), so they fail as soon as a module adds such an import; the
rules of :func:`exact_space` are checked at the sizes on either side of each threshold, and :func:`site_columns`
against the rank of the per-point curvature computed from the likelihood's Hessian and gradient."""

from __future__ import annotations

import ast
from pathlib import Path

import gpytorch
import pytest
import torch

import ntkgp.laplace
from ntkgp.laplace.ggn.space import (
    LOW_PRECISION_WEIGHT_FACTOR,
    STEPS_FOR_THE_STEP_RULE,
    exact_space,
    has_function_form,
    site_columns,
)
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood, gradient, hessian
from ntkgp.options import WEIGHT_SPACE_FROM, Space

LAPLACE = Path(ntkgp.laplace.__file__).parent


def _imports(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(LAPLACE.parent.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize(("here", "never"), [
    ("function_space", "weight_space"),
    ("weight_space", "function_space"),
    ("ggn", "function_space"),
    ("ggn", "weight_space"),
])
def test_the_spaces_do_not_import_each_other(here, never):
    files = sorted((LAPLACE / here).rglob("*.py"))  # the subpackages too (weight_space: one per approximation)
    assert files
    forbidden = f"ntkgp.laplace.{never}"
    found = {str(f.relative_to(LAPLACE)): sorted(n for n in _imports(f) if n == forbidden
                                                 or n.startswith(forbidden + ".")) for f in files}
    assert not {name: hits for name, hits in found.items() if hits}


def test_the_import_reader_sees_relative_imports():
    """The reader above resolves ``from ..ggn.space import x`` in function_space to ``ntkgp.laplace.ggn.space``."""
    names = _imports(LAPLACE / "function_space" / "evidence.py")
    assert "ntkgp.laplace.ggn.space" in names and "ntkgp.laplace.function_space.routes" in names


def test_only_the_space_module_resolves_auto_in_the_laplace_wing():
    """``choose_space`` (the measured rule) is called in ``ggn/space.py`` alone; every other module asks it."""
    callers = []
    for path in sorted(LAPLACE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "choose_space":
                callers.append(str(path.relative_to(LAPLACE)))
    assert callers == ["ggn/space.py"]


def test_exact_space_rules_on_either_side_of_each_threshold():
    p = 100
    below, above = int(WEIGHT_SPACE_FROM * p), int(WEIGHT_SPACE_FROM * p) + 1  # R ≤ 0.85 P < R'
    assert exact_space("auto", p, below) is Space.FUNCTION
    assert exact_space("auto", p, above) is Space.WEIGHT
    # an explicit space is returned as it is, whatever the sizes and the other rules
    assert exact_space("function", p, 10 * p, function_form=False, dtype=torch.float32) is Space.FUNCTION
    assert exact_space(Space.WEIGHT, p, 1, steps=1) is Space.WEIGHT
    # no function-space form: weight space
    assert exact_space("auto", p, 1, function_form=False) is Space.WEIGHT
    # few steps per build: function space while R ≤ P, the measured rule from STEPS_FOR_THE_STEP_RULE steps on
    assert exact_space("auto", p, p, steps=STEPS_FOR_THE_STEP_RULE - 1) is Space.FUNCTION
    assert exact_space("auto", p, p + 1, steps=1) is Space.WEIGHT
    assert exact_space("auto", p, p, steps=STEPS_FOR_THE_STEP_RULE) is Space.WEIGHT
    # lower precision: weight space up to P ≤ LOW_PRECISION_WEIGHT_FACTOR · R
    rows = p // LOW_PRECISION_WEIGHT_FACTOR
    assert exact_space("auto", p, rows, dtype=torch.float32) is Space.WEIGHT
    assert exact_space("auto", p, rows - 1, dtype=torch.float32) is Space.FUNCTION
    assert exact_space("auto", p, rows, dtype=torch.float64) is Space.FUNCTION
    with pytest.raises(ValueError, match="space"):
        exact_space("both", p, rows)


@pytest.mark.parametrize(("likelihood", "c"), [
    (SoftmaxLikelihood(4), 4),
    (LogisticLikelihood(), 1),
    (gpytorch.likelihoods.GaussianLikelihood(), 1),
    (gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3), 3),
])
def test_site_columns_is_the_rank_of_the_per_point_curvature(likelihood, c):
    """k of the GGN is the rank of Λ_n (the likelihood's Hessian in f); of the EF, the rank of g_n g_nᵀ."""
    likelihood = likelihood.double()
    torch.manual_seed(0)
    f = torch.randn(5, c, dtype=torch.float64)
    if isinstance(likelihood, SoftmaxLikelihood):
        y = torch.randint(0, c, (5,))
    elif isinstance(likelihood, LogisticLikelihood):
        y = torch.randint(0, 2, (5,)).double()
    else:
        y = torch.randn(5, c, dtype=torch.float64).squeeze(-1)
    lam = hessian(likelihood, f, y)
    g = gradient(likelihood, f, y)
    ggn_rank = int(torch.linalg.matrix_rank(lam[0]))
    ef_rank = int(torch.linalg.matrix_rank(g[0, :, None] * g[0, None, :]))
    assert site_columns(likelihood, c, "ggn") == ggn_rank
    assert site_columns(likelihood, c, "ef") == ef_rank == 1


def test_has_function_form():
    """Only the empirical Fisher of a Gaussian likelihood with several outputs has no function-space form."""
    multitask = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3)
    assert not has_function_form(multitask, 3, "ef")
    assert has_function_form(multitask, 3, "ggn")
    assert has_function_form(gpytorch.likelihoods.GaussianLikelihood(), 1, "ef")
    assert has_function_form(SoftmaxLikelihood(3), 3, "ef")
