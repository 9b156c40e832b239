"""LogisticLikelihood: temperature hyperparameter, conditional, probit and Monte Carlo predictive."""

from __future__ import annotations

import math

import gpytorch
import numpy as np
import pytest
import torch
from gpytorch.constraints import Positive
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from torch.distributions import Bernoulli

from ntkgp.likelihoods import LogisticLikelihood, likelihood_temperature, sigmoid_monte_carlo, sigmoid_probit


def _exact_expected_sigmoid(mean: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    """E[sigmoid(f)], f ~ N(mean, variance), by 200-node Gauss-Hermite quadrature."""
    nodes, weights = np.polynomial.hermite.hermgauss(200)
    nodes, weights = torch.from_numpy(nodes), torch.from_numpy(weights)
    f = mean.unsqueeze(-1) + math.sqrt(2.0) * variance.sqrt().unsqueeze(-1) * nodes
    return (torch.sigmoid(f) * weights).sum(-1) / math.sqrt(math.pi)


def _mvn(mean: torch.Tensor, variance: torch.Tensor) -> MultivariateNormal:
    return MultivariateNormal(mean, torch.diag(variance))


def test_is_a_gpytorch_likelihood_with_a_positive_temperature():
    likelihood = LogisticLikelihood()
    assert isinstance(likelihood, gpytorch.likelihoods.Likelihood)
    assert isinstance(likelihood.raw_temperature_constraint, Positive)
    assert likelihood.temperature.item() == pytest.approx(1.0)
    assert likelihood.raw_temperature.requires_grad is False
    assert likelihood_temperature(likelihood) is not None
    assert likelihood_temperature(gpytorch.likelihoods.GaussianLikelihood()) is None


def test_temperature_setter_and_learnable_flag():
    likelihood = LogisticLikelihood(temperature=0.5, learn_temperature=True)
    assert likelihood.temperature.item() == pytest.approx(0.5)
    assert likelihood.raw_temperature.requires_grad is True
    assert "raw_temperature" in dict(likelihood.named_hyperparameters())
    likelihood.temperature = 3.0
    assert likelihood.temperature.item() == pytest.approx(3.0)
    likelihood.temperature.backward()
    assert likelihood.raw_temperature.grad is not None
    with pytest.raises(ValueError, match="temperature must be positive"):
        likelihood.temperature = -1.0


def test_conditional_is_bernoulli_with_logits():
    likelihood = LogisticLikelihood(temperature=2.0)
    f = torch.randn(6, 1, dtype=torch.float64)
    y = torch.randint(0, 2, (6, 1)).double()
    conditional = likelihood(f)
    assert isinstance(conditional, Bernoulli)
    expected = -torch.nn.functional.binary_cross_entropy_with_logits(f, y, reduction="none")
    torch.testing.assert_close(conditional.log_prob(y), expected)


def test_probit_marginal_matches_the_formula():
    mean = torch.tensor([-2.0, 0.0, 0.5, 3.0], dtype=torch.float64)
    variance = torch.tensor([0.1, 4.0, 1.0, 10.0], dtype=torch.float64)
    expected = torch.sigmoid(mean / torch.sqrt(1 + math.pi / 8 * variance))
    predictive = LogisticLikelihood()(_mvn(mean, variance))
    assert isinstance(predictive, Bernoulli)
    torch.testing.assert_close(predictive.probs, expected)
    multitask = MultitaskMultivariateNormal(mean.unsqueeze(-1), torch.diag(variance))
    torch.testing.assert_close(LogisticLikelihood().marginal(multitask).probs, expected.unsqueeze(-1))
    torch.testing.assert_close(sigmoid_probit(mean, variance), expected)
    # the probit approximation is within 0.02 of the exact expectation
    torch.testing.assert_close(expected, _exact_expected_sigmoid(mean, variance), atol=0.02, rtol=0)


def test_predictive_ignores_the_temperature():
    dist = _mvn(torch.tensor([0.3, -1.0]), torch.tensor([0.5, 2.0]))
    torch.testing.assert_close(
        LogisticLikelihood(temperature=5.0)(dist).probs, LogisticLikelihood()(dist).probs
    )


def test_monte_carlo_matches_probit_for_small_variance_and_exact_for_large():
    generator = torch.Generator().manual_seed(0)
    mean = torch.tensor([-1.5, 0.0, 0.7, 2.0], dtype=torch.float64)
    small = torch.full_like(mean, 1e-3)
    likelihood = LogisticLikelihood(link_approx="mc", num_samples=20000)
    monte_carlo = likelihood(_mvn(mean, small), generator=generator).probs
    torch.testing.assert_close(monte_carlo, sigmoid_probit(mean, small), atol=2e-3, rtol=0)
    large = torch.tensor([1.0, 4.0, 9.0, 2.0], dtype=torch.float64)
    monte_carlo = likelihood.marginal(_mvn(mean, large), generator=generator).probs
    torch.testing.assert_close(monte_carlo, _exact_expected_sigmoid(mean, large), atol=1e-2, rtol=0)


def test_link_approx_and_num_samples_can_be_set_per_call():
    dist = _mvn(torch.zeros(3), torch.ones(3))
    likelihood = LogisticLikelihood()
    first = likelihood(dist, link_approx="mc", num_samples=7, generator=torch.Generator().manual_seed(1))
    second = sigmoid_monte_carlo(dist.mean, dist.variance, 7, torch.Generator().manual_seed(1))
    torch.testing.assert_close(first.probs, second)
    with pytest.raises(ValueError, match="link_approx"):
        likelihood(dist, link_approx="laplace_bridge")
    with pytest.raises(ValueError, match="link_approx"):
        LogisticLikelihood(link_approx="bridge")
    with pytest.raises(ValueError, match="num_samples"):
        LogisticLikelihood(num_samples=0)


def test_log_marginal_is_the_log_of_the_predictive():
    mean, variance = torch.tensor([-1.0, 0.5]), torch.tensor([2.0, 0.3])
    y = torch.tensor([0, 1])
    probs = sigmoid_probit(mean, variance)
    expected = torch.log(torch.where(y == 1, probs, 1 - probs))
    torch.testing.assert_close(LogisticLikelihood().log_marginal(y, _mvn(mean, variance)), expected)


def test_float32_predictive():
    predictive = LogisticLikelihood()(_mvn(torch.zeros(3), torch.ones(3)))
    assert predictive.probs.dtype == torch.float32
