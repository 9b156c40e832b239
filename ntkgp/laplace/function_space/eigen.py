r"""The Laplace evidence for one prior precision: one eigendecomposition, then :math:`O(Nk)` per step.

With a single prior precision :math:`\delta` (``prior_structure="network"``) the kernel is
:math:`K = \delta^{-1} K_1`, :math:`K_1 = J J^\top`. When moreover the site factor is a scalar multiple of
a matrix fixed by the data, :math:`L = s\,L_0` (docs/math.md, "Laplace-GGN evidence"), every hyperparameter
enters the log-determinant through the one number :math:`\rho = s^2/\delta`:

.. math::
    \log\lvert I + L^\top K L\rvert = \log\lvert I + \rho\, L_0^\top K_1 L_0\rvert
        = \sum_i \log(1 + \rho\,\lambda_i),

with :math:`\lambda_i` the eigenvalues of :math:`A_0 = L_0^\top K_1 L_0` (``N·k × N·k``), or equally the
non-zero ones of :math:`J^\top L_0 L_0^\top J` (``P × P``, the GGN at :math:`\delta = s = 1`) — whichever
is smaller. After one eigendecomposition (cached by the values of the inputs, the network outputs, the
targets and the network's weights), a step costs :math:`O(\min(Nk, P))` and its gradient is exact. The
Laplace evidence has no quadratic term (:math:`\theta^*` is fixed; the data fit is
:math:`\sum_n \log p(y_n \mid f_n)`), so the eigenvalues are all that is needed.

**When it applies** (:func:`eigen_problem`): one prior-precision group, an unbatched kernel, inputs without
gradients, and :math:`L = s L_0` with :math:`s` a scalar hyperparameter:

* Gaussian likelihood with one noise :math:`\sigma^2` (``GaussianLikelihood``;
  ``MultitaskGaussianLikelihood`` without task noises): :math:`s = \sigma^{-1}` (GGN) or :math:`\sigma^{-2}`
  (empirical Fisher, :math:`L_n = g_n = (y_n - f_n)/\sigma^2`) — the eigenvalues of :math:`K_1` give
  :math:`K_1/\delta + \sigma^2 I` for every :math:`\delta, \sigma`;
* logistic and softmax likelihoods (tempered or not): :math:`s = T^{-1/2}` (GGN) or :math:`T^{-1}` (EF).

Per-output noises (``MultitaskGaussianLikelihood`` with task noises) scale the outputs differently and are
left to the other routes.
"""

from __future__ import annotations

import weakref

import torch
from gpytorch.likelihoods import Likelihood, MultitaskGaussianLikelihood

from ...caching import ValueCache
from ...kernels import NTKKernel
from ...likelihoods import gradient, hessian_sqrt, is_gaussian, likelihood_temperature, noise_variance
from ...linalg import block_sandwich, gram
from ...options import CurvatureKind, Space, choose
from ..spectral_evidence import Spectrum, spectral_evidence
from ..ggn.layer_ggn import blocks_of_root
from ..ggn.scaling import data_fit_statistics, fewest_columns, output_variance
from ..ggn.space import exact_space, site_columns
from .algebra import block_apply

__all__ = ["checked_spectral_evidence", "eigen_problem", "site_scale", "spectral_data", "spectral_log_det"]

_SPECTRA: weakref.WeakKeyDictionary[NTKKernel, ValueCache] = weakref.WeakKeyDictionary()


def _has_site_scale(likelihood: Likelihood) -> bool:
    """Whether the site factor is one scalar times a fixed matrix (not per-output noises); reads no hyperparameter."""
    return not (is_gaussian(likelihood) and isinstance(likelihood, MultitaskGaussianLikelihood)
                and likelihood.has_task_noise and likelihood.num_tasks > 1)


