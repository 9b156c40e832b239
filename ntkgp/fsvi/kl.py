r"""The KL divergence between two multivariate Gaussians, and FSVI's function-space KL on context points."""

from __future__ import annotations

import torch
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor


def _normalized_cholesky(cov: Tensor, name: str) -> tuple[Tensor, Tensor, float]:
    r"""``(L, d, ε)`` with :math:`\Sigma + \varepsilon \operatorname{diag}(\Sigma) = D L L^\top D`,
    :math:`D = \operatorname{diag}(d)`, :math:`d = \sqrt{\operatorname{diag}\Sigma}`.

    The Cholesky factor is taken of the correlation matrix (unit diagonal), so GPyTorch's jitter
    :math:`\varepsilon` (0 unless the plain factorization fails; then added with a ``NumericalWarning``) is
    relative to the variances whatever their scale; this keeps the KL stable in float32.
    """
    if cov.dim() != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(cov.shape)}")
    variances = cov.diagonal()
    if not (variances > 0).all():
        raise ValueError(f"{name} has a zero or negative variance on its diagonal: the Gaussian is degenerate")
    d = variances.sqrt()
    correlation = cov / (d[:, None] * d[None, :])
    factor, info = torch.linalg.cholesky_ex(correlation)
    if int(info) == 0:
        return factor, d, 0.0
    factor = psd_safe_cholesky(correlation)  # adds jitter to the diagonal and warns
    # the jittered correlation matrix has 1 + ε on its diagonal: read ε back from the factor's first row
    return factor, d, float(factor[0, 0] ** 2 - 1)


class _GaussianKL(torch.autograd.Function):
    r"""The closed-form KL with its analytic gradient (first order):

    .. math::
        \frac{\partial \mathrm{KL}}{\partial m_q} = -\Sigma_p^{-1}(m_p - m_q), \quad
        \frac{\partial \mathrm{KL}}{\partial \Sigma_q} = \tfrac12(\Sigma_p^{-1} - \Sigma_q^{-1}), \quad
        \frac{\partial \mathrm{KL}}{\partial \Sigma_p} = \tfrac12\big(\Sigma_p^{-1} - \Sigma_p^{-1}\Sigma_q\Sigma_p^{-1}
            - \alpha\alpha^\top\big),\ \alpha = \Sigma_p^{-1}(m_p - m_q),

    from the two Cholesky factors of the forward pass (two ``cholesky_inverse`` and one triangular solve; autograd
    through the factorizations and the solves costs several times more). The matrix gradients are symmetric (the
    factorization reads one triangle). When jitter was needed, they are those of the KL of the jittered
    matrices :math:`\Sigma + \varepsilon \operatorname{diag}(\Sigma)` (the value returned)."""

    @staticmethod
    def forward(ctx, mean_q: Tensor, cov_q: Tensor, mean_p: Tensor, cov_p: Tensor) -> Tensor:
        n = mean_q.shape[-1]
        l_q, d_q, eps_q = _normalized_cholesky(cov_q, "cov_q")
        l_p, d_p, eps_p = _normalized_cholesky(cov_p, "cov_p")
        m = torch.linalg.solve_triangular(l_p, (d_q / d_p)[:, None] * l_q, upper=False)
        delta = torch.linalg.solve_triangular(l_p, ((mean_p - mean_q) / d_p)[:, None], upper=False)
        logdet_p = 2 * (l_p.diagonal().log().sum() + d_p.log().sum())
        logdet_q = 2 * (l_q.diagonal().log().sum() + d_q.log().sum())
        ctx.save_for_backward(l_q, d_q, l_p, d_p, m, delta)
        ctx.eps = (eps_q, eps_p)
        return 0.5 * (m.square().sum() + delta.square().sum() - n + logdet_p - logdet_q)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        l_q, d_q, l_p, d_p, m, delta = ctx.saved_tensors
        need_mq, need_cq, need_mp, need_cp = ctx.needs_input_grad
        grad_mq = grad_cq = grad_mp = grad_cp = None
        # Σ_p⁻¹ = D_p⁻¹ R_p⁻¹ D_p⁻¹ and α = Σ_p⁻¹ (m_p - m_q) = D_p⁻¹ L_p⁻ᵀ δ
        alpha = torch.linalg.solve_triangular(l_p.mT, delta, upper=True)[:, 0] / d_p
        if need_mq:
            grad_mq = -grad * alpha
        if need_mp:
            grad_mp = grad * alpha
        if need_cq or need_cp:
            inv_p = torch.cholesky_inverse(l_p) / (d_p[:, None] * d_p[None, :])
        if need_cq:
            inv_q = torch.cholesky_inverse(l_q) / (d_q[:, None] * d_q[None, :])
            grad_cq = (0.5 * grad) * (inv_p - inv_q)
            grad_cq.diagonal().mul_(1 + ctx.eps[0])
        if need_cp:
            # Σ_p⁻¹ Σ_q Σ_p⁻¹ = B Bᵀ with B = Σ_p⁻¹ D_q L_q = D_p⁻¹ L_p⁻ᵀ m
            b = torch.linalg.solve_triangular(l_p.mT, m, upper=True) / d_p[:, None]
            grad_cp = (0.5 * grad) * (inv_p - b @ b.mT - alpha[:, None] * alpha[None, :])
            grad_cp.diagonal().mul_(1 + ctx.eps[1])
        return grad_mq, grad_cq, grad_mp, grad_cp


def gaussian_kl(mean_q: Tensor, cov_q: Tensor, mean_p: Tensor, cov_p: Tensor) -> Tensor:
    r"""Closed-form :math:`\mathrm{KL}(N(m_q, \Sigma_q) \,\|\, N(m_p, \Sigma_p))` in :math:`n` dimensions:

    .. math::
        \tfrac12 \Big[\operatorname{tr}(\Sigma_p^{-1}\Sigma_q) + (m_p - m_q)^\top \Sigma_p^{-1} (m_p - m_q) - n
            + \log|\Sigma_p| - \log|\Sigma_q|\Big].

    Computed with Cholesky factors of the two correlation matrices (:math:`\Sigma = D L L^\top D`):
    :math:`\operatorname{tr}(\Sigma_p^{-1}\Sigma_q) = \|L_p^{-1} D_p^{-1} D_q L_q\|_F^2`, one triangular solve
    for the mean term, log-determinants from the diagonals. Cost :math:`O(n^3)`; differentiable (first order)
    in all four arguments, with the analytic gradient (:class:`_GaussianKL`).

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
    return _GaussianKL.apply(mean_q, cov_q, mean_p, cov_p)
