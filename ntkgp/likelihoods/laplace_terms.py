r"""The likelihood terms of the Laplace-GGN approximation at the outputs :math:`f_n = f(x_n; \theta^*)`
(``docs/math.md``, "Likelihoods").

For each data point :math:`n` (``f`` of shape ``(N, C)``, rows flattened as :math:`nC + c`, GPyTorch's
interleaved order):

- :func:`log_likelihood`: :math:`\log p(y_n \mid f_n)`, shape ``(N,)``;
- :func:`gradient`: :math:`g_n = \nabla_f \log p(y_n \mid f_n)`, shape ``(N, C)``;
- :func:`hessian`: :math:`\Lambda_n = -\nabla_f^2 \log p(y_n \mid f_n)`, PSD, shape ``(N, C, C)``;
- :func:`hessian_sqrt`: a factor :math:`L_n` with :math:`L_n L_n^\top = \Lambda_n`, shape ``(N, C, C)``.

- Gaussian, noise :math:`\sigma_c^2` per output: :math:`g = (y - f)/\sigma^2`,
  :math:`\Lambda = \operatorname{diag}(1/\sigma^2)`;
- logistic, :math:`p = \operatorname{sigmoid}(f)`: :math:`g = (y - p)/T`, :math:`\Lambda = p(1 - p)/T`;
- softmax, :math:`p = \operatorname{softmax}(f)`: :math:`g = (\operatorname{onehot}(y) - p)/T`,
  :math:`\Lambda = (\operatorname{diag}(p) - p p^\top)/T`.

The closed forms never invert :math:`\Lambda` (singular for the softmax). All functions dispatch on the
likelihood's type, check ``y`` with :func:`~ntkgp.likelihoods.validate_targets`, return tensors of ``f``'s
dtype, and are differentiable w.r.t. the likelihood's hyperparameters (noise, temperature). ``f`` is used as
given (not detached): pass ``f.detach()`` to keep the network's graph out. Leading batch dimensions of ``f``
(``(..., N, C)``) are allowed.
"""

from __future__ import annotations

import math
from functools import singledispatch

import torch
from gpytorch.likelihoods import (
    GaussianLikelihood,
    Likelihood,
    MultitaskGaussianLikelihood,
    SoftmaxLikelihood,
)
from torch import Tensor
from torch.nn.functional import logsigmoid, one_hot

from .logistic_likelihood import LogisticLikelihood
from .properties import noise_variance, num_outputs, unsupported_likelihood
from .targets import validate_targets
from .temperature import likelihood_temperature


