r"""Function space or weight space: the one place where the Laplace wing resolves ``space="auto"``.

Every exact Laplace-GGN quantity (the evidence's log-determinant, its curvature, the site posterior and the GLM
covariance) has two representations of equal value (``docs/math.md``): **function space** factorizes an
:math:`R \times R` matrix, :math:`R = N k` the rows of the site factor (:func:`site_columns`: :math:`k = C - 1`
for a softmax GGN, :math:`C` for another GGN, 1 for the empirical Fisher), **weight space** a :math:`P \times P`
one. The space is a route, not a concept: each caller states its problem and :func:`exact_space` decides, by
these rules in this order (an explicit ``"function"`` or ``"weight"`` is returned as it is):

1. no function-space form (:func:`has_function_form`: the empirical Fisher of per-output Gaussian noises as a
   curvature object, whose unit rows have no single scale): weight space;
2. a build used for few steps (``steps < STEPS_FOR_THE_STEP_RULE``; Algorithm 1 at F = K = 1 builds one curvature
   per step): the step costs its build, :math:`R^2 P` operations in function space against :math:`R P^2` in weight
   space, so function space while :math:`R \le P`;
3. a precision lower than float64 (``dtype``): weight space up to :math:`P \le` ``LOW_PRECISION_WEIGHT_FACTOR``
   :math:`\cdot R` (at most about three times the flops): the function-space variance is a difference that loses
   every digit in float32 on ill-conditioned problems, the weight-space one a sum of squares
   (docs/guarantees.md, "Predictive variances");
4. otherwise the measured cost rule :func:`ntkgp.options.choose_space`: weight space when
   :math:`R >` ``WEIGHT_SPACE_FROM`` :math:`\cdot P`.
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood

from ...likelihoods import is_gaussian
from ...options import CurvatureKind, Space, choose, choose_space
from .scaling import unit_root_columns

__all__ = [
    "LOW_PRECISION_WEIGHT_FACTOR",
    "STEPS_FOR_THE_STEP_RULE",
    "exact_space",
    "has_function_form",
    "site_columns",
]

#: In lower precision than float64, ``"auto"`` takes weight space up to ``P ≤ LOW_PRECISION_WEIGHT_FACTOR · N·k``.
LOW_PRECISION_WEIGHT_FACTOR = 2

#: Fewer steps per build than this and a step's cost is its build: the space is chosen by the builds.
STEPS_FOR_THE_STEP_RULE = 10


def site_columns(likelihood: Likelihood, num_outputs: int, curvature: CurvatureKind | str = "ggn") -> int:
    """``k``, the columns of the site factor per data point: the function-space side is ``N·k`` rows.

    ``C − 1`` for a softmax GGN (whose :math:`\\Lambda_n` has that rank), ``C`` for another GGN, 1 for the empirical
    Fisher (:math:`L_n = g_n`)."""
    if choose(CurvatureKind, curvature, "curvature") is CurvatureKind.EF:
        return 1
    return unit_root_columns(likelihood, num_outputs)


def has_function_form(likelihood: Likelihood, num_outputs: int, curvature: CurvatureKind | str = "ggn") -> bool:
    """Whether the exact curvature has a function-space form: not the empirical Fisher of a Gaussian likelihood
    with several outputs (per-output noises scale the unit rows differently)."""
    fisher = choose(CurvatureKind, curvature, "curvature") is CurvatureKind.EF
    return not (fisher and is_gaussian(likelihood) and num_outputs > 1)


def exact_space(
    space: Space | str,
    num_params: int,
    num_rows: int,
    *,
    function_form: bool = True,
    steps: int | None = None,
    dtype: torch.dtype | None = None,
) -> Space:
    """Resolve ``space`` for an exact computation with ``num_params`` = P and ``num_rows`` = N·k (module docstring).

    Args:
        space: ``"auto"``, ``"function"`` or ``"weight"`` (or the :class:`~ntkgp.options.Space` member).
        num_params: P, the trainable parameters.
        num_rows: N·k, the rows of the site factor (:func:`site_columns`).
        function_form: whether the computation has a function-space form (:func:`has_function_form`).
        steps: how many evaluations one build serves, where the caller builds once per few steps (rule 2).
        dtype: the precision of a posterior's variances, where it matters (rule 3).

    Returns:
        ``Space.FUNCTION`` or ``Space.WEIGHT``.

    Raises:
        ValueError: for an unknown ``space``.
    """
    space = choose(Space, space, "space")
    if space is not Space.AUTO:
        return space
    if not function_form:
        return Space.WEIGHT
    if steps is not None and steps < STEPS_FOR_THE_STEP_RULE and num_rows <= num_params:
        return Space.FUNCTION
    low_precision = dtype is not None and torch.finfo(dtype).eps > torch.finfo(torch.float64).eps
    if low_precision and num_params <= LOW_PRECISION_WEIGHT_FACTOR * num_rows:
        return Space.WEIGHT
    return choose_space(space, num_params, num_rows)
