r"""The exact log-determinant of the weight-space evidence with several prior precisions, when one group holds most
of the parameters: one eigendecomposition of that group's block per network state, then :math:`O(P_b k^2 + k^3)`
per evaluation (``k = P - P_b``) instead of the :math:`O(P^3)` Cholesky factorization of
:func:`~ntkgp.laplace.ggn.exact_log_det.scaled_log_det`.

With one curvature component, :math:`H = w D` (:math:`w` the output scale :math:`s`, or :math:`s^2` for the
empirical Fisher), columns split into the largest group ``b`` (precision :math:`\delta_b`, :math:`P_b` columns)
and the other ``k`` (:math:`\Delta = \operatorname{diag}(\delta_{g(j)})`), the Schur complement of the ``b``
block gives (``docs/math.md``, "Several prior precisions, one large group")

.. math::
    \log|H + P_0| - \log|P_0| = \sum_{i} \log\Bigl(1 + \frac{w \mu_i}{\delta_b}\Bigr) + \log|\tilde C|, \qquad
    \tilde C = I + \Delta^{-1/2}\Bigl(w F + \sum_i c_i z_i z_i^\top\Bigr)\Delta^{-1/2},

with :math:`D_{bb} = U \operatorname{diag}(\mu) U^\top` (decomposed once), :math:`G = U^\top D_{bo}`
(``P_b × k``) and, for the eigenvalues above the rounding level :math:`\tau` of the decomposition,
:math:`z_i = G_i / \sqrt{\mu_i}`, :math:`c_i = w \delta_b / (\delta_b + w \mu_i) > 0`; for those at or below it
:math:`z_i = G_i`, :math:`c_i = -w^2 / (\delta_b + w \mu_i)`; :math:`F = D_{oo} - \sum_{\mu_i > \tau} z_i z_i^\top`
(the Schur complement of :math:`D_{bb}` in :math:`D`, positive semi-definite, fixed). This is the identity
:math:`w D_{oo} - w^2 D_{ob}(w D_{bb} + \delta_b I)^{-1} D_{bo} = w F + \sum_i c_i z_i z_i^\top`, written so that a
step adds positive terms to fixed ones: a large :math:`\delta_b` does not make :math:`\tilde C` a small difference
of large matrices (the matrix determinant lemma about :math:`H + \delta_b I` would, when :math:`\delta_b` exceeds
the other precisions), and the negative terms are bounded by :math:`w^2 \tau \|D\|/\delta_b`. Both terms of the
value are sums of logarithms of numbers :math:`\ge 1`.

Gradients in closed form from the factor :math:`\tilde L` of :math:`\tilde C` (:math:`q_i = \|\tilde L^{-1}
\Delta^{-1/2} z_i\|^2`, one ``P_b × k`` product):

.. math::
    \frac{\partial}{\partial \delta_j} = -\frac{1 - [\tilde C^{-1}]_{jj}}{\delta_j}, \quad
    \frac{\partial}{\partial \delta_b} = -\sum_i \frac{w\mu_i}{\delta_b(\delta_b + w\mu_i)}
        + \sum_i q_i \frac{\partial c_i}{\partial \delta_b}, \quad
    \frac{\partial}{\partial w} = \sum_i \frac{\mu_i}{\delta_b + w\mu_i}
        + \langle \tilde C^{-1}, \Delta^{-1/2} F \Delta^{-1/2}\rangle + \sum_i q_i \frac{\partial c_i}{\partial w},

with :math:`\partial c_i/\partial w = \delta_b^2/(\delta_b + w\mu_i)^2` above :math:`\tau` (the derivative of
:math:`w c_i / w`, no difference taken). Memory: :math:`z` (``P_b × k``), :math:`\mu` and :math:`F` (``k × k``)
kept per network state; the ``P_b × P_b`` eigenvectors only while the decomposition runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg import triangular_inverse

__all__ = ["GroupSchur", "low_rank_cheaper"]


def low_rank_cheaper(sizes: Tensor) -> bool:
    r"""Whether the route pays: its step, :math:`2 P_b k^2 + k^3` multiply-adds (the ``P_b × k`` products of the
    value and of the gradient, the ``k × k`` factor and inverse), at most half the Cholesky route's :math:`P^3/2`
    (factor and triangular inverse), so that the decomposition (a few Cholesky steps) is repaid within a few
    steps. Measured (``benchmarks/low_rank_crossover.py``, one thread, P = 600 and 1200): equal step times at
    :math:`P_b/P \approx 0.37`, 0.46× at 0.6, 0.26-0.32× at 0.7, 0.06-0.12× at 0.9; the rule takes the route
    from :math:`P_b/P \approx 0.61`."""
    p, large = int(sizes.sum()), int(sizes.max())
    k = p - large
    return k > 0 and 2 * large * k * k + k**3 <= p**3 / 4


class _NotFactorized(Exception):
    """:math:`\\tilde C`'s Cholesky factorization failed (rounding): the caller takes the Cholesky route."""


