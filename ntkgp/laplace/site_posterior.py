r"""The posterior of a GP prior under Gaussian sites, in function space, without inverting :math:`\Lambda`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gpytorch.likelihoods import Likelihood
from linear_operator.operators import LinearOperator

from ..kernels import NTKKernel
from ..likelihoods import gradient, hessian
from .algebra import block_apply, site_cholesky
from .evidence import curvature_factor

__all__ = ["SitePosterior", "fit_site_posterior"]


@dataclass
class SitePosterior:
    r"""Posterior of :math:`f \sim GP(m, K)` under Gaussian sites with natural parameters :math:`(r_n, \Lambda_n)`.

    The sites are :math:`\exp(f_n^\top r_n - \tfrac12 f_n^\top \Lambda_n f_n)` with :math:`\Lambda_n = L_n L_n^\top`
    and :math:`r_n = \Lambda_n (f_n^* - m_n) + g_n` relative to the prior mean (docs/math.md, "GLM
    predictive"). With :math:`B = I + L^\top K_{XX} L` (Cholesky :math:`R R^\top`):

    .. math::
        \mu(x_*) &= m(x_*) + K_{*X}\,(r - L B^{-1} L^\top K_{XX} r) \\
        \Sigma(x_*) &= K_{**} - A A^\top, \quad A = K_{*X} L R^{-\top}

    the Woodbury forms of :math:`K_{*X}(I + \Lambda K_{XX})^{-1} r` and
    :math:`K_{*X}\Lambda^{1/2}(I + \Lambda^{1/2} K_{XX} \Lambda^{1/2})^{-1}\Lambda^{1/2}K_{X*}`.
    For a Gaussian likelihood the sites are exact and this is the exact GP posterior.

    Attributes:
        factor: ``L`` as blocks ``(N, C, k)``.
        chol: ``R``, the lower Cholesky factor of ``B``, ``(N·k, N·k)``.
        weights: ``r − L B⁻¹ Lᵀ K r``, ``(N·C,)``: the posterior mean is ``m(x*) + K_{*X} weights``.
    """

    factor: torch.Tensor
    chol: torch.Tensor
    weights: torch.Tensor

    @classmethod
    def fit(cls, gram: torch.Tensor, factor: torch.Tensor, natural_mean: torch.Tensor) -> SitePosterior:
        """Factorise ``B`` for the training Gram ``K_XX`` ``(N·C, N·C)``, ``L`` ``(N, C, k)``, ``r`` ``(N·C,)``."""
        chol = site_cholesky(factor, gram)
        lt_kr = block_apply(factor, gram @ natural_mean, transpose=True)
        solved = torch.cholesky_solve(lt_kr.unsqueeze(-1), chol).squeeze(-1)
        return cls(factor=factor, chol=chol, weights=natural_mean - block_apply(factor, solved))

    @property
    def dtype(self) -> torch.dtype:
        return self.chol.dtype

    def log_det(self) -> torch.Tensor:
        """``log|I + Lᵀ K L|``."""
        return 2 * self.chol.diagonal().log().sum()

    def mean_correction(self, cross: torch.Tensor) -> torch.Tensor:
        """``K_{*X} weights`` for ``cross = K_{*X}`` ``(M·C, N·C)``."""
        return cross @ self.weights

    def variance_root(self, cross: torch.Tensor) -> torch.Tensor:
        """``A = K_{*X} L R^{-T}`` ``(M·C, N·k)``, so that the posterior covariance is ``K_** − A Aᵀ``."""
        kl = block_apply(self.factor, cross.mT, transpose=True)  # Lᵀ K_X* : (N·k, M·C)
        return torch.linalg.solve_triangular(self.chol, kl, upper=False).mT


def fit_site_posterior(
    kernel: NTKKernel,
    likelihood: Likelihood,
    x: torch.Tensor,
    f: torch.Tensor,
    y: torch.Tensor,
    prior_mean: torch.Tensor,
    gram: torch.Tensor | LinearOperator | None = None,
) -> SitePosterior:
    r"""The Laplace-GGN site posterior of the linearized network at its training data.

    The sites sit at the network outputs :math:`f_n = f(x_n;\theta^*)` with the GGN curvature
    :math:`\Lambda_n` and gradient :math:`g_n` of :math:`\log p(y_n \mid f_n)`:
    :math:`r_n = \Lambda_n (f_n - m_n) + g_n`. Differentiable in the hyperparameters.

    Args:
        kernel: the NTK kernel.
        likelihood: a supported likelihood.
        x: training inputs ``(N, D)`` as the kernel takes them.
        f: network outputs at ``x``, ``(N, C)``.
        y: validated targets.
        prior_mean: :math:`m(X)`, shape ``(N, C)`` (or ``(N·C,)``).
        gram: :math:`K_{XX}` if at hand (default ``kernel(x)``).
    """
    factor = curvature_factor(likelihood, f, y, "ggn")
    lam = hessian(likelihood, f, y)
    natural = (lam @ (f - prior_mean.reshape(f.shape)).unsqueeze(-1)).squeeze(-1) + gradient(likelihood, f, y)
    gram = kernel(x) if gram is None else gram
    gram = gram.to_dense() if isinstance(gram, LinearOperator) else gram
    return SitePosterior.fit(gram.to(f), factor, natural.reshape(-1))
