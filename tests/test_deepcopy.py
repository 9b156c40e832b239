"""``copy.deepcopy`` of every posterior and model (issue 38, item 5; docs/guarantees.md, "Saving, loading and
interrupts"): the copy predicts as the original, checked against dense float64 formulas written here (brute-force
Jacobians, explicit ``P × P`` matrices), shares the user's network, and owns its hyperparameters: changing δ or
the noise of the copy changes the copy (to the dense value at the new hyperparameters) and leaves the original as it
was. Before the fix a deep copy of a KFAC or diagonal posterior raised "layer '0' is called never per forward pass"
(its layer hooks sat on copies of the network's modules, which the shared network never calls).

Tolerances: every reference is a float64 solve with a matrix of condition number below 1e6 on these problems
(δ ≥ 1 and σ² ≥ 0.1 bound H's spectrum away from 0), so both sides agree to about ε·κ ≈ 1e-10 relative; 1e-8 leaves
room for the different summation orders.
"""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch
from torch.func import functional_call

import ntkgp
from ntkgp.fsvi import FSVI
from ntkgp.laplace import laplace_posterior, predict
from tests.fsvi import reference as fsvi_ref
from tests.helpers import brute_jacobian, mlp, reference_log_prob

F64 = torch.float64
DELTA, NOISE = 1.5, 0.3
NEW_DELTA, NEW_NOISE = 4.0, 0.5
RTOL = 1e-8


def _problem(n: int = 12):
    torch.manual_seed(0)
    x = torch.randn(n, 3, dtype=F64)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(n, dtype=F64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = torch.tensor(NOISE, dtype=F64)
    x_test = torch.randn(5, 3, dtype=F64)
    return mlp(d_in=3, width=5, seed=1), x, y, likelihood, x_test


def _close(actual, expected, what):
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=RTOL, atol=1e-12, msg=what)


# ---------------------------------------------------------------------- dense references (no ntkgp code)
def _columns(net, names):
    """The Jacobian columns of the parameters ``names`` (all trainable ones: ``None``)."""
    cols, start = [], 0
    for name, p in net.named_parameters():
        if names is None or name in names:
            cols.append(torch.arange(start, start + p.numel()))
        start += p.numel()
    return torch.cat(cols)


def _dense_precision(structure, net, x, y, delta, noise, names=None):
    """``H + δI`` of the Gaussian likelihood with noise ``noise`` for the GGN / empirical Fisher, full or diagonal."""
    jac = brute_jacobian(net, x)[0][:, _columns(net, names)]
    if structure.endswith("ggn"):
        curvature = jac.T @ jac / noise
    else:  # the empirical Fisher: Σ g gᵀ with g_n = J_nᵀ (y_n − f_n) / σ²
        with torch.no_grad():
            residual = (y - net(x).squeeze(-1)) / noise
        grads = jac * residual[:, None]
        curvature = grads.T @ grads
    if structure.startswith("diag"):
        curvature = torch.diag(curvature.diagonal())
    return curvature + delta * torch.eye(curvature.shape[0], dtype=F64)


def _glm_variance(net, x_test, precision, names=None):
    jac = brute_jacobian(net, x_test)[0][:, _columns(net, names)]
    return (jac @ torch.linalg.solve(precision, jac.T)).diagonal()


def _posterior_variance(posterior, x_test):
    return predict(posterior, x_test, method="glm").f.variance


# ---------------------------------------------------------------------- weight-space posteriors
STRUCTURES = [("full_ggn", "all"), ("full_ef", "all"), ("kfac", "all"), ("diag_ggn", "all"), ("diag_ef", "all"),
              ("full_ggn", "last_layer"), ("full_ef", "last_layer")]


@pytest.mark.parametrize("structure,subset", STRUCTURES)
def test_a_deep_copy_of_a_posterior_predicts_as_the_original_and_owns_its_hyperparameters(structure, subset):
    net, x, y, likelihood, x_test = _problem()
    names = ["4.weight", "4.bias"] if subset == "last_layer" else None

    def reference(delta, noise):
        if structure == "kfac":  # no closed form to write out: the posterior's explicit Kronecker products
            fresh = gpytorch.likelihoods.GaussianLikelihood().double()
            fresh.noise = torch.tensor(noise, dtype=F64)
            built = laplace_posterior(net, x, y, fresh, structure="kfac", prior_precision=delta)
            return _glm_variance(net, x_test, built.dense_precision())
        return _glm_variance(net, x_test, _dense_precision(structure, net, x, y, delta, noise, names), names)

    posterior = laplace_posterior(net, x, y, likelihood, structure=structure, subset=subset, prior_precision=DELTA)
    _posterior_variance(posterior, x_test)  # used first: its caches filled
    twin = copy.deepcopy(posterior)
    assert twin.function.net is net  # the network is shared, not copied
    before = reference(DELTA, NOISE)
    _close(_posterior_variance(twin, x_test), before, "the copy")

    twin.prior_precision = NEW_DELTA
    twin.likelihood.noise = torch.tensor(NEW_NOISE, dtype=F64)
    _close(_posterior_variance(twin, x_test), reference(NEW_DELTA, NEW_NOISE), "the copy at its new hyperparameters")
    _close(_posterior_variance(posterior, x_test), before, "the original after the copy changed")
    assert torch.all(posterior.prior_precision == DELTA)
    assert float(posterior.likelihood.noise.detach()) == pytest.approx(NOISE)


