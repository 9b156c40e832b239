r"""The KL divergence between two multivariate Gaussians, and FSVI's function-space KL on context points."""

from __future__ import annotations

import torch
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor


def _normalized_cholesky(cov: Tensor, name: str) -> tuple[Tensor, Tensor]:
    r"""``(L, d)`` with :math:`\Sigma = D L L^\top D`, :math:`D = \operatorname{diag}(d)`,
    :math:`d = \sqrt{\operatorname{diag}\Sigma}`.

    The Cholesky factor is taken of the correlation matrix (unit diagonal), so GPyTorch's jitter, added only
    when the plain factorization fails (with a ``NumericalWarning``), is relative to the variances whatever
    their scale; this keeps the KL stable in float32.
    """
    if cov.dim() != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(cov.shape)}")
    variances = cov.diagonal()
    if not (variances > 0).all():
        raise ValueError(f"{name} has a zero or negative variance on its diagonal: the Gaussian is degenerate")
    d = variances.sqrt()
    return psd_safe_cholesky(cov / (d[:, None] * d[None, :])), d


def gaussian_kl(mean_q: Tensor, cov_q: Tensor, mean_p: Tensor, cov_p: Tensor) -> Tensor:
    r"""Closed-form :math:`\mathrm{KL}(N(m_q, \Sigma_q) \,\|\, N(m_p, \Sigma_p))` in :math:`n` dimensions:

    .. math::
        \tfrac12 \Big[\operatorname{tr}(\Sigma_p^{-1}\Sigma_q) + (m_p - m_q)^\top \Sigma_p^{-1} (m_p - m_q) - n
            + \log|\Sigma_p| - \log|\Sigma_q|\Big].

    Computed with Cholesky factors of the two correlation matrices (:math:`\Sigma = D L L^\top D`):
    :math:`\operatorname{tr}(\Sigma_p^{-1}\Sigma_q) = \|L_p^{-1} D_p^{-1} D_q L_q\|_F^2`, one triangular solve
    for the mean term, log-determinants from the diagonals. Cost :math:`O(n^3)`; differentiable in all four
    arguments.

    Args:
        mean_q: ``(n,)``.
        cov_q: ``(n, n)`` symmetric positive definite.
        mean_p: ``(n,)``.
        cov_p: ``(n, n)`` symmetric positive definite.

    Returns:
        A 0-dim tensor.

    Raises:
        ValueError: shapes that do not match, or a non-positive variance on a diagonal.
    """
    n = mean_q.shape[-1]
    if mean_q.shape != (n,) or mean_p.shape != (n,) or cov_q.shape != (n, n) or cov_p.shape != (n, n):
        raise ValueError(
            f"expected means (n,) and covariances (n, n); got mean_q {tuple(mean_q.shape)}, cov_q "
            f"{tuple(cov_q.shape)}, mean_p {tuple(mean_p.shape)}, cov_p {tuple(cov_p.shape)}"
        )
    l_q, d_q = _normalized_cholesky(cov_q, "cov_q")
    l_p, d_p = _normalized_cholesky(cov_p, "cov_p")
    m = torch.linalg.solve_triangular(l_p, (d_q / d_p)[:, None] * l_q, upper=False)
    delta = torch.linalg.solve_triangular(l_p, ((mean_p - mean_q) / d_p)[:, None], upper=False)
    logdet_p = 2 * (l_p.diagonal().log().sum() + d_p.log().sum())
    logdet_q = 2 * (l_q.diagonal().log().sum() + d_q.log().sum())
    return 0.5 * (m.square().sum() + delta.square().sum() - n + logdet_p - logdet_q)
