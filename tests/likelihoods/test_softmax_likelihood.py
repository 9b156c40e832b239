"""SoftmaxLikelihood: conditional, probit and Monte Carlo predictive, per-point covariance blocks."""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from linear_operator.operators import DenseLinearOperator
from torch.distributions import Categorical

from ntkgp.likelihoods import SoftmaxLikelihood, output_covariance_blocks, softmax_probit

N, C = 5, 3


def _random_mtmvn(scale: float, interleaved: bool = True, seed: int = 0) -> MultitaskMultivariateNormal:
    generator = torch.Generator().manual_seed(seed)
    mean = torch.randn(N, C, generator=generator, dtype=torch.float64)
    a = torch.randn(N * C, 2 * N * C, generator=generator, dtype=torch.float64)
    covariance = scale * a @ a.mT / a.shape[1]
    return MultitaskMultivariateNormal(mean, covariance, interleaved=interleaved)


def _row(n: int, c: int, interleaved: bool) -> int:
    return n * C + c if interleaved else c * N + n


def test_is_a_gpytorch_softmax_likelihood_without_mixing_weights():
    likelihood = SoftmaxLikelihood(C)
    assert isinstance(likelihood, gpytorch.likelihoods.SoftmaxLikelihood)
    assert likelihood.mixing_weights is None and likelihood.num_classes == C
    assert likelihood.temperature.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="num_classes"):
        SoftmaxLikelihood(1)


def test_conditional_is_categorical_with_logits_even_when_n_equals_c():
    likelihood = SoftmaxLikelihood(C)
    f = torch.randn(C, C, dtype=torch.float64)
    conditional = likelihood(f)
    assert isinstance(conditional, Categorical)
    torch.testing.assert_close(conditional.logits, torch.log_softmax(f, -1))
    y = torch.tensor([0, 2, 1])
    torch.testing.assert_close(
        conditional.log_prob(y), -torch.nn.functional.cross_entropy(f, y, reduction="none")
    )
    with pytest.raises(ValueError, match="3 classes"):
        likelihood(torch.randn(4, 2))


@pytest.mark.parametrize("interleaved", [True, False])
def test_output_covariance_blocks(interleaved):
    dist = _random_mtmvn(1.0, interleaved)
    dense = dist.covariance_matrix
    blocks = output_covariance_blocks(dist)
    assert blocks.shape == (N, C, C)
    for n in range(N):
        rows = [_row(n, c, interleaved) for c in range(C)]
        torch.testing.assert_close(blocks[n], dense[rows][:, rows])


@pytest.mark.parametrize("interleaved", [True, False])
def test_probit_marginal_matches_the_formula(interleaved):
    dist = _random_mtmvn(2.0, interleaved)
    variance = torch.stack(
        [dist.covariance_matrix.diagonal()[[_row(n, c, interleaved) for c in range(C)]] for n in range(N)]
    )
    expected = torch.softmax(dist.mean / torch.sqrt(1 + math.pi / 8 * variance), dim=-1)
    predictive = SoftmaxLikelihood(C)(dist)
    assert isinstance(predictive, Categorical)
    torch.testing.assert_close(predictive.probs, expected)
    torch.testing.assert_close(softmax_probit(dist.mean, variance), expected)


def test_predictive_ignores_the_temperature():
    dist = _random_mtmvn(1.0)
    torch.testing.assert_close(
        SoftmaxLikelihood(C, temperature=4.0)(dist).probs, SoftmaxLikelihood(C)(dist).probs
    )


def test_monte_carlo_matches_probit_for_small_variance():
    dist = _random_mtmvn(1e-4)
    likelihood = SoftmaxLikelihood(C, link_approx="mc", num_samples=20000)
    monte_carlo = likelihood(dist, generator=torch.Generator().manual_seed(0)).probs
    torch.testing.assert_close(monte_carlo, SoftmaxLikelihood(C)(dist).probs, atol=2e-3, rtol=0)
    torch.testing.assert_close(monte_carlo.sum(-1), torch.ones(N, dtype=torch.float64))


@pytest.mark.parametrize("interleaved", [True, False])
def test_monte_carlo_matches_sampling_the_joint_distribution(interleaved):
    """Per-point MC with the C×C blocks agrees with MC over the joint NC-dimensional Gaussian."""
    dist = _random_mtmvn(3.0, interleaved)
    torch.manual_seed(0)
    joint = torch.distributions.MultivariateNormal(
        dist.mean.reshape(-1) if interleaved else dist.mean.mT.reshape(-1), dist.covariance_matrix
    ).sample((40000,))
    samples = joint.reshape(-1, N, C) if interleaved else joint.reshape(-1, C, N).mT
    expected = torch.softmax(samples, -1).mean(0)
    monte_carlo = (
        SoftmaxLikelihood(C)
        .marginal(dist, link_approx="mc", num_samples=40000, generator=torch.Generator().manual_seed(1))
        .probs
    )
    torch.testing.assert_close(monte_carlo, expected, atol=1e-2, rtol=0)


def test_monte_carlo_with_singular_blocks():
    mean = torch.randn(N, C, dtype=torch.float64)
    dist = MultitaskMultivariateNormal(
        mean, DenseLinearOperator(torch.zeros(N * C, N * C, dtype=torch.float64))
    )
    monte_carlo = SoftmaxLikelihood(C)(dist, link_approx="mc", num_samples=10).probs
    torch.testing.assert_close(monte_carlo, torch.softmax(mean, -1), atol=1e-4, rtol=0)


def test_log_marginal_is_the_log_of_the_predictive():
    dist = _random_mtmvn(1.0)
    y = torch.tensor([0, 1, 2, 1, 0])
    probs = SoftmaxLikelihood(C)(dist).probs
    torch.testing.assert_close(SoftmaxLikelihood(C).log_marginal(y, dist), probs[torch.arange(N), y].log())


def test_marginal_input_checks():
    likelihood = SoftmaxLikelihood(C)
    with pytest.raises(TypeError, match="MultitaskMultivariateNormal"):
        likelihood.marginal(MultivariateNormal(torch.zeros(N), torch.eye(N)))
    with pytest.raises(ValueError, match="3 logits"):
        likelihood(MultitaskMultivariateNormal(torch.zeros(N, 2), torch.eye(2 * N)))


def test_a_plain_multivariate_normal_is_a_type_error_naming_what_is_expected():
    """``likelihood(MultivariateNormal over N points)`` reached GPyTorch's conversion of a batch of tasks and its
    "task_dim of -1 is incompatible with MVN batch shape" ``ValueError``."""
    with pytest.raises(TypeError, match=r"MultitaskMultivariateNormal.*\(N, C\)"):
        SoftmaxLikelihood(C)(MultivariateNormal(torch.zeros(N), torch.eye(N)))


def test_batch_multivariate_normal_input_is_converted_by_gpytorch():
    batch = MultivariateNormal(torch.zeros(C, N), torch.eye(N).expand(C, N, N))
    with pytest.warns(DeprecationWarning):
        predictive = SoftmaxLikelihood(C)(batch)
    torch.testing.assert_close(predictive.probs, torch.full((N, C), 1 / C))
