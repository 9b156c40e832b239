"""``FSVI.condition_on``: the exact GP posterior of the linearized GP given new observations, against the dense
posterior from autograd Jacobians (float64); the Monte Carlo predictive by Matheron's rule in weight space;
BoTorch's conditioning; validation; changes of μ, s and the noise."""

from __future__ import annotations

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood, MultitaskGaussianLikelihood
from torch.func import functional_call

from ntkgp.fsvi import FSVI
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood

from . import reference as ref
from .test_model import _perturbed

F64 = torch.float64


def _likelihood(c):
    if c == 1:
        lik = GaussianLikelihood().double()
        lik.noise = 0.07
        return lik
    lik = MultitaskGaussianLikelihood(c, rank=0).double()
    lik.task_noises = torch.linspace(0.03, 0.4, c, dtype=F64)  # distinct noise per task (plus the global noise)
    return lik


def _model(c, seed=0, d_in=2):
    net = ref.mlp(d_in=d_in, width=5, d_out=c, seed=seed)
    return net, _perturbed(FSVI(net, _likelihood(c)), seed=seed).eval()


def _data(n, c, d_in=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=F64)
    y = torch.randn(n, c, generator=g, dtype=F64)
    return x, (y.squeeze(-1) if c == 1 else y)


def _noise(model):
    lik = model.likelihood
    if isinstance(lik, MultitaskGaussianLikelihood):
        return (lik.task_noises + lik.noise).detach()
    return lik.noise.reshape(-1).detach()


def _dense_posterior(net, model, x, x_obs, y_obs):
    """The posterior of N(f(·; μ), J diag(s²) Jᵀ) given y_obs = f(x_obs) + ε, by dense Jacobians and a solve."""
    q = model.variational_distribution
    mu = {n: t.detach() for n, t in q.means().items()}
    var = {n: t.detach() for n, t in q.variances().items()}
    both = torch.cat([x, x_obs])
    mean = functional_call(net, mu, (both,)).reshape(-1)
    cov = ref.covariance(net, mu, var, q.names, both)
    n = x.shape[0] * mean.numel() // both.shape[0]
    gram = cov[n:, n:] + torch.diag(_noise(model).repeat(x_obs.shape[0]))
    cross = cov[:n, n:]
    post_mean = mean[:n] + cross @ torch.linalg.solve(gram, y_obs.reshape(-1) - mean[n:])
    post_cov = cov[:n, :n] - cross @ torch.linalg.solve(gram, cross.T)
    return post_mean, post_cov


