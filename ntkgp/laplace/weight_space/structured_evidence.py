r"""The evidence of a curvature with a diagonal spectrum, as one node of the graph.

For the diagonal curvatures and KFAC with one output-scale component :math:`s` (``docs/math.md``, "Laplace-GGN
evidence"), every eigenvalue of :math:`H` is :math:`s^q u_p` with fixed :math:`u_p \ge 0` (the diagonal, or
the products of the Kronecker factors' eigenvalues; :math:`q = 1` for the GGN, :math:`2` for the empirical Fisher)
shifted by the prior precision of its group, and the data term is :math:`\alpha + \beta \log s + \gamma s`
(:func:`~ntkgp.laplace.weight_space.scaling.data_fit_statistics`), so, with :math:`z_p = s^q u_p / \delta_{g(p)}
\ge 0`,

.. math::
    \log q(\mathcal D) = \alpha + \beta \log s + \gamma s - \tfrac12 \sum_g \delta_g \|\theta^*_g\|^2
    - \tfrac12 \sum_p \log(1 + z_p),

    \frac{\partial}{\partial \delta_g} = -\tfrac12 \|\theta^*_g\|^2 + \frac{1}{2 \delta_g}
    \sum_{p \in g} \frac{z_p}{1 + z_p}, \qquad
    \frac{\partial}{\partial v} = -s^2 \frac{\partial}{\partial s}
    = -\beta s - \gamma s^2 + \frac{q s}{2} \sum_p \frac{z_p}{1 + z_p}

in the variance :math:`v = 1/s` the likelihood holds (the noise :math:`\sigma^2` or the temperature :math:`T`):
:math:`\log|H + P_0| - \log|P_0|` as a sum of ``log1p``, not the difference of :math:`\sum_p \log(s^q u_p +
\delta_{g(p)})` and :math:`\sum_g P_g \log \delta_g` (which loses the digits of the small :math:`z_p` when
:math:`\delta` is large), and the sum in the derivatives of positive terms. Forward and backward are :math:`O(P)`
with a handful of tensor operations, and the node takes :math:`v` itself (no reciprocal in the graph): a
hyperparameter step of these structures costs little more than the optimizer's own step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class Spectrum:
    r"""The fixed numbers of the node, formed once per curvature: the nonzero :math:`u_p` (a zero contributes
    nothing to the sums: :math:`\log(1 + 0) = 0 / (1 + 0) = 0`), the group of each (``None`` with one group),
    :math:`q`, :math:`\|\theta^*_g\|^2` ``(G,)`` and, with one group, that norm as a number."""

    __slots__ = ("eigenvalues", "groups", "num_groups", "power", "theta_sq_norms", "theta_sq_norm")

    def __init__(self, eigenvalues: Tensor, groups: Tensor, power: int, theta_sq_norms: Tensor) -> None:
        self.num_groups = theta_sq_norms.shape[0]
        one = self.num_groups == 1
        nonzero = eigenvalues != 0
        all_nonzero = bool(nonzero.all())
        self.eigenvalues = eigenvalues if all_nonzero else eigenvalues[nonzero]
        self.groups = None if one else groups if all_nonzero else groups[nonzero]
        self.power = int(power)
        self.theta_sq_norms = theta_sq_norms
        self.theta_sq_norm = float(theta_sq_norms[0]) if one else None


class _StructuredEvidence(torch.autograd.Function):
    """The evidence above and its first derivatives in ``delta`` and ``variance`` (module docstring).

    The ``O(P)`` work is a few tensor operations (:math:`z`, its ``log1p``, :math:`1/(1 + z)` and the sums); the
    scalars are Python floats, and the derivatives are formed in the forward pass when they are asked for (a
    hyperparameter step always asks), so that the backward pass only scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, delta, variance, spectrum, statistics):
        s = 1.0 if variance is None else 1.0 / (variance.item() if isinstance(variance, Tensor) else variance)
        weight = s if spectrum.power == 1 else s * s
        alpha, beta, gamma = statistics
        need_delta, need_variance = ctx.needs_input_grad[:2]
        u = spectrum.eigenvalues
        share = total = None
        if spectrum.groups is None:  # δ as a number: z = (w/δ) u in one pass over u
            d = delta.item()
            if not 0 < d < math.inf:  # the caller leaves this check to the node (Curvature.log_marginal_likelihood)
                raise ValueError(f"prior_precision must be positive and finite, got {[d]}")
            prior = 0.5 * d * spectrum.theta_sq_norm
            z = u * (weight / d)
            if need_delta or need_variance:  # Σ z_p/(1 + z_p) ≥ 0 as z · (1 + z)⁻¹, one dot product
                total = torch.dot(z, torch.add(z, 1.0).reciprocal_()).item()
        else:  # index_select (a third of the time of delta[groups] for P ~ 5,000)
            z = u * delta.reciprocal().mul_(weight).index_select(0, spectrum.groups)
            prior = 0.5 * torch.dot(delta, spectrum.theta_sq_norms).item()
            if need_delta or need_variance:  # z_p/(1 + z_p) ≥ 0 as z_p · (1 + z_p)⁻¹
                share = z * torch.add(z, 1.0).reciprocal_()
                total = share.sum().item() if need_variance else None
        log_det_ratio = z.log1p_().sum().item()  # z is this call's own
        if need_delta:  # ∂/∂δ_g = ½ (Σ_{p∈g} z_p/(1 + z_p) / δ_g − ‖θ_g‖²)
            ctx.grad_delta = (0.5 * (total / d - spectrum.theta_sq_norm) if share is None else
                              0.5 * (share.new_zeros(spectrum.num_groups).index_add_(0, spectrum.groups, share)
                                     / delta - spectrum.theta_sq_norms))
        if need_variance:  # ∂/∂v = −s² ∂/∂s = −β s − γ s² + (q s/2) Σ z_p/(1 + z_p)
            ctx.grad_variance = 0.5 * spectrum.power * s * total - beta * s - gamma * s * s
            ctx.variance_shape = variance.shape
        return torch.full((), alpha + beta * math.log(s) + gamma * s - prior - 0.5 * log_det_ratio,
                          dtype=u.dtype, device=u.device)

    @staticmethod
    def backward(ctx, grad):
        need_delta, need_variance = ctx.needs_input_grad[:2]
        return ((grad * ctx.grad_delta).reshape(-1) if need_delta else None,
                (grad * ctx.grad_variance).reshape(ctx.variance_shape) if need_variance else None, None, None)


def structured_evidence(
    delta: Tensor, variance: Tensor | None, spectrum: Spectrum, statistics: tuple[float, float, float]
) -> Tensor:
    r"""The log marginal likelihood of the module docstring, shape ``()``, first-order differentiable in
    ``delta`` and ``variance``.

    Args:
        delta: :math:`\delta > 0`, ``(G,)``, of the dtype of :math:`u` (validated by the caller; with one group
            its one value is checked here: ``ValueError`` naming ``prior_precision``).
        variance: :math:`v = 1/s > 0`, one element (the noise :math:`\sigma^2` or the temperature :math:`T`),
            or ``None`` for :math:`s = 1`.
        spectrum: :math:`u \ge 0`, the groups, :math:`q` (1: GGN, 2: empirical Fisher) and
            :math:`\|\theta^*_g\|^2` (:class:`Spectrum`).
        statistics: :math:`(\alpha, \beta, \gamma)` as numbers.
    """
    return _StructuredEvidence.apply(delta, variance, spectrum, statistics)
