r"""The KL divergence between two multivariate Gaussians, and FSVI's function-space KL on context points."""

from __future__ import annotations

import torch
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor


def _normalized_cholesky(cov: Tensor, name: str) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(L, d, ε)`` with :math:`\Sigma + \varepsilon \operatorname{diag}(\Sigma) = D L L^\top D`,
    :math:`D = \operatorname{diag}(d)`, :math:`d = \sqrt{\operatorname{diag}\Sigma}`, for a matrix or a batch
    ``(..., n, n)`` of them (``ε`` of shape ``(...)``).

    The Cholesky factor is taken of the correlation matrix (unit diagonal), so GPyTorch's jitter
    :math:`\varepsilon` (0 unless the plain factorization fails; then added with a ``NumericalWarning``) is
    relative to the variances whatever their scale; this keeps the KL stable in float32.
    """
    variances = cov.diagonal(dim1=-2, dim2=-1)
    if not (variances > 0).all():
        raise ValueError(f"{name} has a zero or negative variance on its diagonal: the Gaussian is degenerate")
    d = variances.sqrt()
    correlation = cov / (d[..., :, None] * d[..., None, :])
    factor, info = torch.linalg.cholesky_ex(correlation)
    if not info.any():
        return factor, d, torch.zeros_like(d[..., 0])
    factor = psd_safe_cholesky(correlation)  # adds jitter to the diagonal and warns
    # the jittered correlation matrix has 1 + ε on its diagonal: read ε back from the factor's first row
    return factor, d, factor[..., 0, 0].square() - 1


def _outer(u: Tensor, v: Tensor) -> Tensor:
    return u[..., :, None] * v[..., None, :]


class _GaussianKL(torch.autograd.Function):
    r"""The closed-form KL with its analytic gradient (first order):

    .. math::
        \frac{\partial \mathrm{KL}}{\partial m_q} = -\Sigma_p^{-1}(m_p - m_q), \quad
        \frac{\partial \mathrm{KL}}{\partial \Sigma_q} = \tfrac12(\Sigma_p^{-1} - \Sigma_q^{-1}), \quad
        \frac{\partial \mathrm{KL}}{\partial \Sigma_p} = \tfrac12\big(\Sigma_p^{-1} - \Sigma_p^{-1}\Sigma_q\Sigma_p^{-1}
            - \alpha\alpha^\top\big),\ \alpha = \Sigma_p^{-1}(m_p - m_q),

    from the two Cholesky factors of the forward pass (two ``cholesky_inverse``, one triangular solve of a vector
    and matrix products; autograd through the factorizations and the solves costs several times more). The matrix
    gradients are symmetric (the factorization reads one triangle). When jitter was needed, they are those of the
    KL of the jittered matrices :math:`\Sigma + \varepsilon \operatorname{diag}(\Sigma)` (the value returned)."""

    @staticmethod
    def forward(ctx, mean_q: Tensor, cov_q: Tensor, mean_p: Tensor, cov_p: Tensor) -> Tensor:
        n = mean_q.shape[-1]
        l_q, d_q, eps_q = _normalized_cholesky(cov_q, "cov_q")
        l_p, d_p, eps_p = _normalized_cholesky(cov_p, "cov_p")
        m = torch.linalg.solve_triangular(l_p, (d_q / d_p)[..., :, None] * l_q, upper=False)
        delta = torch.linalg.solve_triangular(l_p, ((mean_p - mean_q) / d_p)[..., :, None], upper=False)
        logdet_p = 2 * (l_p.diagonal(dim1=-2, dim2=-1).log().sum(-1) + d_p.log().sum(-1))
        logdet_q = 2 * (l_q.diagonal(dim1=-2, dim2=-1).log().sum(-1) + d_q.log().sum(-1))
        ctx.save_for_backward(l_q, d_q, l_p, d_p, delta, eps_q, eps_p)
        return 0.5 * (m.square().sum((-2, -1)) + delta.square().sum((-2, -1)) - n + logdet_p - logdet_q)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        l_q, d_q, l_p, d_p, delta, eps_q, eps_p = ctx.saved_tensors
        need_mq, need_cq, need_mp, need_cp = ctx.needs_input_grad
        grad_mq = grad_cq = grad_mp = grad_cp = None
        # Σ_p⁻¹ = D_p⁻¹ R_p⁻¹ D_p⁻¹ and α = Σ_p⁻¹ (m_p - m_q) = D_p⁻¹ L_p⁻ᵀ δ
        alpha = torch.linalg.solve_triangular(l_p.mT, delta, upper=True)[..., 0] / d_p
        grad_v, grad_m = grad[..., None], grad[..., None, None]  # one gradient per Gaussian of a batch
        if need_mq:
            grad_mq = -grad_v * alpha
        if need_mp:
            grad_mp = grad_v * alpha
        if need_cq or need_cp:
            inv_p = torch.cholesky_inverse(l_p) / _outer(d_p, d_p)
        if need_cq:
            inv_q = torch.cholesky_inverse(l_q) / _outer(d_q, d_q)
            grad_cq = (0.5 * grad_m) * (inv_p - inv_q)
            grad_cq.diagonal(dim1=-2, dim2=-1).mul_(1 + eps_q[..., None])
        if need_cp:
            # Σ_p⁻¹ Σ_q Σ_p⁻¹ = B Bᵀ with B = Σ_p⁻¹ D_q L_q (a product: on a CPU faster than a triangular solve)
            b = inv_p @ (d_q[..., :, None] * l_q)
            grad_cp = (0.5 * grad_m) * (inv_p - b @ b.mT - _outer(alpha, alpha))
            grad_cp.diagonal(dim1=-2, dim2=-1).mul_(1 + eps_p[..., None])
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

    Batches of Gaussians (the same leading shape ``(...)`` on all four arguments) give one KL per Gaussian.

    Args:
        mean_q: ``(..., n)``.
        cov_q: ``(..., n, n)`` symmetric positive definite.
        mean_p: ``(..., n)``.
        cov_p: ``(..., n, n)`` symmetric positive definite.

    Returns:
        A tensor of shape ``(...)`` (0-dim for one pair of Gaussians).

    Raises:
        ValueError: shapes that do not match, or a non-positive variance on a diagonal.
    """
    batch, n = mean_q.shape[:-1], (mean_q.shape[-1] if mean_q.dim() else 0)
    vector, matrix = (*batch, n), (*batch, n, n)
    if mean_q.dim() == 0 or mean_p.shape != vector or cov_q.shape != matrix or cov_p.shape != matrix:
        raise ValueError(
            f"expected means (..., n) and covariances (..., n, n); got mean_q {tuple(mean_q.shape)}, cov_q "
            f"{tuple(cov_q.shape)}, mean_p {tuple(mean_p.shape)}, cov_p {tuple(cov_p.shape)}"
        )
    return _GaussianKL.apply(mean_q, cov_q, mean_p, cov_p)
