r"""The Laplace evidence of a curvature with a known spectrum, as one node of the graph.

Wherever every eigenvalue of :math:`H + P_0` is :math:`s_0^q u_p + \delta_{g(p)}` with fixed :math:`u_p \ge 0`
(``docs/math.md``, "Laplace-GGN evidence"), the evidence is a function of a few numbers: the diagonal curvatures and
KFAC with one output scale (:math:`u_p` the diagonal, or the products of the Kronecker factors' eigenvalues), and the
full GGN or empirical Fisher with one prior precision (:math:`u_p` the eigenvalues of :math:`J^\top L_0 L_0^\top J`
or of :math:`L_0^\top K_1 L_0`, :mod:`~ntkgp.laplace.function_space.eigen`). Here :math:`q = 1` for the GGN and
:math:`2` for the empirical Fisher, :math:`s_k = 1/v_k` the output scale of the variances :math:`v` the likelihood
holds (the noises :math:`\sigma_k^2`, or the temperature :math:`T`; only :math:`s_0` scales the curvature, every
:math:`s_k` the data term :math:`\sum_k \alpha_k + \beta_k \log s_k + \gamma_k s_k`,
:func:`~ntkgp.laplace.ggn.scaling.data_fit_statistics`). With :math:`z_p = s_0^q u_p / \delta_{g(p)} \ge 0`,

.. math::
    \log q(\mathcal D) = \sum_k (\alpha_k + \beta_k \log s_k + \gamma_k s_k) - \tfrac12 \sum_g \delta_g
    \|\theta^*_g\|^2 - \tfrac12 \sum_p \log(1 + z_p),

    \frac{\partial}{\partial \delta_g} = -\tfrac12 \|\theta^*_g\|^2 + \frac{1}{2 \delta_g}
    \sum_{p \in g} \frac{z_p}{1 + z_p}, \qquad
    \frac{\partial}{\partial v_k} = -s_k^2 \frac{\partial}{\partial s_k}
    = -\beta_k s_k - \gamma_k s_k^2 + [k = 0]\, \frac{q s_0}{2} \sum_p \frac{z_p}{1 + z_p}:

:math:`\log|H + P_0| - \log|P_0|` as a sum of ``log1p``, not the difference of :math:`\sum_p \log(s_0^q u_p +
\delta_{g(p)})` and :math:`\sum_g P_g \log \delta_g` (which loses the digits of the small :math:`z_p` when
:math:`\delta` is large), and the sum in the derivatives of positive terms. Forward and backward are :math:`O(P)`
(or :math:`O(\min(Nk, P))` eigenvalues) with a handful of tensor operations, and the node takes :math:`v` itself (no
reciprocal in the graph): a hyperparameter step costs little more than the optimizer's own step. Second derivatives
(``create_graph=True``) are formed from the same formulas as a graph of the saved inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Spectrum", "spectral_evidence"]


class Spectrum:
    r"""The fixed numbers of the node, formed once per curvature: the nonzero :math:`u_p` (a zero contributes
    nothing to the sums: :math:`\log(1 + 0) = 0 / (1 + 0) = 0`), the group of each (``None`` with one group),
    :math:`q`, :math:`\|\theta^*_g\|^2` ``(G,)`` and, with one group, that norm as a number.

    Args:
        eigenvalues: :math:`u \ge 0`, ``(P,)`` (or as many as the spectrum has).
        groups: the group of each eigenvalue, ``(P,)`` long; may be ``None`` with one group.
        power: :math:`q`, 1 (GGN) or 2 (empirical Fisher).
        theta_sq_norms: :math:`\|\theta^*_g\|^2`, ``(G,)``.
    """

    __slots__ = ("eigenvalues", "groups", "num_groups", "power", "theta_sq_norm", "theta_sq_norms")

    def __init__(self, eigenvalues: Tensor, groups: Tensor | None, power: int, theta_sq_norms: Tensor) -> None:
        self.num_groups = theta_sq_norms.shape[0]
        one = self.num_groups == 1
        nonzero = eigenvalues != 0
        all_nonzero = bool(nonzero.all())
        self.eigenvalues = eigenvalues if all_nonzero else eigenvalues[nonzero]
        self.groups = None if one else groups if all_nonzero else groups[nonzero]
        self.power = int(power)
        self.theta_sq_norms = theta_sq_norms
        self.theta_sq_norm = float(theta_sq_norms[0]) if one else None


def _numbers(statistics: Tensor | Sequence[float]) -> tuple[float, float, float] | Tensor:
    """The statistics ``(3, K)`` as three numbers where ``K = 1`` (the node then works on numbers), else as given."""
    if isinstance(statistics, Tensor):
        return tuple(statistics[:, 0].tolist()) if statistics.shape[-1] == 1 else statistics
    return statistics if isinstance(statistics, tuple) else tuple(float(a) for a in statistics)


class _SpectralEvidence(torch.autograd.Function):
    """The evidence of the module docstring and its first derivatives in ``delta`` and ``variance``.

    The ``O(P)`` work is a few tensor operations (:math:`z`, its ``log1p``, :math:`1/(1 + z)` and the sums); the
    scalars are Python floats, and the derivatives are formed in the forward pass when they are asked for (a
    hyperparameter step always asks), so that the backward pass only scales them by the incoming gradient. When a
    second derivative is asked for (``create_graph=True``), :func:`_derivatives` forms them again as a graph."""

    @staticmethod
    def forward(ctx, delta, variance, spectrum, statistics):
        alpha, beta, gamma = statistics
        numbers = not isinstance(statistics, Tensor)
        if variance is None:
            s = 1.0
        elif isinstance(variance, Tensor):
            s = 1.0 / (variance.item() if numbers else variance.reshape(-1)[0].item())
        else:
            s = 1.0 / variance
        weight = s if spectrum.power == 1 else s * s
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
        if numbers:  # one output scale: the data term in numbers
            fit = alpha + beta * math.log(s) + gamma * s
        else:  # K scales (per-output noises held equal): the data term's K components as tensors
            scales = variance.detach().reshape(-1).reciprocal()
            fit = torch.addcmul(alpha, beta, scales.log()).addcmul(gamma, scales).sum().item()
        if need_delta:  # ∂/∂δ_g = ½ (Σ_{p∈g} z_p/(1 + z_p) / δ_g − ‖θ_g‖²)
            ctx.grad_delta = (0.5 * (total / d - spectrum.theta_sq_norm) if share is None else
                              0.5 * (share.new_zeros(spectrum.num_groups).index_add_(0, spectrum.groups, share)
                                     / delta - spectrum.theta_sq_norms))
        if need_variance:  # ∂/∂v_k = −β_k s_k − γ_k s_k² + [k = 0] (q s_0/2) Σ z_p/(1 + z_p)
            own = 0.5 * spectrum.power * s * total
            if numbers:
                ctx.grad_variance = own - beta * s - gamma * s * s
            else:
                grad = -(beta * scales + gamma * scales.square())
                grad[0] += own
                ctx.grad_variance = grad
            ctx.variance_shape = variance.shape
        ctx.spectrum, ctx.statistics, ctx.scale = spectrum, statistics, s
        ctx.save_for_backward(delta, variance if isinstance(variance, Tensor) else None)
        return torch.full((), fit - prior - 0.5 * log_det_ratio, dtype=u.dtype, device=u.device)

    @staticmethod
    def backward(ctx, grad):
        need_delta, need_variance = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph: the derivatives again, as a graph of the saved inputs
            delta, variance = ctx.saved_tensors
            grad_delta, grad_variance = _derivatives(delta, variance, ctx.scale, ctx.spectrum, ctx.statistics)
        else:  # as the forward pass computed them
            grad_delta = ctx.grad_delta if need_delta else None
            grad_variance = ctx.grad_variance if need_variance else None
        return ((grad * grad_delta).reshape(-1) if need_delta else None,
                (grad * grad_variance).reshape(ctx.variance_shape) if need_variance else None, None, None)


def _derivatives(
    delta: Tensor, variance: Tensor | None, scale: float, spectrum: Spectrum,
    statistics: tuple[float, float, float] | Tensor,
) -> tuple[Tensor, Tensor | None]:
    """The derivatives of the module docstring in ``delta`` ``(G,)`` and ``variance`` (flat), written with
    differentiable operations of both (for a second derivative); ``scale``: :math:`s_0` where the variance came as
    a number or ``None``."""
    u = spectrum.eigenvalues
    scales = (variance.reshape(-1).reciprocal() if variance is not None
              else torch.full((1,), scale, dtype=u.dtype, device=u.device))
    first = scales[0]
    d = delta if spectrum.groups is None else delta.index_select(0, spectrum.groups)
    z = u * first.pow(spectrum.power) / d
    share = z / (1 + z)
    per_group = (share.sum().reshape(1) if spectrum.groups is None
                 else share.new_zeros(spectrum.num_groups).index_add(0, spectrum.groups, share))
    grad_delta = 0.5 * (per_group / delta - spectrum.theta_sq_norms)
    if variance is None:
        return grad_delta, None
    _, beta, gamma = statistics
    grad_variance = -(beta * scales + gamma * scales.square())
    own = torch.zeros_like(grad_variance)
    own[0] = 1.0
    return grad_delta, grad_variance + own * (0.5 * spectrum.power) * first * share.sum()


def spectral_evidence(
    delta: Tensor,
    variance: Tensor | float | None,
    spectrum: Spectrum,
    statistics: Tensor | Sequence[float],
) -> Tensor:
    r"""The log marginal likelihood of the module docstring, shape ``()``, differentiable in ``delta`` and
    ``variance`` (to second order).

    Args:
        delta: :math:`\delta > 0`, ``(G,)``, of the dtype of :math:`u` (validated by the caller; with one group
            its one value is checked here: ``ValueError`` naming ``prior_precision``).
        variance: :math:`v = 1/s > 0` as the likelihood holds it: ``(K,)`` noises (only the first scales the
            curvature), one element (a noise :math:`\sigma^2` or the temperature :math:`T`), a number, or ``None``
            for :math:`s = 1`.
        spectrum: :math:`u \ge 0`, the groups, :math:`q` (1: GGN, 2: empirical Fisher) and
            :math:`\|\theta^*_g\|^2` (:class:`Spectrum`).
        statistics: :math:`(\alpha, \beta, \gamma)`: ``(3, K)``, or three numbers for ``K = 1``.

    Raises:
        ValueError: with one group, a prior precision that is not positive and finite.
    """
    return _SpectralEvidence.apply(delta, variance, spectrum, _numbers(statistics))
