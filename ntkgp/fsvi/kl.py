r"""The KL divergence between two multivariate Gaussians, and FSVI's function-space KL on context points."""

from __future__ import annotations

import torch
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor

from ..options import KLCovariance, PriorLinearization
from .linearized import LinearizedNetwork
from .prior import GaussianParameterPrior
from .variational import MeanFieldGaussian


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


def diagonal_kl(mean_q: Tensor, var_q: Tensor, mean_p: Tensor, var_p: Tensor) -> Tensor:
    r""":math:`\sum_i \mathrm{KL}(N(m_{q,i}, v_{q,i}) \,\|\, N(m_{p,i}, v_{p,i}))
    = \tfrac12 \sum_i \big[v_{q,i}/v_{p,i} + (m_{q,i} - m_{p,i})^2/v_{p,i} - 1 + \log v_{p,i} - \log v_{q,i}\big]`."""
    for name, v in (("the variational variances", var_q), ("the prior variances", var_p)):
        if not (v > 0).all():
            raise ValueError(f"{name} at the context points include zeros: the KL is undefined (use context_jitter > 0)")
    return 0.5 * (var_q / var_p + (mean_q - mean_p).square() / var_p - 1 + var_p.log() - var_q.log()).sum()


def context_kl(
    linearized: LinearizedNetwork,
    variational: MeanFieldGaussian,
    prior: GaussianParameterPrior,
    x: Tensor,
    kl_covariance: KLCovariance,
    context_jitter: float,
) -> Tensor:
    r""":math:`\mathrm{KL}(q(f_C) \,\|\, p(f_C))` on the ``K·C`` outputs at prepared context inputs ``x``: the body of
    :meth:`ntkgp.fsvi.FSVI.function_space_kl` (which states the formula).

    About :math:`\mu` (``prior.prior_linearization``) prior and variational Gaussian share the features of one
    forward and one backward pass and the mean difference is :math:`J_\mu(\mu - \mu_0)`; about :math:`\mu_0` the
    prior's features are computed apart, without a graph. ``kl_covariance`` keeps the full covariances, the
    ``K`` blocks ``C × C`` or the variances; ``context_jitter`` :math:`\tau` adds :math:`\tau \bar\sigma_p^2 I` to
    both (a constant of the step: no gradient flows through :math:`\bar\sigma_p^2`)."""
    grad = torch.is_grad_enabled()
    means = variational.means()
    feats = linearized.features(means, x, create_graph=grad)
    if prior.prior_linearization is PriorLinearization.VARIATIONAL_MEAN:
        feats_p = feats
        # m_q - m_p = f(X; μ) - [f(X; μ) + J_μ (μ0 - μ)] = J_μ (μ - μ0)
        prior_means = prior.means()
        mean_q = linearized.jvp(feats, {n: means[n] - prior_means[n] for n in means})
        mean_p = torch.zeros_like(mean_q)
    else:
        feats_p = linearized.features(prior.means(), x, create_graph=False)
        mean_q, mean_p = feats.outputs, feats_p.outputs
    pairs = ((feats, variational.variances()), (feats_p, prior.variances()))
    diagonal = kl_covariance is KLCovariance.DIAGONAL
    if kl_covariance is KLCovariance.FULL:
        cov_q, cov_p = (linearized.covariance_from_features(f, v) for f, v in pairs)
        mean_q, mean_p = mean_q.reshape(-1), mean_p.reshape(-1)
    else:  # (K, C, C) blocks, or (K, C) variances
        cov_q, cov_p = (linearized.blocks_from_features(f, v, variances_only=diagonal) for f, v in pairs)
    if context_jitter > 0:
        # a constant of the step: τ times the mean prior variance at the context points
        prior_variances = cov_p if diagonal else cov_p.diagonal(dim1=-2, dim2=-1)
        noise = context_jitter * prior_variances.mean().detach()
        if not diagonal:
            noise = noise * torch.eye(cov_p.shape[-1], dtype=cov_p.dtype, device=cov_p.device)
        cov_q, cov_p = cov_q + noise, cov_p + noise
    if diagonal:
        return diagonal_kl(mean_q, cov_q, mean_p, cov_p)
    return gaussian_kl(mean_q, cov_q, mean_p, cov_p).sum()
