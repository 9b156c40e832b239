"""Small problems shared by the tests of ntkgp.training."""

import gpytorch
import pytest
import torch

from tests.helpers import mlp


def _small_regression(n=30, width=8, seed=0):
    """``(x, y, net, likelihood)``: ``n`` noisy points of sin(2x) on [-2, 2], a 1-``width``-1 tanh MLP (float64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(-2, 2, n, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(2 * x).squeeze(-1) + 0.1 * torch.randn(n, dtype=torch.float64, generator=g)
    net = mlp(d_in=1, width=width, d_out=1, depth=1, seed=seed)
    return x, y, net, gpytorch.likelihoods.GaussianLikelihood().double()


@pytest.fixture
def small_regression():
    """A factory of small regression problems, ``small_regression(n=30, width=8, seed=0) -> (x, y, net, lik)``."""
    return _small_regression


def gaussian_map_loss(net, x, y, noise, delta, num_data):
    """The MAP objective per example written out with torch.distributions: (½ δ ‖θ‖² − (N/B) Σ log N(y | f, σ²)) / N."""
    f = net(x).squeeze(-1)
    fit = torch.distributions.Normal(f, noise.sqrt()).log_prob(y).sum() * (num_data / x.shape[0])
    prior = 0.5 * delta * sum(p.square().sum() for p in net.parameters())
    return (prior - fit) / num_data


@pytest.fixture
def map_loss():
    """:func:`gaussian_map_loss`, the independent MAP objective of a Gaussian likelihood and one δ for all weights."""
    return gaussian_map_loss