def _check(dist, mean, cov):
    torch.testing.assert_close(dist.mean.reshape(-1), mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dist.covariance_matrix, cov, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dist.variance.reshape(-1), cov.diagonal(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("c", [1, 3])
def test_condition_on_equals_dense_posterior(c):
    net, model = _model(c)
    net_before = {k: v.clone() for k, v in net.state_dict().items()}
    x_obs, y_obs = _data(7, c)
    x = torch.randn(5, 2, dtype=F64)
    with torch.no_grad():
        prior_before = model(x)
        mean_before, cov_before = prior_before.mean.clone(), prior_before.covariance_matrix.clone()
    new = model.condition_on(x_obs, y_obs)
    assert type(new) is FSVI and new is not model and new.net is net and not new.training
    mean, cov = _dense_posterior(net, model, x, x_obs, y_obs)
    with torch.no_grad():
        _check(new(x), mean, cov)
        predictive = new.predict(x, method="linearized")
        torch.testing.assert_close(predictive.variance.reshape(-1), cov.diagonal() + _noise(model).repeat(5),
                                   rtol=1e-10, atol=1e-10)
        prior_after = model(x)
    # this model, the network and the observations given are unchanged
    assert model.observations is None
    torch.testing.assert_close(prior_after.mean, mean_before, rtol=0, atol=0)
    torch.testing.assert_close(prior_after.covariance_matrix, cov_before, rtol=0, atol=0)
    assert all(torch.equal(v, net_before[k]) for k, v in net.state_dict().items())
    x_seen, y_seen = new.observations
    torch.testing.assert_close(x_seen, x_obs, rtol=0, atol=0)
    torch.testing.assert_close(y_seen, y_obs.reshape(7, c), rtol=0, atol=0)


def test_conditioning_twice_equals_conditioning_once():
    net, model = _model(3)
    x_obs, y_obs = _data(9, 3)
    x = torch.randn(4, 2, dtype=F64)
    twice = model.condition_on(x_obs[:4], y_obs[:4]).condition_on(x_obs[4:], y_obs[4:])
    once = model.condition_on(x_obs, y_obs)
    mean, cov = _dense_posterior(net, model, x, x_obs, y_obs)
    with torch.no_grad():
        _check(twice(x), mean, cov)
        _check(once(x), mean, cov)
    assert twice.observations[0].shape == (9, 2)


def test_images_and_gradients_to_the_new_inputs():
    net = ref.small_cnn(c_out=1)
    model = _perturbed(FSVI(net, _likelihood(1))).eval()
    g = torch.Generator().manual_seed(0)
    x_obs = torch.randn(4, 1, 6, 6, generator=g, dtype=F64, requires_grad=True)
    y_obs = torch.randn(4, generator=g, dtype=F64)
    x = torch.randn(3, 1, 6, 6, generator=g, dtype=F64)
    new = model.condition_on(x_obs, y_obs)
    assert new.linearized.input_shape == (1, 6, 6)
    mean, cov = _dense_posterior(net, model, x, x_obs.detach(), y_obs)
    dist = new(x)
    _check(dist, mean, cov)
    (dist.mean.sum() + dist.variance.sum()).backward()  # the observations keep their graph (look-ahead acquisitions)
    assert x_obs.grad is not None and x_obs.grad.abs().sum() > 0
    again = new.condition_on(x[:1], y_obs[:1])  # a model whose observations hold a graph can be conditioned again
    assert again.observations[0].shape == (5, 36)


def test_gradients_in_mu_and_s_equal_dense():
    net, model = _model(1)
    x_obs, y_obs = _data(5, 1)
    x = torch.randn(3, 2, dtype=F64)
    new = model.condition_on(x_obs, y_obs)
    dist = new(x)
    loss = dist.mean.pow(2).sum() + dist.variance.sum()
    q = new.variational_distribution
    got = torch.autograd.grad(loss, [*q.mean, *q.raw_std])
    # the same loss through dense Jacobians, differentiable in μ and s
    mu, var = q.means(), q.variances()
    both = torch.cat([x, x_obs])
    f = functional_call(net, mu, (both,)).reshape(-1)
    cov = ref.covariance(net, mu, var, q.names, both, create_graph=True)
    gram = cov[3:, 3:] + _noise(new) * torch.eye(5, dtype=F64)
    mean = f[:3] + cov[:3, 3:] @ torch.linalg.solve(gram, y_obs - f[3:])
    variance = cov.diagonal()[:3] - (cov[:3, 3:] * torch.linalg.solve(gram, cov[3:, :3]).T).sum(-1)
    want = torch.autograd.grad(mean.pow(2).sum() + variance.sum(), [*q.mean, *q.raw_std])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_changes_of_mu_s_and_noise_are_never_missed():
    net, model = _model(3)
    x_obs, y_obs = _data(6, 3)
    x = torch.randn(4, 2, dtype=F64)
    new = model.condition_on(x_obs, y_obs)
    with torch.no_grad():
        new(x)  # fills the cache
        assert len(new._conditioning_cache) == 1
    # an optimizer step on the conditioned model's own variational parameters
    optimizer = torch.optim.SGD(new.variational_distribution.parameters(), lr=0.05)
    dist = new(x)
    (dist.mean.sum() + dist.variance.sum()).backward()
    optimizer.step()
    with torch.no_grad():
        _check(new(x), *_dense_posterior(net, new, x, x_obs, y_obs))
    # an in-place write to μ, and a new task noise
    with torch.no_grad():
        new.variational_distribution.mean[0].add_(0.1)
        _check(new(x), *_dense_posterior(net, new, x, x_obs, y_obs))
        new.likelihood.task_noises = torch.tensor([0.5, 0.01, 0.2], dtype=F64)
        _check(new(x), *_dense_posterior(net, new, x, x_obs, y_obs))
    # the two models hold their own copies: a step on the original does not move the conditioned model
    with torch.no_grad():
        before = new(x).mean.clone()
        model.variational_distribution.mean[1].add_(0.3)
        model.likelihood.task_noises = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
        torch.testing.assert_close(new(x).mean, before, rtol=0, atol=0)


# ---------------------------------------------------------------------- Monte Carlo: Matheron's rule in weight space
def _linear_model(c, seed=0):
    """A network linear in its trainable weights: fixed random tanh features, then a trainable linear layer."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(), torch.nn.Linear(6, c)).double()
    net[0].requires_grad_(False)
    return net, _perturbed(FSVI(net, _likelihood(c)), seed=seed).eval()


def _dense_update(net, model, theta, eps, x_obs, y_obs, create_graph=False):
    """θ + diag(s²) Jᵀ (J diag(s²) Jᵀ + Σ)⁻¹ (Y - f(X; μ) - J (θ - μ) - ε), by the dense Jacobian (flat)."""
    q = model.variational_distribution
    mu = q.means() if create_graph else {n: t.detach() for n, t in q.means().items()}
    var = q.variances() if create_graph else {n: t.detach() for n, t in q.variances().items()}
    names = q.names
    jac = ref.jacobian(net, mu, names, x_obs, create_graph=create_graph)  # (M·C, P), rows m·C + c
    v = ref.flat(var, names)
    gram = (jac * v) @ jac.T + torch.diag(_noise(model).repeat(x_obs.shape[0]))
    f = functional_call(net, mu, (x_obs,)).reshape(-1)
    residual = y_obs.reshape(-1) - f - jac @ (ref.flat(theta, names) - ref.flat(mu, names)) - eps
    return ref.flat(theta, names) + v * (jac.T @ torch.linalg.solve(gram, residual))


@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("linear", [True, False])
def test_matheron_update_equals_dense(c, linear):
    net, model = _linear_model(c) if linear else _model(c)
    x_obs, y_obs = _data(6, c)
    new = model.condition_on(x_obs, y_obs)
    q = new.variational_distribution
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 2, generator=g, dtype=F64)
    with torch.no_grad():
        samples = new.function_samples(x, 3, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)  # the same draws: θ, then ε, per sample
    for s in range(3):
        with torch.no_grad():
            theta = q.sample(g)
            eps = (_noise(new).repeat(6).sqrt() * torch.randn(6 * c, generator=g, dtype=F64))
            got = new._matheron()(theta, eps)
        want = _dense_update(net, new, theta, eps, x_obs, y_obs)
        torch.testing.assert_close(ref.flat(got, q.names), want, rtol=1e-10, atol=1e-10)
        f = functional_call(net, got, (x,))
        torch.testing.assert_close(samples[s], f.squeeze(-1) if c == 1 else f, rtol=1e-10, atol=1e-10)
        if linear:  # f(·; θ') is the function-space Matheron update of the GP draw f(·; θ)
            mu = {n: t.detach() for n, t in q.means().items()}
            var = {n: t.detach() for n, t in q.variances().items()}
            both = torch.cat([x, x_obs])
            cov = ref.covariance(net, mu, var, q.names, both)
            gram = cov[4 * c:, 4 * c:] + torch.diag(_noise(new).repeat(6))
            prior = functional_call(net, theta, (both,)).reshape(-1)
            conditioned = prior[:4 * c] + cov[:4 * c, 4 * c:] @ torch.linalg.solve(
                gram, y_obs.reshape(-1) - prior[4 * c:] - eps)
            torch.testing.assert_close(f.reshape(-1), conditioned, rtol=1e-10, atol=1e-10)
    # differentiable in μ and s, as the dense formula
    theta = {n: t.detach() for n, t in q.sample(g).items()}
    eps = torch.randn(6 * c, generator=g, dtype=F64)
    params = [*q.mean, *q.raw_std]
    got = torch.autograd.grad(ref.flat(new._matheron()(theta, eps), q.names).pow(2).sum(), params)
    want = torch.autograd.grad(_dense_update(net, new, theta, eps, x_obs, y_obs, True).pow(2).sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("c", [1, 3])
def test_monte_carlo_of_a_linear_network_matches_the_conditioned_gp(c):
    _, model = _linear_model(c)
    new = model.condition_on(*_data(5, c))
    x = torch.cat([_data(5, c)[0][:2], torch.randn(3, 2, generator=torch.Generator().manual_seed(2), dtype=F64)])
    s = 4000
    with torch.no_grad():
        exact = new(x)
        mean, cov = exact.mean.reshape(-1), exact.covariance_matrix
        draws = new.function_samples(x, s, generator=torch.Generator().manual_seed(0)).reshape(s, -1)
        predictive = new.predict(x, num_samples=50, generator=torch.Generator().manual_seed(0))
    sd = cov.diagonal().sqrt()
    assert ((draws.mean(0) - mean).abs() <= 4 * sd / s**0.5).all()
    centred = draws - draws.mean(0)
    mc_cov = centred.T @ centred / s
    se = ((cov.diagonal()[:, None] * cov.diagonal()[None, :] + cov**2) / s).sqrt()
    assert ((mc_cov - cov).abs() <= 5 * se).all()
    # the predictive (the default method): moments of the same draws, plus the noise
    first = draws[:50]
    torch.testing.assert_close(predictive.mean.reshape(-1), first.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(predictive.variance.reshape(-1), first.var(0, unbiased=False) + _noise(new).repeat(5),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("c", [1, 3])
def test_monte_carlo_of_a_nonlinear_network(c):
    from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal

    _, model = _model(c)
    with torch.no_grad():
        for t in model.variational_distribution.raw_std:
            t.sub_(2.0)  # s small enough that the network is nearly linear over q
    x_obs, y_obs = _data(4, c)
    new = model.condition_on(x_obs, y_obs)
    x = torch.cat([x_obs, torch.randn(2, 2, generator=torch.Generator().manual_seed(4), dtype=F64)])
    with torch.no_grad():
        predictive = new.predict(x, num_samples=2000, generator=torch.Generator().manual_seed(1))
        exact, prior = new(x), model(x)
    assert type(predictive) is (MultivariateNormal if c == 1 else MultitaskMultivariateNormal)
    assert predictive.mean.shape == ((6,) if c == 1 else (6, c))
    assert predictive.variance.shape == predictive.mean.shape
    error = (predictive.mean - exact.mean).abs()
    assert (error[:4] <= 0.1 * (exact.mean - prior.mean)[:4].abs() + 0.02).all()  # near the observations
    assert torch.isfinite(predictive.variance).all() and (predictive.variance > _noise(new)).all()
    assert new.function_samples(x, 3).shape == ((3, 6) if c == 1 else (3, 6, c))


def test_conditioning_leaves_the_original_monte_carlo_unchanged():
    _, model = _model(3)
    x = torch.randn(3, 2, dtype=F64)
    with torch.no_grad():
        before = model.predict(x, num_samples=5, generator=torch.Generator().manual_seed(0))
        new = model.condition_on(*_data(4, 3))
        conditioned = new.predict(x, num_samples=5, generator=torch.Generator().manual_seed(0))
        after = model.predict(x, num_samples=5, generator=torch.Generator().manual_seed(0))
    assert model.observations is None
    torch.testing.assert_close(after.mean, before.mean, rtol=0, atol=0)
    torch.testing.assert_close(after.variance, before.variance, rtol=0, atol=0)
    assert not torch.allclose(conditioned.mean, before.mean)
    assert new.predict(x, method="linearized").mean.shape == (3, 3)


@pytest.mark.parametrize("likelihood", [LogisticLikelihood, lambda: SoftmaxLikelihood(3)])
def test_classification_raises(likelihood):
    lik = likelihood().double()
    c = 3 if isinstance(lik, SoftmaxLikelihood) else 1
    model = FSVI(ref.mlp(d_in=2, width=4, d_out=c), lik)
    x = torch.randn(3, 2, dtype=F64)
    y = torch.tensor([0, 1, 0]) if c == 3 else torch.tensor([0.0, 1.0, 1.0], dtype=F64)
    with pytest.raises(NotImplementedError, match="Gaussian likelihood"):
        model.condition_on(x, y)
    with pytest.raises(NotImplementedError, match="Gaussian likelihood"):
        model.condition_on("not even a tensor", None)  # the likelihood is checked first
    assert model.observations is None


def test_invalid_observations_are_refused_and_never_modified():
    _, model = _model(3)
    x, y = _data(4, 3)
    x_before, y_before = x.clone(), y.clone()
    cases = [
        ((x.tolist(), y), TypeError, "x_new"),
        ((x.long(), y), ValueError, "x_new"),  # ids are passed as they are: this network does not take them
        ((x.to(torch.complex128), y), TypeError, "x_new"),
        ((x, y.tolist()), TypeError, "y_new"),
        ((x[0], y), ValueError, "x_new"),
        ((x[:0], y[:0]), ValueError, "x_new"),
        ((torch.where(x > 1, float("nan"), x), y), ValueError, "x_new"),
        ((x, torch.where(y > 1, float("inf"), y)), ValueError, "y_new"),
        ((x, y[:3]), ValueError, "y_new"),
        ((x, y[:, :2]), ValueError, "y_new"),
        ((torch.randn(4, 3, dtype=F64), y), ValueError, "x_new"),  # does not fit the network
        ((torch.randn(2, 4, 2, dtype=F64), y[:2]), ValueError, "x_new"),  # batch dimensions
    ]
    for (a, b), error, name in cases:
        with pytest.raises(error, match=name):
            model.condition_on(a, b)
    assert model.observations is None
    new = model.condition_on(x.float(), y)  # other floating dtypes are converted (copies)
    assert new.observations[0].dtype == F64
    x.add_(1.0)  # changing the caller's tensors afterwards does not change the model
    torch.testing.assert_close(new.observations[0], x_before.float().double(), rtol=0, atol=0)
    assert torch.equal(y, y_before)


# ---------------------------------------------------------------------- BoTorch
@pytest.mark.parametrize("c", [1, 3])
def test_botorch_condition_on_observations_and_posterior(c):
    pytest.importorskip("botorch")
    net, model = _model(c)
    x_obs, y_obs = _data(5, c)
    Y = y_obs.reshape(5, c)  # BoTorch's (n, m)
    a = model.condition_on_observations(x_obs, Y)
    b = model.condition_on(x_obs, y_obs)
    X = torch.randn(3, 2, 2, dtype=F64)  # (batch, q, d)
    with torch.no_grad():
        pa, pb = a.posterior(X), b.posterior(X)
        noisy = a.posterior(X, observation_noise=True)
    assert pa.mean.shape == (3, 2, c)
    torch.testing.assert_close(pa.mean, pb.mean, rtol=0, atol=0)
    for i in range(3):
        mean, cov = _dense_posterior(net, model, X[i], x_obs, y_obs)
        torch.testing.assert_close(pa.mean[i].reshape(-1), mean, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(pa.distribution.covariance_matrix[i], cov, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(noisy.variance - pa.variance, _noise(model).expand_as(pa.variance),
                               rtol=1e-10, atol=1e-12)


def test_botorch_fantasize_batch_shapes():
    pytest.importorskip("botorch")
    from botorch.sampling import SobolQMCNormalSampler

    net, model = _model(1)
    base = model.condition_on(*_data(4, 1))
    X = torch.randn(3, 2, 2, dtype=F64)  # (b, q, d)
    fantasy = base.fantasize(X, SobolQMCNormalSampler(torch.Size([2]), seed=0))
    assert fantasy.batch_shape == (2, 3)
    x_test = torch.randn(5, 2, dtype=F64)
    with torch.no_grad():
        post = fantasy.posterior(x_test)
    assert post.mean.shape == (2, 3, 5, 1)
    member = fantasy.members[4]  # sample 1, batch element 1: the base's 4 observations and X[1]
    x_seen, y_seen = member.observations
    assert x_seen.shape == (6, 2)
    torch.testing.assert_close(x_seen[4:], X[1], rtol=0, atol=0)
    mean, cov = _dense_posterior(net, model, x_test, x_seen, y_seen)
    torch.testing.assert_close(post.mean[1, 1, :, 0], mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(post.distribution.covariance_matrix[1, 1], cov, rtol=1e-10, atol=1e-10)
    classifier = FSVI(ref.mlp(d_in=2, width=4, d_out=1), LogisticLikelihood().double())
    with pytest.raises(NotImplementedError, match="Gaussian"):
        classifier.fantasize(X, SobolQMCNormalSampler(torch.Size([2])))


def test_factorization_is_reused_only_when_no_gradient_needs_it():
    _, model = _model(1)
    new = model.condition_on(*_data(5, 1))
    x = torch.randn(3, 2, dtype=F64, requires_grad=True)
    assert new._conditioning()[1].requires_grad and len(new._conditioning_cache) == 0  # gradients reach μ, s
    new.requires_grad_(False)  # e.g. while optimizing an acquisition function over x
    first, second = new._conditioning(), new._conditioning()
    assert first[1] is second[1] and not first[1].requires_grad
    new(x).mean.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    new(x).variance.sum().backward()  # the cached factor holds no graph: a second backward pass works
