"""The Laplace-GGN (and empirical-Fisher) evidence of a trained network, in function or weight space."""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood

from ..kernels import NTKKernel
from ..likelihoods import gradient, hessian_sqrt, log_likelihood
from ..linalg import block_apply, cholesky, site_cholesky

CURVATURES = ("ggn", "ef")
SPACES = ("auto", "function", "weight")


def curvature_factor(likelihood: Likelihood, f: torch.Tensor, y: torch.Tensor, curvature: str = "ggn") -> torch.Tensor:
    """Blocks ``(N, C, k)`` of the factor ``L`` with ``L_n L_nᵀ`` the per-point curvature in output space.

    ``"ggn"``: ``L_n L_nᵀ = Λ_n`` (k = C); ``"ef"``: ``L_n = g_n`` (k = 1), so that ``J_nᵀ L_n L_nᵀ J_n = G_nᵀ G_n``
    with ``G_n = g_nᵀ J_n`` the per-example gradient (the empirical Fisher).
    """
    if curvature == "ggn":
        return hessian_sqrt(likelihood, f, y)
    if curvature == "ef":
        return gradient(likelihood, f, y).unsqueeze(-1)
    raise ValueError(f"curvature must be one of {CURVATURES}, got {curvature!r}")


def prior_term(kernel: NTKKernel) -> torch.Tensor:
    """``θ*ᵀ P0 θ* = Σ_g δ_g ‖θ*_g‖²`` at the network's current weights."""
    return (kernel.prior_precision * kernel.engine.group_sq_norms()).sum()


def log_det_curvature(kernel: NTKKernel, x: torch.Tensor, factor: torch.Tensor, space: str = "auto") -> torch.Tensor:
    """``log|H| − log|P0| = log|I + Lᵀ K_XX L|`` (matrix determinant lemma), by the cheaper route.

    Function space costs ``O((N·k)³)`` on the cached per-group Grams; weight space builds
    ``H = Wᵀ W + P0`` with ``W = Lᵀ J`` from the cached Jacobian and costs ``O(N·k·P² + P³)``. ``"auto"``
    takes function space when ``N·k ≤ P``.
    """
    if space not in SPACES:
        raise ValueError(f"space must be one of {SPACES}, got {space!r}")
    n, _, k = factor.shape
    p = kernel.engine.num_params
    if space == "function" or (space == "auto" and n * k <= p):
        return 2 * site_cholesky(factor, kernel(x).to_dense()).diagonal().log().sum()
    w = block_apply(factor, kernel.jacobian(x), transpose=True)  # (N·k, P)
    delta = kernel.prior_precision
    h = w.mT @ w + torch.diag(kernel._column_weights(1.0))
    sizes = kernel.engine.groups.group_sizes().to(delta)
    return 2 * cholesky(h, "the posterior precision H").diagonal().log().sum() - (sizes * delta.log()).sum()


def laplace_ggn_evidence(
    kernel: NTKKernel,
    likelihood: Likelihood,
    x: torch.Tensor,
    f: torch.Tensor,
    y: torch.Tensor,
    curvature: str = "ggn",
    space: str = "auto",
) -> torch.Tensor:
    r"""The Laplace-GGN log evidence with :math:`\theta^*` fixed (Immer et al. 2021, eq. 3–4; MATH.md):

    .. math::
        \log q(D) = \sum_n \log p(y_n \mid f_n) - \tfrac12 \theta^{*\top} P_0 \theta^*
                    - \tfrac12 \log\lvert I_{NC} + \Lambda^{1/2} K_{XX} \Lambda^{1/2} \rvert

    Differentiable w.r.t. the prior precisions (through the kernel's cached Grams) and the likelihood's
    noise or temperature (through :math:`\log p` and :math:`\Lambda`); the Jacobians are not recomputed.

    Args:
        kernel: the NTK kernel (prior precisions, cached Grams).
        likelihood: a supported likelihood.
        x: training inputs ``(N, D)`` as the kernel takes them.
        f: network outputs at ``x``, ``(N, C)`` (fixed data).
        y: validated targets.
        curvature: ``"ggn"`` (Gauss-Newton) or ``"ef"`` (empirical Fisher).
        space: ``"auto"``, ``"function"`` or ``"weight"``.
    """
    factor = curvature_factor(likelihood, f, y, curvature)
    fit = log_likelihood(likelihood, f, y).sum()
    return fit - 0.5 * prior_term(kernel) - 0.5 * log_det_curvature(kernel, x, factor, space)
