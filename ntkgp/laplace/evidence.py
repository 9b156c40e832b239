r"""The Laplace-GGN log marginal likelihood of a trained network, in function or weight space.

With :math:`\theta^*` fixed and the NTK kernel :math:`K = J P_0^{-1} J^\top` (docs/math.md, "Laplace-GGN
evidence"):

.. math::
    \log q(\mathcal D) = \sum_n \log p(y_n \mid f_n) - \tfrac12 \theta^{*\top} P_0 \theta^*
        - \tfrac12 \log\lvert I_{Nk} + L^\top K_{XX} L \rvert,
    \qquad L_n L_n^\top = \Lambda_n \ (\text{GGN}) \text{ or } g_n g_n^\top \ (\text{empirical Fisher}),

where the last term equals :math:`\log|H| - \log|P_0|` (matrix determinant lemma). This module is the one
implementation used by :meth:`ntkgp.NTKGP.log_marginal_likelihood`,
:class:`ntkgp.mlls.LaplaceGGNMarginalLogLikelihood` and :func:`ntkgp.training.train_marglik`.
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood
from linear_operator.operators import LinearOperator, RootLinearOperator

from ..kernels import NTKKernel
from ..likelihoods import gradient, hessian_sqrt, log_likelihood
from ..options import Curvature, Space, choose, choose_space
from .algebra import low_rank_log_det, site_cholesky

__all__ = [
    "column_weights",
    "curvature_factor",
    "laplace_log_marginal_likelihood",
    "log_det_term",
    "prior_term",
]


def curvature_factor(
    likelihood: Likelihood, f: torch.Tensor, y: torch.Tensor, curvature: Curvature | str = "ggn"
) -> torch.Tensor:
    """Blocks ``(N, C, k)`` of the factor ``L`` with ``L_n L_nᵀ`` the per-point curvature in output space.

    ``"ggn"``: ``L_n L_nᵀ = Λ_n`` (k = C); ``"ef"``: ``L_n = g_n`` (k = 1), so that ``J_nᵀ L_n L_nᵀ J_n = G_nᵀ G_n``
    with ``G_n = g_nᵀ J_n`` the per-example gradient (the empirical Fisher).

    Raises:
        ValueError: for an unknown ``curvature``.
    """
    if choose(Curvature, curvature, "curvature") is Curvature.GGN:
        return hessian_sqrt(likelihood, f, y)
    return gradient(likelihood, f, y).unsqueeze(-1)


def column_weights(kernel: NTKKernel, power: float) -> torch.Tensor:
    r""":math:`\delta_g^{\,\mathrm{power}}` for every Jacobian column, shape ``(P,)`` (:meth:`NTKKernel.column_weights`)."""
    return kernel.column_weights(power)


def prior_term(kernel: NTKKernel) -> torch.Tensor:
    r""":math:`\theta^{*\top} P_0 \theta^* = \sum_g \delta_g \lVert\theta^*_g\rVert^2` at the network's current weights."""
    norms = kernel.engine.group_sq_norms()
    return (kernel.prior_precision.to(norms) * norms).sum()


def _root(covariance: LinearOperator | None) -> torch.Tensor | None:
    """The root ``R`` of a covariance ``R Rᵀ`` when the operator has one (the kernel's weight-space form)."""
    if covariance is None:
        return None
    if hasattr(covariance, "evaluate_kernel"):
        covariance = covariance.evaluate_kernel()
    if isinstance(covariance, RootLinearOperator):
        return covariance.root.to_dense()
    return None


