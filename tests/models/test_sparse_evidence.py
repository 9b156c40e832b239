"""The collapsed sparse evidence of SFR against dense evidences built from brute-force Jacobians."""

from __future__ import annotations

import math

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood

from ntkgp.mlls.sparse_evidence import SparseLaplaceEvidence
from ntkgp.models.sfr import SFR
from tests.helpers import brute_jacobian, column_groups, mlp
from tests.models.test_sfr import DELTA, Dense, layer_labels, problem


def dense_linearised_evidence(net, x, y, delta, noise):
    """log N(y; m(X), K_XX + σ² I) with m = f − Jθ*, differentiable in δ and σ²."""
    j, _ = brute_jacobian(net, x)
    p0 = delta[column_groups(net, layer_labels(net))]
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    with torch.no_grad():
        m = net(x).reshape(-1) - j @ theta
    cov = (j / p0) @ j.T + noise * torch.eye(j.shape[0], dtype=j.dtype)
    return torch.distributions.MultivariateNormal(m, cov).log_prob(y.reshape(-1))


def gaussian_problem(n=15):
    net, x, y, lik, _ = problem("gaussian", 1, n=n)
    return net, x, y, lik


def test_equals_the_exact_linearised_gp_evidence_at_z_equal_x_with_gradients():
    net, x, y, lik = gaussian_problem()
    sfr = SFR(net, x, y, lik, inducing_points=x, prior_precision=DELTA).train()
    value = sfr.sparse_evidence()
    value.backward()
    delta = DELTA.clone().requires_grad_(True)
    noise = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    ref = dense_linearised_evidence(net, x, y, delta, noise)
    ref.backward()
    assert abs(value.item() - ref.item()) < 1e-8 * abs(ref.item())
    # chain rule through the Positive() constraints: d/draw = d/dvalue · dvalue/draw
    grad_delta = sfr.covar_module.raw_prior_precision.grad / torch.sigmoid(sfr.covar_module.raw_prior_precision)
    assert torch.allclose(grad_delta, delta.grad, rtol=1e-6)
    raw_noise = sfr.likelihood.raw_noise
    grad_noise = raw_noise.grad / torch.sigmoid(raw_noise)
    assert torch.allclose(grad_noise, noise.grad, rtol=1e-6)


def test_is_a_lower_bound_for_inducing_subsets_and_tightens_with_more_points():
    net, x, y, lik = gaussian_problem(n=20)
    ref = dense_linearised_evidence(net, x, y, DELTA, torch.tensor(0.1, dtype=torch.float64)).item()
    values = [SFR(net, x, y, lik, inducing_points=x[:m], prior_precision=DELTA).sparse_evidence().item() for m in (3, 8, 15)]
    assert all(v < ref for v in values)
    assert values[0] < values[1] < values[2]


@pytest.mark.parametrize("kind,c", [("logistic", 1), ("softmax", 3)])
def test_classification_at_z_equal_x_is_the_gaussian_site_laplace_evidence(kind, c):
    net, x, y, lik, _ = problem(kind, c, n=12)
    sfr = SFR(net, x, y, lik, inducing_points=x, prior_precision=DELTA)
    dense = Dense(net, x, y, kind)
    h = dense.j.T @ dense.lam_big @ dense.j + torch.diag(dense.p0)
    v = dense.j.T @ dense.g.reshape(-1) - dense.p0 * dense.theta
    ref = (
        dense.logp.sum()
        - 0.5 * dense.theta @ (dense.p0 * dense.theta)
        + 0.5 * v @ torch.linalg.solve(h, v)
        + 0.5 * dense.p0.log().sum()
        - 0.5 * torch.linalg.slogdet(h)[1]
    )
    assert abs(sfr.sparse_evidence().item() - ref.item()) < 1e-8 * abs(ref.item())


def test_evidence_with_zero_mean_and_independent_outputs_is_a_bound_on_its_own_z_equal_x_value():
    net, x, y, lik, _ = problem("softmax", 3, n=15)
    kw = {"prior_precision": DELTA, "prior_mean": "zero", "output_coupling": "independent"}
    full = SFR(net, x, y, lik, inducing_points=x, **kw).sparse_evidence().item()
    sparse = SFR(net, x, y, lik, inducing_points=x[:5], **kw).sparse_evidence().item()
    assert sparse < full


def test_gpytorch_loop_learns_prior_precision_and_noise():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 40, dtype=torch.float64).unsqueeze(-1)
    net = mlp(1, 8, 1, seed=1)
    with torch.no_grad():
        y = net(x).squeeze(-1) + 0.2 * torch.randn(40, dtype=torch.float64)
    sfr = SFR(net, x, y, GaussianLikelihood().double(), num_inducing=10, prior_precision=50.0)
    sfr.train()
    mll = SparseLaplaceEvidence(sfr.likelihood, sfr)
    start = mll().item()
    optimizer = torch.optim.Adam(sfr.hyperparameters(), lr=0.1)
    for _ in range(60):
        optimizer.zero_grad()
        loss = -mll()
        loss.backward()
        optimizer.step()
    sfr.eval()
    assert mll().item() > start + 0.1
    assert math.isfinite(sfr(x).variance.sum().item())
    with pytest.raises(ValueError, match="own likelihood"):
        SparseLaplaceEvidence(GaussianLikelihood(), sfr)
