"""The collapsed sparse evidence of SFR (and its GPyTorch MLL) against dense evidences from brute-force Jacobians."""

from __future__ import annotations

import math

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood

from ntkgp.mlls.sparse_evidence import SparseLaplaceMarginalLogLikelihood
from ntkgp.models.sfr import SFR
from tests.helpers import brute_jacobian, column_groups, mlp
from tests.models.sfr.problems import DELTA, Dense, layer_labels, problem
from ntkgp.models import SFRInducingOptions


def dense_linearized_evidence(net, x, y, delta, noise):
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


def test_equals_the_exact_linearized_gp_evidence_at_z_equal_x_with_gradients():
    net, x, y, lik = gaussian_problem()
    sfr = SFR(net, x, y, lik, inducing_points=x, prior_precision=DELTA).train()
    value = sfr.log_marginal_likelihood()
    value.backward()
    delta = DELTA.clone().requires_grad_(True)
    noise = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    ref = dense_linearized_evidence(net, x, y, delta, noise)
    ref.backward()
    assert abs(value.item() - ref.item()) < 1e-8 * abs(ref.item())
    # chain rule through the constraints (whatever their transform): d/draw = d/dvalue · dvalue/draw
    def slope(raw, constraint):
        return torch.autograd.functional.jacobian(constraint.transform, raw.detach()).reshape(raw.numel(), -1).diagonal()

    kernel = sfr.covar_module
    grad_delta = kernel.raw_prior_precision.grad / slope(kernel.raw_prior_precision, kernel.raw_prior_precision_constraint)
    assert torch.allclose(grad_delta, delta.grad, rtol=1e-6)
    raw_noise = sfr.likelihood.raw_noise
    grad_noise = raw_noise.grad.reshape(-1) / slope(raw_noise, sfr.likelihood.noise_covar.raw_noise_constraint)
    assert torch.allclose(grad_noise, noise.grad, rtol=1e-6)


def test_is_a_lower_bound_for_inducing_subsets_and_tightens_with_more_points():
    net, x, y, lik = gaussian_problem(n=20)
    ref = dense_linearized_evidence(net, x, y, DELTA, torch.tensor(0.1, dtype=torch.float64)).item()
    values = [SFR(net, x, y, lik, inducing_points=x[:m], prior_precision=DELTA).log_marginal_likelihood().item() for m in (3, 8, 15)]
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
    assert abs(sfr.log_marginal_likelihood().item() - ref.item()) < 1e-8 * abs(ref.item())


def test_evidence_with_zero_mean_and_independent_outputs_is_a_bound_on_its_own_z_equal_x_value():
    net, x, y, lik, _ = problem("softmax", 3, n=15)
    kw = {"prior_precision": DELTA, "prior_mean": "zero", "output_coupling": "independent"}
    full = SFR(net, x, y, lik, inducing_points=x, **kw).log_marginal_likelihood().item()
    sparse = SFR(net, x, y, lik, inducing_points=x[:5], **kw).log_marginal_likelihood().item()
    assert sparse < full


def test_gpytorch_loop_learns_prior_precision_and_noise():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 40, dtype=torch.float64).unsqueeze(-1)
    net = mlp(1, 8, 1, seed=1)
    with torch.no_grad():
        y = net(x).squeeze(-1) + 0.2 * torch.randn(40, dtype=torch.float64)
    sfr = SFR(net, x, y, GaussianLikelihood().double(), num_inducing=10, prior_precision=50.0)
    sfr.train()
    mll = SparseLaplaceMarginalLogLikelihood(sfr.likelihood, sfr)
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
        SparseLaplaceMarginalLogLikelihood(GaussianLikelihood(), sfr)


