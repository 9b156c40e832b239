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

from dataclasses import dataclass

import torch
from torch import Tensor

#: Groups in at most this many consecutive runs are summed run by run (one ``sum`` each), more by ``index_add_``.
MAX_RUNS = 8


@dataclass(frozen=True, eq=False)
class GroupLayout:
    r"""The groups :math:`g(p)` of the eigenvalues and how the per-group sums :math:`\sum_{p \in g}` are taken.

    Attributes:
        groups: :math:`g(p)`, ``(P,)`` long.
        num_groups: :math:`G`.
        runs: with the groups ``0, 1, ..., G - 1`` each in one run of consecutive eigenvalues (KFAC's blocks, a
            diagonal's parameters in order) and :math:`G \le` :data:`MAX_RUNS`, the runs' lengths; else ``None``.
    """

    groups: Tensor
    num_groups: int
    runs: tuple[int, ...] | None

    @classmethod
    def of(cls, groups: Tensor, num_groups: int) -> GroupLayout:
        """The layout of ``groups`` (one pass over them: computed once per curvature)."""
        values, counts = torch.unique_consecutive(groups, return_counts=True)
        ordered = values.tolist() == list(range(num_groups)) and num_groups <= MAX_RUNS
        return cls(groups, num_groups, tuple(counts.tolist()) if ordered else None)

    def expand(self, delta: Tensor) -> Tensor:
        r""":math:`\delta_{g(p)}`, ``(P,)``, or ``delta`` itself ``(1,)`` for one group (it broadcasts)."""
        return delta if self.num_groups == 1 else delta.index_select(0, self.groups)

    def sums(self, values: Tensor) -> Tensor:
        r""":math:`\sum_{p \in g} v_p` per group, ``(G,)``."""
        if self.num_groups == 1:
            return values.sum().reshape(1)
        if self.runs is not None:
            return torch.stack([part.sum() for part in values.split(self.runs)])
        return values.new_zeros(self.num_groups).index_add_(0, self.groups, values)


class _StructuredEvidence(torch.autograd.Function):
    """The evidence above and its first derivatives in ``delta`` and ``scale`` (module docstring)."""

    @staticmethod
    def forward(ctx, delta, scale, eigenvalues, layout, power, theta_sq_norms, group_sizes, statistics):
        s = scale.reshape(())
        weight = s if power == 1 else s * s
        terms = torch.addcmul(layout.expand(delta), eigenvalues, weight)
        alpha, beta, gamma = statistics[:, 0]
        value = (alpha + beta * s.log() + gamma * s - 0.5 * torch.dot(delta, theta_sq_norms)
                 + 0.5 * torch.dot(group_sizes, delta.log()) - 0.5 * terms.log().sum())
        ctx.save_for_backward(delta, scale, eigenvalues, theta_sq_norms, group_sizes, statistics,
                              terms.reciprocal())
        ctx.power, ctx.layout = power, layout
        return value

    @staticmethod
    def backward(ctx, grad):
        delta, scale, eigenvalues, theta_sq_norms, group_sizes, statistics, reciprocal = ctx.saved_tensors
        grad_delta = grad_scale = None
        if ctx.needs_input_grad[0]:
            grad_delta = grad * 0.5 * (group_sizes / delta - theta_sq_norms - ctx.layout.sums(reciprocal))
        if ctx.needs_input_grad[1]:
            s = scale.reshape(())
            slope = torch.dot(eigenvalues, reciprocal) * (1 if ctx.power == 1 else 2 * s)  # q s^(q-1) Σ u/t
            grad_scale = (grad * (statistics[1, 0] / s + statistics[2, 0] - 0.5 * slope)).reshape(1)
        return grad_delta, grad_scale, None, None, None, None, None, None


def structured_evidence(
    delta: Tensor,
    scale: Tensor,
    eigenvalues: Tensor,
    groups: Tensor | GroupLayout,
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
        eigenvalues: :math:`u \ge 0`, ``(P,)``; ``groups``: :math:`g(p)`, ``(P,)`` long, or its
            :class:`GroupLayout` (formed once by the caller that evaluates many steps).
        power: :math:`q`, 1 (GGN) or 2 (empirical Fisher).
        theta_sq_norms, group_sizes: :math:`\|\theta^*_g\|^2` and :math:`P_g`, ``(G,)``.
        statistics: :math:`(\alpha, \beta, \gamma)`, ``(3, 1)``.
    """
    layout = groups if isinstance(groups, GroupLayout) else GroupLayout.of(groups, delta.shape[0])
    return _StructuredEvidence.apply(delta, scale, eigenvalues, layout, power, theta_sq_norms, group_sizes,
                                     statistics)
