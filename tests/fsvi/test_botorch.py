"""FSVI as a BoTorch model: ``posterior`` against dense Jacobians, and BoTorch's acquisition functions on it."""

from __future__ import annotations

import math

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood, MultitaskGaussianLikelihood

from ntkgp.fsvi import FSVI

from . import reference as ref
from .test_model import _dense, _perturbed

pytest.importorskip("botorch")


@pytest.mark.parametrize("c", [1, 2])
def test_posterior_of_batches_equals_dense(c):
    net = ref.mlp(d_in=2, width=5, d_out=c)
    lik = GaussianLikelihood().double() if c == 1 else MultitaskGaussianLikelihood(c, rank=0).double()
    model = _perturbed(FSVI(net, lik)).eval()
    X = torch.randn(4, 3, 2, dtype=torch.float64)  # (batch, q, d)
    with torch.no_grad():
        post = model.posterior(X)
        noisy = model.posterior(X, observation_noise=True)
    assert post.mean.shape == (4, 3, c)
    for b in range(4):
        mean, cov = _dense(net, model, X[b])
        torch.testing.assert_close(post.mean[b], mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(post.distribution.covariance_matrix[b], cov, rtol=1e-10, atol=1e-12)
    noise = model.likelihood.noise.reshape(-1) if c == 1 else model.likelihood.task_noises + model.likelihood.noise
    torch.testing.assert_close(noisy.variance - post.variance, noise.expand_as(post.variance).detach(),
                               rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # one output selected, plain (q, d) inputs
        one = model.posterior(X[0], output_indices=[c - 1])
    assert one.mean.shape == (3, 1)
    torch.testing.assert_close(one.mean[:, 0], post.mean[0, :, c - 1], rtol=1e-12, atol=1e-12)


def test_acquisition_functions_take_the_model():
    from botorch.acquisition import LogExpectedImprovement, UpperConfidenceBound

    net = ref.mlp(d_in=2, width=5, d_out=1)
    model = _perturbed(FSVI(net, GaussianLikelihood().double())).eval()
    X = torch.randn(6, 1, 2, dtype=torch.float64, requires_grad=True)
    ucb = UpperConfidenceBound(model, beta=4.0)(X)
    mean, cov = _dense(net, model, X.detach().reshape(6, 2))
    torch.testing.assert_close(ucb.detach(), mean.squeeze(-1) + 2.0 * cov.diagonal().sqrt(), rtol=1e-10, atol=1e-12)
    ucb.sum().backward()
    assert X.grad is not None and torch.isfinite(X.grad).all() and X.grad.abs().sum() > 0
    best = mean.max().item()
    log_ei = LogExpectedImprovement(model, best_f=best)(X.detach())
    sd = cov.diagonal().sqrt()
    z = (mean.squeeze(-1) - best) / sd
    normal = torch.distributions.Normal(0.0, 1.0)
    ei = sd * (z * normal.cdf(z) + normal.log_prob(z).exp())
    torch.testing.assert_close(log_ei.detach(), ei.log(), rtol=1e-6, atol=1e-8)
    assert math.isfinite(log_ei.sum().item())


def test_posterior_rejects_bad_arguments():
    model = FSVI(ref.mlp(d_in=2, width=5, d_out=1), GaussianLikelihood().double()).eval()
    with pytest.raises(TypeError, match="unexpected"):
        model.posterior(torch.randn(3, 2, dtype=torch.float64), chunk_size=4)
    with pytest.raises(ValueError, match="X must"):
        model.posterior(torch.randn(3, dtype=torch.float64))