class _SchurLogDet(torch.autograd.Function):
    """The value of the module docstring, differentiable in ``weight`` ``(1,)`` and ``delta`` ``(G,)``."""

    @staticmethod
    def forward(ctx, weight: Tensor, delta: Tensor, schur: GroupSchur) -> Tensor:
        w, db = weight[0], delta[schur.block]
        denominator = w * schur.mu + db
        scale = torch.where(schur.above, w * db, -w * w) / denominator  # c_i
        root = delta[schur.other_groups].rsqrt()
        z = schur.z * root
        matrix = torch.mm((z * scale[:, None]).mT, z)
        matrix.add_(schur.residual * (w * root[:, None] * root))
        matrix.diagonal().add_(1)
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) != 0:
            raise _NotFactorized
        ctx.save_for_backward(factor, z, root, denominator, weight, delta)
        ctx.schur = schur
        return torch.log1p(w * schur.mu / db).sum() + 2 * factor.diagonal().log().sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        factor, z, root, denominator, weight, delta = ctx.saved_tensors
        schur = ctx.schur
        w, db, mu = weight[0], delta[schur.block], schur.mu
        inverse_factor = triangular_inverse(factor)
        inverse_diagonal = torch.linalg.vector_norm(inverse_factor, dim=0).square()  # diag C̃⁻¹
        q = torch.mm(z, inverse_factor.mT).square_().sum(1)  # ‖L̃⁻¹ Δ^{-1/2} z_i‖²
        square = denominator.square()
        grad_delta = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_delta = delta.new_zeros(delta.shape).index_add_(0, schur.other_groups,
                                                                 (inverse_diagonal - 1) * root.square())
            d_scale = torch.where(schur.above, w * w * mu, w * w) / square  # ∂c_i / ∂δ_b
            grad_delta[schur.block] = (q * d_scale).sum() - (w * mu / (db * denominator)).sum()
            grad_delta = grad * grad_delta
        if ctx.needs_input_grad[0]:
            inverse = inverse_factor.mT @ inverse_factor
            whitened = schur.residual * root[:, None] * root
            d_scale = torch.where(schur.above, db * db, -(w * w * mu + 2 * w * db)) / square  # ∂c_i / ∂w
            value = (mu / denominator).sum() + (inverse * whitened).sum() + (q * d_scale).sum()
            grad_weight = (grad * value).reshape(1)
        return grad_weight, grad_delta, None


class GroupSchur:
    r"""The fixed data of the route (module docstring) for one component :math:`D` ``(P, P)``, computed once.

    Args:
        component: :math:`D`, symmetric positive semi-definite, columns in the order of ``column_groups``.
        column_groups: the group of every column, ``(P,)`` long.
        sizes: the number of columns of every group, ``(G,)``.
    """

    def __init__(self, component: Tensor, column_groups: Tensor, sizes: Tensor) -> None:
        self.block = int(torch.argmax(sizes))
        inside = (column_groups == self.block).nonzero().squeeze(1)
        outside = (column_groups != self.block).nonzero().squeeze(1)
        self.other_groups = column_groups[outside]
        with torch.no_grad():
            rows = component[inside]
            mu, vectors = torch.linalg.eigh(rows[:, inside])
            mu = mu.clamp_min(0)
            g = vectors.mT @ rows[:, outside]  # U^T D_bo
            eps = torch.finfo(component.dtype).eps
            self.above = mu > inside.shape[0] * eps * mu.max()  # above the rounding level τ of the decomposition
            self.mu = mu
            self.z = torch.where(self.above[:, None], g / mu.clamp_min(torch.finfo(mu.dtype).tiny).sqrt()[:, None], g)
            kept = self.z[self.above]
            residual = component[outside][:, outside] - kept.mT @ kept
            self.residual = (residual + residual.mT) / 2

    def log_det_ratio(self, weight: Tensor, delta: Tensor) -> Tensor | None:
        r""":math:`\log|w D + P_0| - \log|P_0|` for the component weight :math:`w` ``(1,)`` and the precisions
        :math:`\delta` ``(G,)`` (both differentiable), or ``None`` when :math:`\tilde C` cannot be factorized
        (the caller then takes the Cholesky route)."""
        try:
            return _SchurLogDet.apply(weight, delta, self)
        except _NotFactorized:
            return None
