r"""The evidence of a curvature with a diagonal spectrum, as one node of the graph.

For the diagonal curvatures and KFAC with one output-scale component :math:`s` (``docs/math.md``, "Laplace-GGN
evidence"), every eigenvalue of :math:`H` is :math:`s^q u_p` with fixed :math:`u_p \ge 0` (the diagonal, or
the products of the Kronecker factors' eigenvalues; :math:`q = 1` for the GGN, :math:`2` for the empirical Fisher)
shifted by the prior precision of its group, and the data term is :math:`\alpha + \beta \log s + \gamma s`
(:func:`~ntkgp.laplace.weight_space.scaling.data_fit_statistics`), so

.. math::
    \log q(\mathcal D) = \alpha + \beta \log s + \gamma s - \tfrac12 \sum_g \delta_g \|\theta^*_g\|^2
    + \tfrac12 \sum_g P_g \log \delta_g - \tfrac12 \sum_p \log(s^q u_p + \delta_{g(p)}),

    \frac{\partial}{\partial \delta_g} = -\tfrac12 \|\theta^*_g\|^2 + \frac{P_g}{2 \delta_g}
    - \tfrac12 \sum_{p \in g} t_p^{-1}, \qquad
    \frac{\partial}{\partial s} = \frac{\beta}{s} + \gamma - \frac q2 s^{q - 1} \sum_p u_p t_p^{-1},

with :math:`t_p = s^q u_p + \delta_{g(p)} > 0`. Forward and backward are :math:`O(P)` with a handful of tensor
operations: a hyperparameter step of these structures costs little more than the optimizer's own step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class _StructuredEvidence(torch.autograd.Function):
    """The evidence above and its first derivatives in ``delta`` and ``scale`` (module docstring).

    The ``O(P)`` work is four tensor operations (the shifted eigenvalues, their reciprocals, the logarithms, the sums);
    the scalars are Python floats, and the derivatives are formed in the forward pass when they are asked for (a
    hyperparameter step always asks), so that the backward pass only scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, delta, scale, eigenvalues, groups, power, theta_sq_norms, group_sizes, statistics):
        s = float(scale)
        weight = s if power == 1 else s * s
        alpha, beta, gamma = statistics[:, 0].tolist()
        one = delta.shape[0] == 1
        if one:  # δ as a number: the shift is one pass over u
            d, norm, size = float(delta), float(theta_sq_norms), float(group_sizes)
            terms = eigenvalues.add(d) if weight == 1 else torch.add(delta, eigenvalues, alpha=weight)
            prior = 0.5 * (size * math.log(d) - d * norm)
        else:  # index_select (a third of the time of delta[groups] for P ~ 5,000)
            terms = torch.add(delta.index_select(0, groups), eigenvalues, alpha=weight)
            prior = 0.5 * float(torch.dot(group_sizes, delta.log()) - torch.dot(delta, theta_sq_norms))
        need_delta, need_scale = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_delta or need_scale:
            reciprocal = terms.reciprocal()
            if need_delta:  # ∂/∂δ_g = ½ (P_g/δ_g − ‖θ_g‖² − Σ_{p∈g} 1/t_p)
                ctx.grad_delta = (0.5 * (size / d - norm - float(reciprocal.sum())) if one else
                                  0.5 * (group_sizes / delta - theta_sq_norms
                                         - reciprocal.new_zeros(delta.shape[0]).index_add_(0, groups, reciprocal)))
            if need_scale:  # ∂/∂s = β/s + γ − ½ q s^(q−1) Σ u/t
                slope = float(torch.dot(eigenvalues, reciprocal)) * (1 if power == 1 else 2 * s)
                ctx.grad_scale = beta / s + gamma - 0.5 * slope
        log_det = float(terms.log_().sum())
        return torch.full((), alpha + beta * math.log(s) + gamma * s + prior - 0.5 * log_det, dtype=delta.dtype,
                          device=delta.device)

    @staticmethod
    def backward(ctx, grad):
        grad_delta = grad_scale = None
        if ctx.needs_input_grad[0]:
            grad_delta = (grad * ctx.grad_delta).reshape(-1)
        if ctx.needs_input_grad[1]:
            grad_scale = (grad * ctx.grad_scale).reshape(1)
        return grad_delta, grad_scale, None, None, None, None, None, None


def structured_evidence(
    delta: Tensor,
    scale: Tensor,
    eigenvalues: Tensor,
    groups: Tensor,
    power: int,
    theta_sq_norms: Tensor,
    group_sizes: Tensor,
    statistics: Tensor,
) -> Tensor:
    r"""The log marginal likelihood of the module docstring, shape ``()``, first-order differentiable in
    ``delta`` and ``scale``.

    Args:
        delta: :math:`\delta > 0`, ``(G,)`` (validated by the caller).
        scale: :math:`s > 0`, ``(1,)``.
        eigenvalues: :math:`u \ge 0`, ``(P,)``; ``groups``: :math:`g(p)`, ``(P,)`` long.
        power: :math:`q`, 1 (GGN) or 2 (empirical Fisher).
        theta_sq_norms, group_sizes: :math:`\|\theta^*_g\|^2` and :math:`P_g`, ``(G,)``.
        statistics: :math:`(\alpha, \beta, \gamma)`, ``(3, 1)``.
    """
    return _StructuredEvidence.apply(delta, scale, eigenvalues, groups, power, theta_sq_norms, group_sizes,
                                     statistics)