def site_scale(likelihood: Likelihood, curvature: CurvatureKind | str = "ggn") -> torch.Tensor | None:
    r"""The scalar :math:`s` with :math:`L = s L_0` for every value of the likelihood's hyperparameters.

    Returns:
        :math:`\sigma^{-1}` / :math:`\sigma^{-2}` (Gaussian, one noise), :math:`T^{-1/2}` / :math:`T^{-1}`
        (tempered likelihoods; a constant 1 without a temperature) for ``"ggn"`` / ``"ef"``, with its graph
        to the hyperparameter; ``None`` where the site factor has no such scale (per-output noises).
    """
    power = 1.0 if choose(CurvatureKind, curvature, "curvature") is CurvatureKind.GGN else 2.0
    if not _has_site_scale(likelihood):
        return None
    if is_gaussian(likelihood):
        return noise_variance(likelihood)[0].pow(-power / 2)
    temperature = likelihood_temperature(likelihood)
    if temperature is None:
        return torch.ones(())
    return temperature.pow(-power / 2)


def eigen_problem(
    kernel: NTKKernel, likelihood: Likelihood, x: torch.Tensor, curvature: CurvatureKind | str
) -> str | None:
    """Why the eigen route does not apply to this problem, or ``None`` when it does."""
    if kernel.engine.num_groups != 1:
        return f"it needs one prior precision (prior_structure='network'); the kernel has {kernel.engine.num_groups} groups"
    if kernel.raw_prior_precision.dim() != 1:  # the shape of δ, without reading it through its constraint
        return "it needs an unbatched kernel"
    if x.requires_grad and torch.is_grad_enabled():
        return "x requires grad (the route gives gradients in the hyperparameters only)"
    if not _has_site_scale(likelihood):
        return "the likelihood's curvature is not one scalar times a fixed matrix (per-output noises)"
    return None


def _factor(likelihood: Likelihood, f: torch.Tensor, y: torch.Tensor, curvature: CurvatureKind) -> torch.Tensor:
    if curvature is CurvatureKind.GGN:  # the root with the fewest columns (C − 1 for a softmax)
        return fewest_columns(likelihood, f, hessian_sqrt(likelihood, f, y))
    return gradient(likelihood, f, y).unsqueeze(-1)


def spectral_data(
    kernel: NTKKernel, likelihood: Likelihood, x: torch.Tensor, f: torch.Tensor, y: torch.Tensor,
    curvature: CurvatureKind, space: Space | str,
) -> tuple[torch.Tensor, torch.Tensor, Spectrum]:
    r"""The eigenvalues :math:`\lambda` (:func:`spectral_log_det`), the data-fit statistics ``(3, K)``
    (:func:`~ntkgp.laplace.ggn.scaling.data_fit_statistics`) and the :class:`~ntkgp.laplace.spectral_evidence.Spectrum`
    of the evidence node (the nonzero :math:`\lambda`, :math:`q`, :math:`\lVert\theta^*\rVert^2`): everything of the
    evidence that the hyperparameters leave fixed, computed together and cached by the values of ``x``, ``f``, ``y``
    and the network's weights and buffers (one lookup per evidence)."""
    n, c = f.shape
    space = exact_space(space, kernel.engine.num_params, n * site_columns(likelihood, c, curvature))
    engine = kernel.engine
    state = engine.network_state()
    cache = _SPECTRA.get(kernel)
    if cache is None:
        cache = _SPECTRA[kernel] = ValueCache(size=2)

    def compute() -> tuple[torch.Tensor, torch.Tensor, Spectrum]:
        with torch.no_grad():
            fixed = f.detach()
            scale = site_scale(likelihood, curvature).to(f)
            base = _factor(likelihood, fixed, y, curvature) / scale  # L_0, free of hyperparameters
            if space is Space.FUNCTION:
                matrix = block_sandwich(base, kernel.group_grams(x).sum(0).to(base), symmetric=True)
            else:  # the GGN from the layer blocks where cheaper (ggn.layer_ggn), else the rows' Gram
                xp = engine.prepare(x)
                matrix = (blocks_of_root(engine.core, engine.plan(xp), xp, base, engine.core.progress)
                          if curvature is CurvatureKind.GGN else None)
                if matrix is None:
                    matrix = gram(block_apply(base, kernel.jacobian(x).to(base), transpose=True))
            eigenvalues = torch.linalg.eigvalsh(matrix).clamp_min(0)
            power = 1 if curvature is CurvatureKind.GGN else 2
            node = Spectrum(eigenvalues, None, power, engine.group_sq_norms().to(f))
            return eigenvalues, data_fit_statistics(likelihood, fixed, y), node

    tag = ("spectrum", curvature.value, space.value, type(likelihood).__name__)
    return cache.get_or_compute(tag, [x, f.detach(), y], compute, state=state)