@pytest.mark.parametrize("order", ["network first", "posterior first"])
def test_a_posterior_copied_together_with_its_network_still_predicts(order):
    """``deepcopy([net, posterior])``: the network in the list is copied (the user asked for it), the posterior's
    copy holds the network it was built on (as every model's copy does) and predicts as the dense formula."""
    net, x, y, likelihood, x_test = _problem()
    posterior = laplace_posterior(net, x, y, likelihood, structure="diag_ggn", prior_precision=DELTA)
    pair = [net, posterior] if order == "network first" else [posterior, net]
    net_copy, twin = copy.deepcopy(pair) if order == "network first" else copy.deepcopy(pair)[::-1]
    assert net_copy is not net and twin.function.net is net
    _close(_posterior_variance(twin, x_test), _glm_variance(net, x_test, _dense_precision(
        "diag_ggn", net, x, y, DELTA, NOISE)), "the copy")


# ---------------------------------------------------------------------- models
def _dense_glm(net, x, y, x_test, delta, noise):
    """Mean (one Newton step from θ*) and variances of the GLM predictive."""
    jac = brute_jacobian(net, x)[0]
    with torch.no_grad():
        f = net(x).squeeze(-1)
        f_test = net(x_test).squeeze(-1)
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    h = _dense_precision("full_ggn", net, x, y, delta, noise)
    step = torch.linalg.solve(h, jac.T @ (y - f) / noise - delta * theta)
    j_test = brute_jacobian(net, x_test)[0]
    return f_test + j_test @ step, (j_test @ torch.linalg.solve(h, j_test.T)).diagonal()


def _moments(model, x_test):
    with torch.no_grad():
        dist = model(x_test)
        return dist.mean, dist.variance


def _check_model(model, twin, net, x, y, x_test, set_delta, tol=RTOL):
    expected = _dense_glm(net, x, y, x_test, DELTA, NOISE)
    for got, want in zip(_moments(twin, x_test), expected):
        torch.testing.assert_close(got, want, rtol=tol, atol=1e-12)
    set_delta(twin, NEW_DELTA)
    twin.likelihood.noise = torch.tensor(NEW_NOISE, dtype=F64)
    for got, want in zip(_moments(twin, x_test), _dense_glm(net, x, y, x_test, NEW_DELTA, NEW_NOISE)):
        torch.testing.assert_close(got, want, rtol=tol, atol=1e-12)
    for got, want in zip(_moments(model, x_test), expected):
        torch.testing.assert_close(got, want, rtol=tol, atol=1e-12)


@pytest.mark.parametrize("space", ["weight", "function"])
def test_a_deep_copy_of_an_ntkgp_predicts_as_the_original_in_both_spaces(space):
    net, x, y, likelihood, x_test = _problem()
    model = ntkgp.NTKGP(net, x, y, likelihood, prior_precision=DELTA, space=space).eval()
    _moments(model, x_test)
    twin = copy.deepcopy(model)
    assert twin.covar_module.engine.net is net and twin.likelihood is not likelihood

    def set_delta(m, value):
        m.covar_module.prior_precision = value

    _check_model(model, twin, net, x, y, x_test, set_delta)


def test_a_deep_copy_of_a_conditioned_ntkgp_predicts_on_the_union_of_the_data():
    net, x, y, likelihood, x_test = _problem(n=15)
    model = ntkgp.NTKGP(net, x[:12], y[:12], likelihood, prior_precision=DELTA).eval()
    conditioned = model.condition_on(x[12:], y[12:])
    _moments(conditioned, x_test)
    twin = copy.deepcopy(conditioned)

    def set_delta(m, value):
        m.covar_module.prior_precision = value

    _check_model(conditioned, twin, net, x, y, x_test, set_delta)


def test_a_deep_copy_of_an_sfr_predicts_as_the_original():
    """With every training input inducing (Z = X) SFR is the GLM predictive itself; its Nyström factorization of
    K_ZZ loses about ε·κ(K_ZZ) relative, κ measured here."""
    net, x, y, likelihood, x_test = _problem()
    model = ntkgp.SFR(net, x, y, likelihood, inducing_points=x, prior_precision=DELTA)
    _moments(model, x_test)
    twin = copy.deepcopy(model)
    assert twin.likelihood is not likelihood
    jac = brute_jacobian(net, x)[0]
    kappa = torch.linalg.cond(jac @ jac.T).item()
    tol = max(RTOL, 100 * torch.finfo(F64).eps * kappa)

    def set_delta(m, value):
        m.covar_module.prior_precision = value

    _check_model(model, twin, net, x, y, x_test, set_delta, tol)


