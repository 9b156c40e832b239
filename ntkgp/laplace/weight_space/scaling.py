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

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from ...likelihoods import gradient, hessian_sqrt, is_gaussian, likelihood_temperature, noise_variance, num_outputs


def output_scale(likelihood: Likelihood) -> Tensor:
    r"""The output scale :math:`s` of ``likelihood``: ``(C,)`` :math:`1/\sigma_c^2` for Gaussian likelihoods,
    ``(1,)`` :math:`1/T` otherwise. Differentiable w.r.t. the noise and the temperature."""
    num_outputs(likelihood)  # raises for an unsupported likelihood
    if is_gaussian(likelihood):
        return noise_variance(likelihood).reciprocal()
    temperature = likelihood_temperature(likelihood)
    if temperature is None:
        return torch.ones(1)
    return temperature.reciprocal().reshape(1)


def unit_hessian_sqrt(likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor) -> Tensor:
    r""":math:`\tilde L_n = S_0^{-1/2} L_n` with :math:`L_n L_n^\top = \Lambda_n` at the output scale
    :math:`s_0` (``scale0``, detached), shape ``(n, C, C)``, without a graph: :math:`I` for a Gaussian
    likelihood, :math:`L_n \sqrt{T_0}` for a tempered one."""
    with torch.no_grad():
        return hessian_sqrt(likelihood, f, y) * scale0.rsqrt()[:, None]


def unit_gradient(likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor) -> Tensor:
    r""":math:`\tilde g_n = S_0^{-1} g_n` at the output scale :math:`s_0`, shape ``(n, C)``, without a graph
    (Gaussian: :math:`y_n - f_n`)."""
    with torch.no_grad():
        return gradient(likelihood, f, y) / scale0