def spectral_log_det(
    kernel: NTKKernel,
    likelihood: Likelihood,
    x: torch.Tensor,
    f: torch.Tensor,
    y: torch.Tensor,
    curvature: CurvatureKind | str = "ggn",
    space: Space | str = "auto",
) -> torch.Tensor:
    r""":math:`\log|I + L^\top K L| = \sum_i \log(1 + \lambda_i s^2/\delta)`, exact, differentiable in
    :math:`\delta` and in the likelihood's scale (:func:`site_scale`).

    :math:`\lambda_i \ge 0` are the eigenvalues of :math:`L_0^\top K_1 L_0` (function space) or of
    :math:`J^\top L_0 L_0^\top J` (weight space; the space by :func:`~ntkgp.laplace.ggn.space.exact_space`), cached
    by the values of ``x``, ``f``, ``y`` and the network's weights and buffers (:func:`spectral_data`; the
    hyperparameters may change freely): the eigendecomposition costs :math:`O(\min(Nk, P)^3)` once.

    Args:
        kernel: the NTK kernel with one prior-precision group.
        likelihood: a likelihood whose site factor has a scalar scale.
        x: training inputs ``(N, D)`` as the kernel takes them.
        f: network outputs ``(N, C)`` (fixed data).
        y: validated targets.
        curvature: ``"ggn"`` or ``"ef"``.
        space: where the one eigendecomposition is done (``"auto"``: the smaller of :math:`Nk` and :math:`P`).

    Raises:
        ValueError: when the route does not apply (:func:`eigen_problem`), naming the reason.
    """
    curvature = choose(CurvatureKind, curvature, "curvature")
    problem = eigen_problem(kernel, likelihood, x, curvature)
    if problem is not None:
        raise ValueError(f"method='eigen' does not apply: {problem}")
    lam = spectral_data(kernel, likelihood, x, f, y, curvature, space)[0]
    rho = site_scale(likelihood, curvature).to(lam).square() / kernel.prior_precision[0].to(lam)
    return torch.log1p(lam * rho).sum()


def checked_spectral_evidence(
    kernel: NTKKernel,
    likelihood: Likelihood,
    x: torch.Tensor,
    f: torch.Tensor | None,
    y: torch.Tensor,
    curvature: CurvatureKind,
    space: Space | str,
    data: tuple[torch.Tensor, torch.Tensor, Spectrum] | None = None,
) -> torch.Tensor:
    r"""The whole Laplace evidence :math:`\log q(\mathcal D)` of the eigen route (data fit, prior term and
    :func:`spectral_log_det`), for a caller that has just found :func:`eigen_problem` to be ``None`` for these
    arguments (the evidence's route choice), without checking it again: one cache lookup, the likelihood's variance
    and :math:`\delta` read once each through their constraints, one node of the graph
    (:func:`~ntkgp.laplace.spectral_evidence.spectral_evidence`). ``data``: the eigenvalues, fit statistics and
    spectrum (:func:`spectral_data` of these arguments) when the caller keeps them under its own key (the MLL, by
    the model's training data and network; ``f`` is then not read)."""
    lam, statistics, node = spectral_data(kernel, likelihood, x, f, y, curvature, space) if data is None else data
    variance = output_variance(likelihood)
    if variance is not None and (variance.dtype != lam.dtype or variance.device != lam.device):
        variance = variance.to(lam)
    return spectral_evidence(kernel.prior_precision.to(lam), variance, node, statistics)
