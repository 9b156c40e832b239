"""Binary classification with a logistic (sigmoid) link: the likelihood of ``BCEWithLogitsLoss``."""

from __future__ import annotations

from typing import Any

import torch
from gpytorch.constraints import Interval
from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood
from gpytorch.priors import Prior
from torch import Tensor
from torch.distributions import Bernoulli

from .link_approximation import LinkApproximation, sigmoid_monte_carlo, sigmoid_probit
from .temperature import TemperatureMixin


class LogisticLikelihood(LinkApproximation, TemperatureMixin, _OneDimensionalLikelihood):
    r"""Bernoulli likelihood with the logistic link, for a network with one logit output.

    .. math::
        p(y \mid f) = \operatorname{sigmoid}(f)^y \, \operatorname{sigmoid}(-f)^{1 - y}, \quad y \in \{0, 1\},

    so that :math:`-\log p` is ``BCEWithLogitsLoss``. With temperature :math:`T` the Laplace quantities
    (:func:`~ntkgp.likelihoods.log_likelihood`, ``gradient``, ``hessian``) are those of the tempered
    likelihood :math:`p(y \mid f)^{1/T}`: :math:`g = (y - p)/T`, :math:`\Lambda = p (1 - p)/T`,
    :math:`p = \operatorname{sigmoid}(f)`.

    Calling it on a tensor of logits gives the conditional ``Bernoulli(logits=f)``; calling it on a
    :class:`~gpytorch.distributions.MultivariateNormal` over the logits gives the predictive ``Bernoulli``
    by the probit approximation :math:`\operatorname{sigmoid}(\mu / \sqrt{1 + \frac{\pi}{8}\sigma^2})`
    (``link_approx="probit"``) or by Monte Carlo (``link_approx="mc"``, ``num_samples`` draws). Both use
    the untempered link. ``expected_log_prob`` (variational inference) uses Gauss-Hermite quadrature.

    Args:
        temperature: :math:`T > 0` (default 1), a real number (any ``numbers.Real``; not ``bool``) or a
            one-element tensor.
        learn_temperature: whether ``raw_temperature`` requires grad (default ``False``: with :math:`\theta^*`
            fixed the Laplace evidence of a tempered likelihood is non-decreasing in :math:`T`, so :math:`T`
            cannot be learned from it; tune it on validation data instead; ``docs/math.md``, "Temperature").
        temperature_prior: optional prior on :math:`T`.
        temperature_constraint: constraint on :math:`T` (default ``Positive()``).
        link_approx: ``"probit"`` or ``"mc"``, the default approximation of the predictive.
        num_samples: default number of Monte Carlo samples for ``link_approx="mc"``.

    Attributes:
        temperature (torch.Tensor): :math:`T`, shape ``()``.
        link_approx, num_samples, learn_temperature: as given; each may be assigned later, validated as here,
            and the likelihood is then the one built with that value.

    Raises:
        ValueError: for a non-positive ``temperature``, an unknown ``link_approx`` or an invalid
            ``num_samples``.

    Example:
        >>> from gpytorch.distributions import MultivariateNormal
        >>> likelihood = LogisticLikelihood()
        >>> likelihood(MultivariateNormal(torch.zeros(2), torch.eye(2))).probs
        tensor([0.5000, 0.5000])
    """

    def __init__(
        self,
        temperature: float = 1.0,
        learn_temperature: bool = False,
        temperature_prior: Prior | None = None,
        temperature_constraint: Interval | None = None,
        link_approx: str = "probit",
        num_samples: int = 100,
    ) -> None:
        super().__init__()
        self._register_temperature(temperature, learn_temperature, temperature_prior, temperature_constraint)
        self.link_approx = link_approx
        self.num_samples = num_samples

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> Bernoulli:
        """The conditional :math:`p(y \\mid f)`.

        Args:
            function_samples: logits ``f`` of any shape.

        Returns:
            ``Bernoulli(logits=f)``.
        """
        return Bernoulli(logits=function_samples)

    def _check_logits(self, function_dist: MultivariateNormal) -> None:
        """Any distribution over the logits with a mean and marginal variances."""

    def _probit(self, function_dist: MultivariateNormal) -> Tensor:
        return sigmoid_probit(function_dist.mean, function_dist.variance)

    def _monte_carlo(
        self, function_dist: MultivariateNormal, num_samples: int, generator: torch.Generator | None
    ) -> Tensor:
        return sigmoid_monte_carlo(function_dist.mean, function_dist.variance, num_samples, generator)

    def _predictive(self, probs: Tensor) -> Bernoulli:
        return Bernoulli(probs=probs)

    def _labels(self, observations: Tensor, predictive: Bernoulli) -> Tensor:
        return observations.to(predictive.probs.dtype)
