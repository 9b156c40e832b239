"""SFR against dense weight-space and function-space computations from brute-force Jacobians."""

from __future__ import annotations

import pytest
import torch

from ntkgp.models.sfr import SFR
from tests.helpers import rel_err
from tests.models.sfr.problems import DELTA, Dense, dense_moments, problem, sfr_formula

CASES = [("gaussian", 1), ("gaussian", 2), ("logistic", 1), ("softmax", 3)]


@pytest.mark.parametrize("kind,c", CASES)
def test_z_equal_x_with_linearized_mean_is_the_laplace_glm_posterior(kind, c):
    net, x, y, lik, xs = problem(kind, c)
    sfr = SFR(net, x, y, lik, inducing_points=x, prior_precision=DELTA, prior_mean="linearized")
    mean, cov = dense_moments(sfr(xs))
    ref_mean, ref_cov = Dense(net, x, y, kind).weight_space_glm(xs)
    assert rel_err(mean, ref_mean) < 1e-8
    assert rel_err(cov, ref_cov) < 1e-7
    assert rel_err(sfr(xs).variance.reshape(-1), torch.diagonal(ref_cov)) < 1e-7


@pytest.mark.parametrize("kind,c", CASES)
def test_z_equal_x_with_zero_mean_is_the_exact_gp_with_gaussian_sites(kind, c):
    net, x, y, lik, xs = problem(kind, c)
    sfr = SFR(net, x, y, lik, inducing_points=x, prior_precision=DELTA, prior_mean="zero")
    mean, cov = dense_moments(sfr(xs))
    ref_mean, ref_cov = Dense(net, x, y, kind).gp_posterior(xs, "zero")
    assert rel_err(mean, ref_mean) < 1e-8
    assert rel_err(cov, ref_cov) < 1e-7


@pytest.mark.parametrize("coupling", ["joint", "independent"])
@pytest.mark.parametrize("kind,c,mean", [("softmax", 3, "zero"), ("gaussian", 2, "linearized"), ("logistic", 1, "zero")])
def test_sparse_predictive_matches_the_dense_sfr_formula(kind, c, mean, coupling):
    net, x, y, lik, xs = problem(kind, c, n=20)
    z_idx = torch.tensor([0, 3, 5, 8, 13, 17])
    sfr = SFR(net, x, y, lik, inducing_points=x[z_idx], prior_precision=DELTA, prior_mean=mean, output_coupling=coupling)
    got_mean, got_cov = dense_moments(sfr(xs))
    ref_mean, ref_cov = sfr_formula(Dense(net, x, y, kind), z_idx, xs, mean, independent=coupling == "independent")
    assert rel_err(got_mean, ref_mean) < 1e-8
    assert rel_err(got_cov, ref_cov) < 1e-7
    assert rel_err(sfr(xs).variance.reshape(-1), torch.diagonal(ref_cov)) < 1e-7


def test_independent_equals_full_for_one_output():
    net, x, y, lik, xs = problem("logistic", 1, n=20)
    full = SFR(net, x, y, lik, num_inducing=7, prior_precision=DELTA, output_coupling="joint")
    indep = SFR(net, x, y, lik, num_inducing=7, prior_precision=DELTA, output_coupling="independent")
    (m1, c1), (m2, c2) = dense_moments(full(xs)), dense_moments(indep(xs))
    assert rel_err(m2, m1) < 1e-10 and rel_err(c2, c1) < 1e-10


def test_nn_predictive_mean_is_the_network_with_sfr_covariance():
    net, x, y, lik, xs = problem("softmax", 3)
    gp = SFR(net, x, y, lik, num_inducing=6)
    nn_mean = SFR(net, x, y, lik, num_inducing=6, predictive_mean="nn")
    with torch.no_grad():
        assert torch.allclose(nn_mean(xs).mean, net(xs), atol=1e-12)
    assert torch.allclose(nn_mean(xs).covariance_matrix, gp(xs).covariance_matrix, atol=1e-12)


def test_predictive_over_y_and_monte_carlo_blocks():
    net, x, y, lik, xs = problem("softmax", 3)
    sfr = SFR(net, x, y, lik, num_inducing=6)
    dist = sfr(xs)
    probs = sfr.likelihood(dist).probs
    assert probs.shape == (5, 3) and torch.allclose(probs.sum(-1), torch.ones(5, dtype=torch.float64))
    mc = sfr.likelihood(dist, link_approx="mc", num_samples=20000, generator=torch.Generator().manual_seed(0)).probs
    assert (mc - probs).abs().max() < 0.05
    gaussian = problem("gaussian", 1)
    reg = SFR(*gaussian[:4], num_inducing=6)
    pred = reg.likelihood(reg(gaussian[4]))
    assert torch.allclose(pred.variance, reg(gaussian[4]).variance + 0.1, atol=1e-10)
