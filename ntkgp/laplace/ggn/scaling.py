r"""How the likelihood's hyperparameters scale :math:`\Lambda_n` and :math:`g_n`: the output scale :math:`s`.

For every supported likelihood the Laplace terms factor as

.. math::
    \Lambda_n = S^{1/2} \tilde\Lambda_n S^{1/2}, \qquad g_n = S \tilde g_n, \qquad S = \operatorname{diag}(s),

where :math:`\tilde\Lambda_n, \tilde g_n` do not depend on the hyperparameters (at fixed :math:`f_n`):

- Gaussian, noise :math:`\sigma_c^2` per output: :math:`s_c = 1/\sigma_c^2`, :math:`\tilde\Lambda_n = I`,
  :math:`\tilde g_n = y_n - f_n`; :math:`s` has shape ``(C,)``;
- tempered classification (logistic, softmax), temperature :math:`T`: :math:`s = 1/T` (``1`` without a
  temperature); :math:`s` has shape ``(1,)`` and acts on every output.

A curvature computed once therefore follows any new noise or temperature through :math:`s` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gpytorch.likelihoods import Likelihood, SoftmaxLikelihood
from torch import Tensor

from ...likelihoods import (
    gradient,
    hessian_sqrt,
    is_gaussian,
    likelihood_temperature,
    log_likelihood,
    noise_variance,
    num_outputs,
)
from ...likelihoods.temperature import TemperatureMixin


def scale_size(likelihood: Likelihood) -> int:
    """The number of curvature components :math:`K` (the length of :func:`output_scale`): ``C`` for Gaussian
    likelihoods, else 1."""
    return num_outputs(likelihood) if is_gaussian(likelihood) else 1


def output_variance(likelihood: Likelihood) -> Tensor | None:
    r"""The reciprocal :math:`v = 1/s` of the output scale as the likelihood holds it: ``(C,)`` the noise variances
    :math:`\sigma_c^2` of a Gaussian likelihood, ``()`` the temperature :math:`T` of a tempered one, ``None``
    without either (:math:`s = 1`). Differentiable w.r.t. the noise and the temperature."""
    return variance_reader(likelihood, numbers=False)(likelihood)


def variance_reader(likelihood: Likelihood, numbers: bool = True) -> Callable[[Likelihood], Tensor | float | None]:
    """The function that reads :func:`output_variance` from a likelihood of this one's type, found once: a caller
    that evaluates often (a hyperparameter step) keeps it instead of dispatching on the type at every call. With
    ``numbers``, a temperature that is not learned comes as a number
    (:meth:`~ntkgp.likelihoods.temperature.TemperatureMixin.fixed_temperature`).

    Raises:
        NotImplementedError: for an unsupported likelihood or configuration (:func:`~ntkgp.likelihoods.num_outputs`).
    """
    num_outputs(likelihood)  # raises for an unsupported likelihood
    cls = type(likelihood)
    if is_gaussian(likelihood):
        return noise_variance.dispatch(cls)
    if numbers and isinstance(likelihood, TemperatureMixin):
        return _temperature_or_number
    return likelihood_temperature.dispatch(cls)


def _temperature_or_number(likelihood: TemperatureMixin) -> Tensor | float:
    fixed = likelihood.fixed_temperature()
    return likelihood.temperature if fixed is None else fixed


def output_scale(likelihood: Likelihood) -> Tensor:
    r"""The output scale :math:`s` of ``likelihood``: ``(C,)`` :math:`1/\sigma_c^2` for Gaussian likelihoods,
    ``(1,)`` :math:`1/T` otherwise. Differentiable w.r.t. the noise and the temperature."""
    variance = output_variance(likelihood)
    if variance is None:
        return torch.ones(1)
    return variance.reciprocal().reshape(-1)


def data_fit_statistics(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    r"""Statistics ``(3, K)`` of :math:`f_n, y_n` from which the data term follows for any output scale:

    .. math::
        \sum_n \log p(y_n \mid f_n) = \sum_k \alpha_k + \beta_k \log s_k + \gamma_k s_k

    (:func:`data_fit`). Gaussian, :math:`s_c = 1/\sigma_c^2`: :math:`\alpha_c = -\tfrac N2 \log 2\pi`,
    :math:`\beta_c = \tfrac N2`, :math:`\gamma_c = -\tfrac12 \sum_n (y_{nc} - f_{nc})^2`; tempered,
    :math:`s = 1/T`: :math:`\alpha = \beta = 0`, :math:`\gamma = \sum_n \log p(y_n \mid f_n)` at
    :math:`T = 1`.
    Computed once without a graph, :math:`O(NC)`; :func:`data_fit` then costs :math:`O(K)`."""
    with torch.no_grad():
        if is_gaussian(likelihood):
            n = float(f.shape[0])
            gamma = -0.5 * (y.to(f).reshape(f.shape) - f).square().sum(dim=0)
            return torch.stack([torch.full_like(gamma, -0.5 * n * math.log(2 * math.pi)),
                                torch.full_like(gamma, 0.5 * n), gamma])
        s0 = output_scale(likelihood).to(f)
        gamma = (log_likelihood(likelihood, f, y).sum() / s0).reshape(1)
        return torch.stack([torch.zeros_like(gamma), torch.zeros_like(gamma), gamma])


def data_fit(statistics: Tensor, scale: Tensor) -> Tensor:
    r""":math:`\sum_n \log p(y_n \mid f_n)` at the output scale :math:`s` (``(K,)``) from
    :func:`data_fit_statistics`, shape ``()``, differentiable in :math:`s`."""
    alpha, beta, gamma = statistics
    return (alpha + beta * scale.log() + gamma * scale).sum()


def unit_hessian_sqrt(likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor) -> Tensor:
    r""":math:`\tilde L_n = S_0^{-1/2} L_n` with :math:`L_n L_n^\top = \Lambda_n` at the output scale
    :math:`s_0` (``scale0``, detached), shape ``(n, C, C)``, without a graph: :math:`I` for a Gaussian
    likelihood, :math:`L_n \sqrt{T_0}` for a tempered one."""
    with torch.no_grad():
        return hessian_sqrt(likelihood, f, y) * scale0.rsqrt()[:, None]


def unit_root_columns(likelihood: Likelihood, num_outputs: int) -> int:
    """The columns ``M`` of :func:`unit_hessian_root` for ``num_outputs`` outputs: ``C - 1`` for a softmax
    likelihood, else ``C``; the function-space GGN of ``N`` points is ``N·M`` square."""
    return num_outputs - 1 if isinstance(likelihood, SoftmaxLikelihood) and num_outputs >= 2 else num_outputs


def unit_hessian_root(likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor) -> Tensor:
    r"""A root :math:`R_n` of :math:`\tilde\Lambda_n = S_0^{-1/2} \Lambda_n S_0^{-1/2}` with the fewest columns the
    likelihood allows, shape ``(n, C, M)``, without a graph: for a softmax likelihood :math:`M = C - 1`, else
    :func:`unit_hessian_sqrt` (``M = C``).

    :math:`\Lambda = (\operatorname{diag}(p) - p p^\top)/T` has rank :math:`C - 1`, and its root
    :math:`L` (:func:`unit_hessian_sqrt`) annihilates the unit vector :math:`\sqrt p`. With the Householder
    reflection :math:`H = I - \beta v v^\top`, :math:`v = \sqrt p + e_k`, :math:`\beta = 2/\|v\|^2 = 1/(1 +
    \sqrt{p_k})` (:math:`\|v\|^2 = 2 + 2\sqrt{p_k} \ge 2`: no cancellation), :math:`H e_k = -\sqrt p`, so
    column :math:`k` of :math:`L H` is zero and the others are the root,
    :math:`R = L H \setminus k = L_{:, \ne k} - \beta\, L_{:, k} \sqrt{p}_{\ne k}^\top` (using
    :math:`L v = L e_k`), :math:`R R^\top = L H H^\top L^\top = \Lambda`; here :math:`k = C - 1`. Whatever is
    formed from :math:`R R^\top` alone (a GGN, :math:`\log|I + R^\top K R| = \log|I + K \Lambda|`) is the same
    for every root, with :math:`(C - 1)/C` of the rows."""
    with torch.no_grad():
        return fewest_columns(likelihood, f, unit_hessian_sqrt(likelihood, f, y, scale0))


def fewest_columns(likelihood: Likelihood, f: Tensor, root: Tensor) -> Tensor:
    r"""A root ``(n, C, C)`` of :math:`\Lambda_n` (:func:`~ntkgp.likelihoods.hessian_sqrt`, any scale) as one with
    the fewest columns (:func:`unit_hessian_root`: ``C - 1`` for a softmax likelihood, else ``root`` itself);
    differentiable in ``root`` and ``f`` (the temperature and the outputs keep their graph)."""
    if unit_root_columns(likelihood, root.shape[-1]) == root.shape[-1]:
        return root
    sqrt_p = torch.exp(0.5 * torch.log_softmax(f.to(root.dtype), dim=-1))  # (n, C)
    beta = 1 / (1 + sqrt_p[:, -1])
    return root[..., :-1] - (beta[:, None, None] * root[..., -1:]) * sqrt_p[:, None, :-1]


def unit_gradient(likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor) -> Tensor:
    r""":math:`\tilde g_n = S_0^{-1} g_n` at the output scale :math:`s_0`, shape ``(n, C)``, without a graph
    (Gaussian: :math:`y_n - f_n`)."""
    with torch.no_grad():
        return gradient(likelihood, f, y) / scale0