def test_a_deep_copy_of_an_fsvi_model_predicts_as_the_original_and_owns_its_variational_parameters():
    net, _, _, likelihood, x_test = _problem()
    model = FSVI(net, likelihood).eval()
    q = model.variational_distribution
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m, s in zip(q.mean, q.raw_std):
            m.add_(0.3 * torch.randn(m.shape, generator=g, dtype=F64))
            s.copy_(-1.0 + 0.5 * torch.randn(s.shape, generator=g, dtype=F64))

    def dense(m):
        dist = m.variational_distribution
        mu = {n: t.detach() for n, t in dist.means().items()}
        var = {n: t.detach() for n, t in dist.variances().items()}
        return (functional_call(net, mu, (x_test,)).squeeze(-1),
                fsvi_ref.covariance(net, mu, var, dist.names, x_test).diagonal())

    expected = dense(model)
    twin = copy.deepcopy(model)
    for got, want in zip(_moments(twin, x_test), expected):
        _close(got, want, "the copy")
    with torch.no_grad():
        twin.variational_distribution.raw_std[0].add_(1.0)
        twin.variational_distribution.mean[0].add_(0.5)
    for got, want in zip(_moments(twin, x_test), dense(twin)):
        _close(got, want, "the changed copy")
    assert not torch.allclose(dense(twin)[1], expected[1])
    for got, want in zip(_moments(model, x_test), expected):
        _close(got, want, "the original")


def test_a_deep_copy_of_an_ntk_kernel_owns_its_prior_precision():
    net, x, _, _, x_test = _problem()
    kernel = ntkgp.NTKKernel(net, prior_precision=DELTA)
    jac, jac_test = brute_jacobian(net, x)[0], brute_jacobian(net, x_test)[0]
    kernel(x_test, x).to_dense()
    twin = copy.deepcopy(kernel)
    _close(twin(x_test, x).to_dense(), jac_test @ jac.T / DELTA, "the copy")
    twin.prior_precision = NEW_DELTA
    _close(twin(x_test, x).to_dense(), jac_test @ jac.T / NEW_DELTA, "the changed copy")
    _close(kernel(x_test, x).to_dense(), jac_test @ jac.T / DELTA, "the original")


def _dense_evidence(net, x, y, delta, noise):
    with torch.no_grad():
        f = net(x)
    log_lik = reference_log_prob("gaussian", f, y, torch.tensor([noise], dtype=F64)).sum()
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    h = _dense_precision("full_ggn", net, x, y, delta, noise)
    return (log_lik - 0.5 * delta * theta @ theta + 0.5 * theta.numel() * torch.log(torch.tensor(delta, dtype=F64))
            - 0.5 * torch.linalg.slogdet(h)[1]) / x.shape[0]


def _dense_gp_evidence(net, x, y, delta, noise):
    """The linearized GP's evidence log N(y; f(X) − Jθ*, J Jᵀ/δ + σ²I) / N, which SFR's sparse bound equals at
    Z = X (docs/sfr.md, "Sparse evidence")."""
    jac = brute_jacobian(net, x)[0]
    with torch.no_grad():
        f = net(x).squeeze(-1)
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    cov = jac @ jac.T / delta + noise * torch.eye(x.shape[0], dtype=F64)
    normal = torch.distributions.MultivariateNormal(f - jac @ theta, covariance_matrix=cov)
    return normal.log_prob(y) / x.shape[0]


@pytest.mark.parametrize("which", ["laplace_ggn", "sparse"])
def test_a_deep_copy_of_an_mll_evaluates_as_the_original_and_owns_its_model(which):
    net, x, y, likelihood, _ = _problem()
    evidence = _dense_evidence
    if which == "laplace_ggn":
        model = ntkgp.NTKGP(net, x, y, likelihood, prior_precision=DELTA)
        mll = ntkgp.LaplaceGGNMarginalLogLikelihood(likelihood, model)

        def value(m):
            m.model.train()
            return m(m.model(x), y)
    else:
        model = ntkgp.SFR(net, x, y, likelihood, inducing_points=x, prior_precision=DELTA)
        mll = ntkgp.SparseLaplaceMarginalLogLikelihood(likelihood, model)

        def value(m):
            return m(None, y)

        evidence = _dense_gp_evidence

    value(mll)
    twin = copy.deepcopy(mll)
    assert twin.model is not model and twin.likelihood is twin.model.likelihood
    _close(value(twin), evidence(net, x, y, DELTA, NOISE), "the copy")
    twin.model.covar_module.prior_precision = NEW_DELTA
    _close(value(twin), evidence(net, x, y, NEW_DELTA, NOISE), "the changed copy")
    _close(value(mll), evidence(net, x, y, DELTA, NOISE), "the original")