def test_trained_two_moons_bound_needs_no_jitter_and_stays_below_the_full_site_evidence():
    """The demo's two-moons case (trained tanh MLP, N = 170, M = N/4). The former Cholesky of K_ZZ + B_u needed
    jitter and gave sparse evidences of +2 to +11 per datum against a Laplace evidence of -0.2 per datum."""
    import warnings

    from ntkgp.likelihoods import LogisticLikelihood
    from ntkgp.linalg import JitterWarning

    g = torch.Generator().manual_seed(1)
    n = 170
    t = math.pi * torch.rand(n, generator=g, dtype=torch.float64)
    label = (torch.arange(n) % 2).to(torch.float64)
    x = torch.stack([torch.cos(t) * (1 - 2 * label) + label, torch.sin(t) * (1 - 2 * label) + 0.5 * label], 1)
    x = x + 0.2 * torch.randn(n, 2, generator=g, dtype=torch.float64)
    net = mlp(2, 50, 1, depth=2, seed=1)
    delta = torch.tensor([0.4, 0.08, 0.04], dtype=torch.float64)
    p0 = delta[column_groups(net, layer_labels(net))]
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(500):  # MAP training
        optimizer.zero_grad()
        theta = torch.cat([p.reshape(-1) for p in net.parameters()])
        nll = torch.nn.functional.binary_cross_entropy_with_logits(net(x).squeeze(-1), label, reduction="sum")
        (nll + 0.5 * (p0 * theta.square()).sum()).backward()
        optimizer.step()
    lik = LogisticLikelihood().double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", JitterWarning)
        sparse = SFR(net, x, label, lik, num_inducing=42, prior_precision=delta,
                     inducing=SFRInducingOptions(seed=1)).log_marginal_likelihood().item()
        full = SFR(net, x, label, lik, inducing_points=x, prior_precision=delta).log_marginal_likelihood().item()
    # Dense weight-space Laplace-GGN evidence log q(D) and the stationarity gap ½ vᵀH⁻¹v, v = Jᵀg − P0θ*.
    dense = Dense(net, x, label, "logistic", delta=delta)
    h = dense.j.T @ dense.lam_big @ dense.j + torch.diag(dense.p0)
    v = dense.j.T @ dense.g.reshape(-1) - dense.p0 * dense.theta
    log_q = (
        dense.logp.sum() - 0.5 * (dense.p0 * dense.theta.square()).sum()
        - 0.5 * (torch.logdet(h) - dense.p0.log().sum())
    ).item()
    gap = 0.5 * (v @ torch.linalg.solve(h, v)).item()
    assert abs(full - (log_q + gap)) < 1e-3  # Z = X: the full Gaussian-site evidence (to rounding of the Grams)
    assert sparse <= full + 1e-9  # the collapsed bound, by construction
    assert sparse / n <= (log_q + gap) / n and -1.0 < sparse / n < 0.0


def test_gpytorch_signature_against_the_dense_evidence_per_datum():
    net, x, y, lik = gaussian_problem()
    sfr = SFR(net, x, y, lik, inducing_points=x, prior_precision=DELTA)  # Z = X: the exact linearized evidence
    mll = SparseLaplaceMarginalLogLikelihood(sfr.likelihood, sfr)
    expected = dense_linearized_evidence(net, x, y, DELTA, torch.tensor(0.1, dtype=torch.float64)).item() / x.shape[0]
    for value in (mll(), mll(sfr(x), y), mll(None, None)):  # GPyTorch's loop: the training output and targets
        assert abs(value.item() - expected) < 1e-8 * abs(expected)
    with pytest.raises(ValueError, match="training inputs"):
        mll(sfr(x[:4]), y)
    with pytest.raises(ValueError, match="training targets"):
        mll(None, y[:4])
    with pytest.raises(TypeError, match="MultivariateNormal"):
        mll(y, y)
    with pytest.raises(TypeError, match="needs an SFR"):
        SparseLaplaceMarginalLogLikelihood(lik, torch.nn.Linear(1, 1))


def test_registered_priors_are_added_as_in_exact_marginal_log_likelihood():
    from gpytorch.priors import GammaPrior

    net, x, y, lik = gaussian_problem()
    sfr = SFR(net, x, y, lik, num_inducing=5, prior_precision=DELTA)
    sfr.covar_module.register_prior("delta_prior", GammaPrior(2.0, 1.0), lambda m: m.prior_precision)
    value = SparseLaplaceMarginalLogLikelihood(sfr.likelihood, sfr)()
    log_prior = torch.distributions.Gamma(torch.tensor(2.0), torch.tensor(1.0)).log_prob(DELTA).sum()
    expected = (sfr.log_marginal_likelihood() + log_prior) / x.shape[0]
    assert abs(value.item() - expected.item()) < 1e-10