def log_det_term(
    kernel: NTKKernel,
    x: torch.Tensor,
    factor: torch.Tensor,
    space: Space | str = "auto",
    covariance: LinearOperator | torch.Tensor | None = None,
) -> torch.Tensor:
    r""":math:`\log|I + L^\top K_{XX} L| = \log|H| - \log|P_0|`, by the cheaper route.

    Function space factorises the ``(N·k)²`` matrix :math:`I + L^\top K L` (from the kernel's cached
    per-group Grams); weight space the ``P²`` matrix :math:`I + W^\top W`, :math:`W = L^\top J P_0^{-1/2}`
    (from the cached Jacobian). ``"auto"`` takes weight space when :math:`P < N k`
    (:func:`ntkgp.options.choose_space`).

    Args:
        kernel: the NTK kernel at the training inputs (prior precisions, cached Grams and Jacobians).
        x: training inputs ``(N, D)`` as the kernel takes them.
        factor: ``L`` as blocks ``(N, C, k)`` (:func:`curvature_factor`).
        space: ``"auto"``, ``"function"`` or ``"weight"``.
        covariance: :math:`K_{XX}` when the caller already holds it (e.g. the covariance of the prior
            ``model(train_x)``); otherwise ``kernel(x)`` is used.
    """
    n, _, k = factor.shape
    space = choose_space(space, kernel.engine.num_params, n * k)
    if space is Space.FUNCTION:
        gram = kernel(x) if covariance is None else covariance
        gram = gram.to_dense() if isinstance(gram, LinearOperator) else gram
        return 2 * site_cholesky(factor, gram.to(factor)).diagonal().log().sum()
    root = _root(covariance)
    if root is None:
        root = kernel.jacobian(x) * column_weights(kernel, -0.5).to(factor)
    return low_rank_log_det(factor, root.to(factor))


def laplace_log_marginal_likelihood(
    kernel: NTKKernel,
    likelihood: Likelihood,
    x: torch.Tensor,
    f: torch.Tensor,
    y: torch.Tensor,
    curvature: Curvature | str = "ggn",
    space: Space | str = "auto",
    covariance: LinearOperator | torch.Tensor | None = None,
) -> torch.Tensor:
    r"""The Laplace-GGN log marginal likelihood :math:`\log q(\mathcal D)` with :math:`\theta^*` fixed (total, not per point).

    .. math::
        \log q(\mathcal D) = \sum_n \log p(y_n \mid f_n) - \tfrac12 \theta^{*\top} P_0 \theta^*
                    - \tfrac12 \log\lvert I_{NC} + \Lambda^{1/2} K_{XX} \Lambda^{1/2} \rvert

    (Immer et al. 2021, eq. 3–4; docs/math.md, "Laplace-GGN evidence"). Differentiable w.r.t. the prior
    precisions (through the kernel's cached Grams or Jacobian) and the likelihood's noise or temperature
    (through :math:`\log p` and :math:`\Lambda`); no Jacobian is recomputed between hyperparameter steps.

    Args:
        kernel: the NTK kernel (prior precisions, cached Grams).
        likelihood: a supported likelihood (:mod:`ntkgp.likelihoods`).
        x: training inputs ``(N, D)`` as the kernel takes them.
        f: network outputs at ``x``, ``(N, C)`` (fixed data, at :math:`\theta^*`).
        y: targets (validated by :func:`ntkgp.likelihoods.validate_targets`).
        curvature: ``"ggn"`` (Gauss–Newton) or ``"ef"`` (empirical Fisher).
        space: ``"auto"``, ``"function"`` or ``"weight"`` (:func:`log_det_term`).
        covariance: :math:`K_{XX}` if already at hand (see :func:`log_det_term`).

    Returns:
        A scalar tensor.

    Raises:
        ValueError: for an unknown ``curvature`` or ``space``.
        NotPSDError: when :math:`I + L^\top K L` cannot be factorised (non-finite hyperparameters).
    """
    curvature = choose(Curvature, curvature, "curvature")
    space = choose(Space, space, "space")
    factor = curvature_factor(likelihood, f, y, curvature)
    fit = log_likelihood(likelihood, f, y).sum()
    return fit - 0.5 * prior_term(kernel).to(fit) - 0.5 * log_det_term(kernel, x, factor, space, covariance)
