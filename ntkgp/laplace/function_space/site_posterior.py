r"""The posterior of a GP prior under Gaussian sites, in function or weight space, without inverting :math:`\Lambda`.

Two exact forms of the same posterior (docs/math.md, "GLM predictive"); :func:`posterior_space` picks one:

* **function space** factorizes the ``(N·k)²`` matrix :math:`B = I + L^\top K_{XX} L`; the covariance at test
  points is the difference :math:`K_{**} - A A^\top`, :math:`A = K_{*X} L R^{-\top}`;
* **weight space** factorizes the ``P²`` matrix :math:`I + W^\top W = R^\top R` with
  :math:`W = L^\top J_X P_0^{-1/2}` (formed in float64 for lower-precision models); the covariance is the sum
  of squares :math:`A A^\top`, :math:`A = J_* P_0^{-1/2} R^{-1}`, i.e. :math:`J_* H^{-1} J_*^\top` with
  :math:`H = P_0 + \sum_n J_n^\top \Lambda_n J_n`. It cannot be negative in any precision.

:func:`fit_site_posterior` places the sites at the network's outputs :math:`f(X;\theta^*)` (one Newton step from
:math:`\theta^*`, the Laplace-GGN posterior) or, with ``iterate=True``, moves them by damped Newton steps to the
mode of the linearized model's log joint (GP classification with the Laplace approximation;
:func:`site_mode`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gpytorch.likelihoods import Likelihood
from linear_operator.operators import LinearOperator

from ...kernels import NTKKernel
from ...likelihoods import gradient, hessian, is_gaussian, log_likelihood
from ...linalg import cholesky, gram
from ...options import CurvatureKind, Space
from ..ggn.space import LOW_PRECISION_WEIGHT_FACTOR, exact_space
from .algebra import block_apply, site_cholesky
from .eigen import eigen_problem
from .evidence import curvature_factor
from .evidence_curvature import curvature_problem, evidence_curvature

__all__ = [
    "LOW_PRECISION_WEIGHT_FACTOR",
    "MAX_NEWTON_STEPS",
    "SiteIterationWarning",
    "SitePosterior",
    "damped_newton",
    "fit_site_posterior",
    "posterior_space",
    "site_mode",
]

#: Newton steps of :func:`site_mode` before it gives up (with a :class:`SiteIterationWarning`).
MAX_NEWTON_STEPS = 100


class SiteIterationWarning(RuntimeWarning):
    """The Newton iteration of the sites stopped before it converged (the last iterate is used)."""


def _weight_factor(w: torch.Tensor) -> torch.Tensor:
    r"""Upper ``R`` (``P × P``) with :math:`R^\top R = I + W^\top W`, in ``w``'s dtype.

    :math:`I + W^\top W` is formed and factorized in float64 when ``w`` has a lower precision (except on
    devices without float64), so that the factor of a float32 model is that of its float32 Jacobian to float32
    precision: the squared condition number of :math:`W^\top W` costs float64 digits only.
    """
    work = w.dtype
    if torch.finfo(w.dtype).eps > torch.finfo(torch.float64).eps and w.device.type != "mps":
        work = torch.float64
    wide = w.to(work)
    inner = gram(wide)
    inner = inner + torch.eye(inner.shape[-1], dtype=work, device=w.device)
    return cholesky(inner, "I + Wᵀ W (the whitened posterior precision)").mT.to(w.dtype)


@dataclass
class SitePosterior:
    r"""Posterior of :math:`f \sim GP(m, K)` under Gaussian sites with natural parameters :math:`(r_n, \Lambda_n)`.

    The sites are :math:`\exp(f_n^\top r_n - \tfrac12 f_n^\top \Lambda_n f_n)` with :math:`\Lambda_n = L_n L_n^\top`
    and :math:`r_n = \Lambda_n (\hat f_n - m_n) + g_n` relative to the prior mean, where :math:`\hat f_n` is the
    site location (docs/math.md, "GLM predictive"). With :math:`B = I + L^\top K_{XX} L`:

    .. math::
        \mu(x_*) &= m(x_*) + K_{*X}\,(r - L B^{-1} L^\top K_{XX} r) \\
        \Sigma(x_*) &= K_{**} - K_{*X} L B^{-1} L^\top K_{X*}
                    = \Phi_* (I + W^\top W)^{-1} \Phi_*^\top,

    :math:`\Phi = J P_0^{-1/2}`, :math:`W = L^\top \Phi_X`: the Woodbury forms of
    :math:`K_{*X}(I + \Lambda K_{XX})^{-1} r` and of the GLM predictive :math:`J_* H^{-1} J_*^\top`. For a
    Gaussian likelihood the sites are exact and this is the exact GP posterior.

    Attributes:
        factor: ``L`` as blocks ``(N, C, k)``.
        chol: function space: ``R``, the lower Cholesky factor of ``B`` ``(N·k, N·k)``; weight space: the
            upper ``R`` ``(P, P)`` with :math:`R^\top R = I + W^\top W`.
        weights: ``r − L B⁻¹ Lᵀ K r``, ``(N·C,)``: the posterior mean is ``m(x*) + K_{*X} weights``.
        space: :attr:`Space.FUNCTION` or :attr:`Space.WEIGHT` (which ``chol`` this is).
        root_scale: weight space only: :math:`\delta^{-1/2}` per Jacobian column ``(P,)`` (``Φ = J · root_scale``).
        sites: the site locations :math:`\hat f` ``(N, C)`` (the network's outputs, or the mode).
        newton_steps: Newton steps taken after the first (``0`` for sites at the network's outputs).
    """

    factor: torch.Tensor
    chol: torch.Tensor
    weights: torch.Tensor
    space: Space = Space.FUNCTION
    root_scale: torch.Tensor | None = None
    sites: torch.Tensor | None = field(default=None, repr=False)
    newton_steps: int = 0

    @classmethod
    def fit(cls, gram: torch.Tensor, factor: torch.Tensor, natural_mean: torch.Tensor) -> SitePosterior:
        """Function space: factorize ``B`` for the training Gram ``K_XX`` ``(N·C, N·C)``, ``L`` ``(N, C, k)``,
        ``r`` ``(N·C,)``."""
        chol = site_cholesky(factor, gram)
        lt_kr = block_apply(factor, gram @ natural_mean, transpose=True)
        solved = torch.cholesky_solve(lt_kr.unsqueeze(-1), chol).squeeze(-1)
        return cls(factor=factor, chol=chol, weights=natural_mean - block_apply(factor, solved))

    @classmethod
    def fit_weight(
        cls, root: torch.Tensor, root_scale: torch.Tensor, factor: torch.Tensor, natural_mean: torch.Tensor,
        precision: torch.Tensor | None = None,
    ) -> SitePosterior:
        r"""Weight space: from the root :math:`\Phi_X = J_X P_0^{-1/2}` ``(N·C, P)`` (so ``K_XX = Φ Φᵀ``).

        ``weights = r − L Lᵀ Φ (I + WᵀW)⁻¹ Φᵀ r`` (Woodbury, :math:`W = L^\top \Phi`); cost ``O(N·k·P² + P³)``,
        or ``O(P³)`` when ``precision``, :math:`I + W^\top W` itself, is at hand (the evidence's cached
        curvature, :meth:`~ntkgp.laplace.weight_space.FullCurvature.whitened_precision`).
        """
        if precision is None:
            chol = _weight_factor(block_apply(factor, root, transpose=True))  # W: (N·k, P)
        else:
            chol = cholesky(precision, "I + Wᵀ W (the whitened posterior precision)").mT
        u = (root.mT @ natural_mean).unsqueeze(-1)
        half = torch.linalg.solve_triangular(chol.mT, u, upper=False)
        solved = torch.linalg.solve_triangular(chol, half, upper=True).squeeze(-1)
        weights = natural_mean - block_apply(factor, block_apply(factor, root @ solved, transpose=True))
        return cls(factor=factor, chol=chol, weights=weights, space=Space.WEIGHT, root_scale=root_scale)

    @property
    def dtype(self) -> torch.dtype:
        return self.chol.dtype

    @property
    def rank(self) -> int:
        """The number of columns of the variance root, ``N·k`` (function space) or ``P`` (weight space)."""
        return self.chol.shape[-1]

    def log_det(self) -> torch.Tensor:
        """``log|I + Lᵀ K L|`` (``= log|I + WᵀW|``)."""
        return 2 * self.chol.diagonal().abs().log().sum()

    def mean_correction(self, cross: torch.Tensor) -> torch.Tensor:
        """``K_{*X} weights`` for ``cross = K_{*X}`` ``(M·C, N·C)``."""
        return cross @ self.weights

    def variance_root(self, cross: torch.Tensor) -> torch.Tensor:
        """Function space: ``A = K_{*X} L R^{-T}`` ``(M·C, N·k)``; the posterior covariance is ``K_** − A Aᵀ``."""
        kl = block_apply(self.factor, cross.mT, transpose=True)  # Lᵀ K_X* : (N·k, M·C)
        return torch.linalg.solve_triangular(self.chol, kl, upper=False).mT

    def weight_root(self, jacobian: torch.Tensor) -> torch.Tensor:
        r"""Weight space: ``A = J_* P_0^{-1/2} R^{-1}`` ``(M·C, P)``; the posterior covariance is ``A Aᵀ``."""
        phi = jacobian.to(self.dtype) * self.root_scale.to(self.dtype)
        return torch.linalg.solve_triangular(self.chol, phi, upper=True, left=False)


def posterior_space(kernel: NTKKernel, num_rows: int, dtype: torch.dtype | None = None) -> Space:
    r"""Where the site posterior is factorized, from the kernel's ``space`` (``"auto"``, ``"function"``, ``"weight"``).

    ``"auto"`` is :func:`~ntkgp.laplace.ggn.space.exact_space` with the precision ``dtype``: weight space when
    :math:`N k > 0.85 P` (``num_rows``), the smaller factorization, and in a precision lower than float64 also up
    to :math:`P \le 2 N k` (the function-space variance is a difference that loses every digit in float32 on
    ill-conditioned problems, the weight-space one is a sum of squares; docs/guarantees.md, "Predictive
    variances"). A kernel with a batch of prior precisions always uses function space.
    """
    if kernel.batch_shape != torch.Size([]):
        return Space.FUNCTION
    return exact_space(kernel.space, kernel.engine.num_params, num_rows, dtype=dtype)


def damped_newton(
    first: tuple[torch.Tensor, ...],
    target: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]],
    objective: Callable[[tuple[torch.Tensor, ...]], torch.Tensor],
    max_steps: int = MAX_NEWTON_STEPS,
) -> tuple[tuple[torch.Tensor, ...], int, bool]:
    r"""Maximize a concave objective by Newton steps with a backtracking line search.

    An iterate is a tuple of tensors whose last entry is the vector of function values :math:`f` (everything
    in it is linear in the parameters, so iterates are interpolated entry by entry). ``target(state)`` is the
    full Newton step's destination; the step is halved until ``objective`` does not decrease. The iteration
    stops when the full step moves no entry of :math:`f` by more than :math:`\sqrt{\epsilon}\,(1 + \max|f|)`.
    Close to the optimum (steps below :math:`\epsilon^{1/4}(1 + \max|f|)`), where the objective no longer
    resolves the steps, full steps are taken (Newton converges quadratically there).

    Returns:
        The last iterate, the number of Newton steps and whether the tolerance was met.
    """
    tol = math.sqrt(torch.finfo(first[-1].dtype).eps)
    state, value = first, objective(first)
    steps = 0
    for steps in range(1, max_steps + 1):
        new = target(state)
        scale = 1.0 + state[-1].abs().max()
        move = (new[-1] - state[-1]).abs().max()
        if move <= tol * scale:
            return new, steps, True
        local = bool(move <= tol**0.5 * scale)
        t = 1.0
        while t >= 2**-30:
            trial = tuple(a + t * (b - a) for a, b in zip(state, new))
            trial_value = objective(trial)
            if torch.isfinite(trial_value) and (
                trial_value >= value - 1e-12 * value.abs() or (local and t == 1.0)
            ):
                break
            t /= 2
        if (
            t < 2**-30
        ):  # no ascent along the Newton direction: the objective does not resolve the step any more
            return state, steps, bool(move <= tol**0.5 * scale)
        state, value = trial, trial_value
    return state, steps, False


def site_mode(
    likelihood: Likelihood,
    y: torch.Tensor,
    prior_mean: torch.Tensor,
    start: torch.Tensor,
    fit: Callable[[torch.Tensor], SitePosterior],
    apply_gram: Callable[[torch.Tensor], torch.Tensor],
    max_steps: int = MAX_NEWTON_STEPS,
) -> SitePosterior:
    r"""The site posterior at the mode of the linearized model's log joint, by damped Newton steps.

    In the parametrization :math:`f = m + K a` (GPML, Algorithm 3.1, with a prior mean) the objective

    .. math::
        \Psi(a) = \sum_n \log p(y_n \mid f_n) - \tfrac12 a^\top K a

    is concave for the logistic, softmax and Gaussian likelihoods, and its maximizer is the mode of
    :math:`p(f_X \mid y)` under the GP prior :math:`GP(m, K)`: the linearized network's log joint in function
    space. The first iterate is the one-step posterior with sites at ``start`` (the network's outputs); every
    Newton target is the site posterior with its sites at the current :math:`f` (:func:`damped_newton`). The
    returned posterior has its sites at the last iterate.

    Args:
        likelihood: the likelihood.
        y: validated targets.
        prior_mean: :math:`m(X)` ``(N, C)``.
        start: the first site locations ``(N, C)``.
        fit: the site posterior for sites at given locations ``(N, C)``.
        apply_gram: :math:`a \mapsto K_{XX} a` for ``a`` ``(N·C,)``.
        max_steps: the most Newton steps after the first.

    Returns:
        The site posterior at the mode (``sites`` and ``newton_steps`` filled in).

    Warns:
        SiteIterationWarning: when the tolerance is not met within ``max_steps`` (the last iterate is used).
    """
    c = start.shape[-1]
    m = prior_mean.reshape(-1)

    def state_of(post: SitePosterior) -> tuple[torch.Tensor, torch.Tensor]:
        a = post.weights
        return a, m + apply_gram(a)

    def target(state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return state_of(fit(state[1].reshape(-1, c)))

    def objective(state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, f = state
        return log_likelihood(likelihood, f.reshape(-1, c), y).sum() - 0.5 * a @ (f - m)

    state, steps, converged = damped_newton(state_of(fit(start)), target, objective, max_steps)
    if not converged:
        warnings.warn(
            f"the Newton iteration of the sites stopped after {steps} steps without converging; the last iterate "
            "is used",
            SiteIterationWarning,
            stacklevel=3,
        )
    sites = state[1].reshape(-1, c)
    post = fit(sites)
    post.sites = sites
    post.newton_steps = steps
    return post


def _cached_precision(kernel: NTKKernel, likelihood: Likelihood, x: torch.Tensor, f: torch.Tensor,
                      y: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    r""":math:`I + W^\top W` for sites at ``f`` from the evidence's weight-space GGN, built once per network state
    and data (:func:`~ntkgp.laplace.function_space.evidence_curvature.evidence_curvature`), instead of the Gram
    of the ``N·k × P`` rows :math:`W`; ``None`` where it does not apply (a lower precision than float64, whose
    :math:`I + W^\top W` is formed in float64 from the rows; a problem the cached curvature does not treat) or
    where the evidence does not build that curvature (one δ: its eigen route keeps eigenvalues only)."""
    if f.dtype != torch.float64 or curvature_problem(kernel, likelihood, x, f, y, CurvatureKind.GGN, Space.WEIGHT):
        return None
    if eigen_problem(kernel, likelihood, x, CurvatureKind.GGN) is None:
        return None
    return lambda: evidence_curvature(kernel, likelihood, x, f, y, CurvatureKind.GGN, Space.WEIGHT).whitened_precision(
        kernel.prior_precision.to(f), likelihood)


def fit_site_posterior(
    kernel: NTKKernel,
    likelihood: Likelihood,
    x: torch.Tensor,
    f: torch.Tensor,
    y: torch.Tensor,
    prior_mean: torch.Tensor,
    gram: torch.Tensor | LinearOperator | None = None,
    iterate: bool = False,
    space: Space | str | None = None,
) -> SitePosterior:
    r"""The Laplace-GGN site posterior of the linearized network at its training data.

    The sites sit at the network outputs :math:`f_n = f(x_n;\theta^*)` with the GGN curvature
    :math:`\Lambda_n` and gradient :math:`g_n` of :math:`\log p(y_n \mid f_n)`:
    :math:`r_n = \Lambda_n (f_n - m_n) + g_n` (one Newton step from :math:`\theta^*`). With ``iterate=True``
    (non-Gaussian likelihoods) they are moved to the mode of the linearized model's log joint
    (:func:`site_mode`). Differentiable in the hyperparameters.

    Args:
        kernel: the NTK kernel.
        likelihood: a supported likelihood.
        x: training inputs ``(N, D)`` as the kernel takes them.
        f: network outputs at ``x``, ``(N, C)``.
        y: validated targets.
        prior_mean: :math:`m(X)`, shape ``(N, C)`` (or ``(N·C,)``).
        gram: :math:`K_{XX}` if at hand (function space; default ``kernel(x)``).
        iterate: iterate the sites to the mode (ignored for Gaussian likelihoods, whose sites are exact).
        space: ``"function"`` or ``"weight"``; default :func:`posterior_space`.
    """
    prior_mean = prior_mean.reshape(f.shape)
    factor_at = curvature_factor(likelihood, f, y, "ggn")
    rows = factor_at.shape[0] * factor_at.shape[-1]
    if space is None:
        space = posterior_space(kernel, rows, f.dtype)
    else:
        space = exact_space(space, kernel.engine.num_params, rows)
    if space is Space.WEIGHT:
        scale = kernel.column_weights(-0.5).to(f)
        root = kernel.jacobian(x).to(f) * scale
        cached = _cached_precision(kernel, likelihood, x, f, y)

        def solve(factor: torch.Tensor, natural: torch.Tensor) -> SitePosterior:
            precision = cached() if cached is not None and factor is factor_at else None  # sites at f only
            return SitePosterior.fit_weight(root, scale, factor, natural, precision)

        def apply_gram(a: torch.Tensor) -> torch.Tensor:
            return root @ (root.mT @ a)

    else:
        k = kernel(x) if gram is None else gram
        k = (k.to_dense() if isinstance(k, LinearOperator) else k).to(f)

        def solve(factor: torch.Tensor, natural: torch.Tensor) -> SitePosterior:
            return SitePosterior.fit(k, factor, natural)

        def apply_gram(a: torch.Tensor) -> torch.Tensor:
            return k @ a

    def fit(sites: torch.Tensor) -> SitePosterior:
        factor = factor_at if sites is f else curvature_factor(likelihood, sites, y, "ggn")
        lam = hessian(likelihood, sites, y)
        natural = (lam @ (sites - prior_mean).unsqueeze(-1)).squeeze(-1) + gradient(likelihood, sites, y)
        post = solve(factor, natural.reshape(-1))
        post.sites = sites
        return post

    if iterate and not is_gaussian(likelihood):
        return site_mode(likelihood, y, prior_mean, f, fit, apply_gram)
    return fit(f)