def _targets(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    """Check ``f`` has shape ``(..., N, C)`` and return ``y`` validated against it."""
    expected = num_outputs(likelihood)
    if f.dim() < 2 or f.shape[-1] != expected:
        raise ValueError(
            f"f must have shape (N, {expected}) for {type(likelihood).__name__}, got shape {tuple(f.shape)}"
        )
    return validate_targets(likelihood, y, expected, num_data=f.shape[-2])


def _tempered(likelihood: Likelihood, value: Tensor, power: float = 1.0) -> Tensor:
    r""":math:`\mathrm{value} / T^{\mathrm{power}}`, or ``value`` for a likelihood without temperature."""
    temperature = likelihood_temperature(likelihood)
    if temperature is None:
        return value
    return value / temperature.to(value).pow(power)


@singledispatch
def log_likelihood(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    r""":math:`\log p(y_n \mid f_n)` per data point (tempered: :math:`\frac1T \log p`).

    Gaussian: :math:`-\frac12 \sum_c [\log(2\pi\sigma_c^2) + (y_{nc} - f_{nc})^2/\sigma_c^2]`; logistic
    and softmax as in ``docs/math.md``, "Likelihoods" (computed with ``logsigmoid`` / ``log_softmax``).

    Args:
        likelihood: a supported likelihood.
        f: network outputs at :math:`\theta^*`, shape ``(..., N, C)``.
        y: targets, in any form :func:`~ntkgp.likelihoods.validate_targets` accepts.

    Returns:
        Shape ``(..., N)``, ``f``'s dtype.

    Raises:
        ValueError: if ``f`` does not have ``C`` columns, or ``y`` is invalid (see ``validate_targets``).
        NotImplementedError: for an unsupported likelihood.

    Example:
        >>> from gpytorch.likelihoods import GaussianLikelihood
        >>> lik = GaussianLikelihood()
        >>> lik.noise = 1.0
        >>> log_likelihood(lik, torch.zeros(2, 1), torch.zeros(2)).detach()  # -log(2π)/2 each
        tensor([-0.9189, -0.9189])
    """
    raise unsupported_likelihood(likelihood)


@singledispatch
def gradient(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    r""":math:`g_n = \nabla_f \log p(y_n \mid f_n)`.

    Args:
        likelihood: a supported likelihood.
        f: network outputs at :math:`\theta^*`, shape ``(..., N, C)``.
        y: targets, in any form :func:`~ntkgp.likelihoods.validate_targets` accepts.

    Returns:
        Shape ``(..., N, C)``: :math:`(y - f)/\sigma^2`, :math:`(y - p)/T` or
        :math:`(\operatorname{onehot}(y) - p)/T`.

    Raises:
        ValueError: as :func:`log_likelihood`.
        NotImplementedError: for an unsupported likelihood.

    Example:
        >>> from ntkgp.likelihoods import LogisticLikelihood
        >>> gradient(LogisticLikelihood(), torch.zeros(2, 1), torch.tensor([0.0, 1.0]))
        tensor([[-0.5000],
                [ 0.5000]])
    """
    raise unsupported_likelihood(likelihood)


@singledispatch
def hessian(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    r""":math:`\Lambda_n = -\nabla_f^2 \log p(y_n \mid f_n)`, positive semi-definite.

    Args:
        likelihood: a supported likelihood.
        f: network outputs at :math:`\theta^*`, shape ``(..., N, C)``.
        y: targets, in any form :func:`~ntkgp.likelihoods.validate_targets` accepts (checked, not used:
            the Hessian of these likelihoods does not depend on ``y``).

    Returns:
        Shape ``(..., N, C, C)``: :math:`\operatorname{diag}(1/\sigma^2)`, :math:`p(1 - p)/T` or
        :math:`(\operatorname{diag}(p) - p p^\top)/T`.

    Raises:
        ValueError: as :func:`log_likelihood`.
        NotImplementedError: for an unsupported likelihood.

    Example:
        >>> from ntkgp.likelihoods import SoftmaxLikelihood
        >>> hessian(SoftmaxLikelihood(2), torch.zeros(1, 2), torch.tensor([1]))
        tensor([[[ 0.2500, -0.2500],
                 [-0.2500,  0.2500]]])
    """
    raise unsupported_likelihood(likelihood)


@singledispatch
def hessian_sqrt(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    r"""A factor :math:`L_n` with :math:`L_n L_n^\top = \Lambda_n`, shape ``(N, C, C)``, in closed form.

    Gaussian and logistic: the diagonal (symmetric) :math:`\Lambda_n^{1/2}`. Softmax:
    :math:`L = (\operatorname{diag}(\sqrt p) - p \sqrt p^\top)/\sqrt T`, which is **not symmetric**;
    :math:`L L^\top = \operatorname{diag}(p) - 2 p p^\top + p (\textstyle\sum_c p_c) p^\top = \Lambda` since
    :math:`\sum_c p_c = 1`. Use it as :math:`L^\top K L` (a ``RootLinearOperator(L)`` is :math:`\Lambda`):
    :math:`\log|I + L^\top K L| = \log|I + \Lambda^{1/2} K \Lambda^{1/2}|` and :math:`L (I + L^\top K L)^{-1}
    L^\top = \Lambda^{1/2} (I + \Lambda^{1/2} K \Lambda^{1/2})^{-1} \Lambda^{1/2}` (``docs/math.md``,
    "Likelihoods").

    Args:
        likelihood: a supported likelihood.
        f: network outputs at :math:`\theta^*`, shape ``(..., N, C)``.
        y: targets, in any form :func:`~ntkgp.likelihoods.validate_targets` accepts.

    Returns:
        Shape ``(..., N, C, C)``, with ``L @ L.mT`` equal to :func:`hessian`.

    Raises:
        ValueError: as :func:`log_likelihood`.
        NotImplementedError: for an unsupported likelihood.

    Example:
        >>> from ntkgp.likelihoods import SoftmaxLikelihood
        >>> lik, f, y = SoftmaxLikelihood(3), torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
        >>> root = hessian_sqrt(lik, f, y)
        >>> torch.allclose(root @ root.mT, hessian(lik, f, y))
        True
    """
    raise unsupported_likelihood(likelihood)


# Gaussian: GaussianLikelihood (C = 1) and MultitaskGaussianLikelihood(rank=0), noise sigma_c^2 per output.


def _gaussian_inputs(likelihood: Likelihood, f: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Targets ``(N, C)`` and noise variances ``(C,)``, both in ``f``'s dtype and device."""
    return _targets(likelihood, f, y).to(f), noise_variance(likelihood).to(f)


@log_likelihood.register(GaussianLikelihood)
@log_likelihood.register(MultitaskGaussianLikelihood)
def _(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    y, variance = _gaussian_inputs(likelihood, f, y)
    return -0.5 * (torch.log(2.0 * math.pi * variance) + (y - f).square() / variance).sum(dim=-1)


@gradient.register(GaussianLikelihood)
@gradient.register(MultitaskGaussianLikelihood)
def _(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    y, variance = _gaussian_inputs(likelihood, f, y)
    return (y - f) / variance


@hessian.register(GaussianLikelihood)
@hessian.register(MultitaskGaussianLikelihood)
def _(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    _, variance = _gaussian_inputs(likelihood, f, y)
    return torch.diag_embed(variance.reciprocal().expand(f.shape))


@hessian_sqrt.register(GaussianLikelihood)
@hessian_sqrt.register(MultitaskGaussianLikelihood)
def _(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    _, variance = _gaussian_inputs(likelihood, f, y)
    return torch.diag_embed(variance.rsqrt().expand(f.shape))


# Logistic: f of shape (N, 1), p = sigmoid(f).


@log_likelihood.register
def _(likelihood: LogisticLikelihood, f: Tensor, y: Tensor) -> Tensor:
    y = _targets(likelihood, f, y).to(f)
    log_p = y * logsigmoid(f) + (1.0 - y) * logsigmoid(-f)
    return _tempered(likelihood, log_p.squeeze(-1))


@gradient.register
def _(likelihood: LogisticLikelihood, f: Tensor, y: Tensor) -> Tensor:
    y = _targets(likelihood, f, y).to(f)
    return _tempered(likelihood, y - torch.sigmoid(f))


@hessian.register
def _(likelihood: LogisticLikelihood, f: Tensor, y: Tensor) -> Tensor:
    _targets(likelihood, f, y)
    return _tempered(likelihood, (torch.sigmoid(f) * torch.sigmoid(-f)).unsqueeze(-1))


@hessian_sqrt.register
def _(likelihood: LogisticLikelihood, f: Tensor, y: Tensor) -> Tensor:
    _targets(likelihood, f, y)
    root = torch.exp(0.5 * (logsigmoid(f) + logsigmoid(-f)))
    return _tempered(likelihood, root.unsqueeze(-1), power=0.5)


# Softmax (ntkgp SoftmaxLikelihood, or gpytorch's without mixing weights, T = 1): p = softmax(f).


@log_likelihood.register
def _(likelihood: SoftmaxLikelihood, f: Tensor, y: Tensor) -> Tensor:
    y = _targets(likelihood, f, y)
    log_p = torch.log_softmax(f, dim=-1)
    return _tempered(likelihood, (one_hot(y, f.shape[-1]).to(f) * log_p).sum(dim=-1))


@gradient.register
def _(likelihood: SoftmaxLikelihood, f: Tensor, y: Tensor) -> Tensor:
    y = _targets(likelihood, f, y)
    return _tempered(likelihood, one_hot(y, f.shape[-1]).to(f) - torch.softmax(f, dim=-1))


@hessian.register
def _(likelihood: SoftmaxLikelihood, f: Tensor, y: Tensor) -> Tensor:
    _targets(likelihood, f, y)
    p = torch.softmax(f, dim=-1)
    return _tempered(likelihood, torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2))


@hessian_sqrt.register
def _(likelihood: SoftmaxLikelihood, f: Tensor, y: Tensor) -> Tensor:
    _targets(likelihood, f, y)
    log_p = torch.log_softmax(f, dim=-1)
    p, sqrt_p = log_p.exp(), torch.exp(0.5 * log_p)
    return _tempered(likelihood, torch.diag_embed(sqrt_p) - p.unsqueeze(-1) * sqrt_p.unsqueeze(-2), power=0.5)
