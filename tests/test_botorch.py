"""BoTorch adapter (ntkgp/botorch.py): NTKGP and SFR as BoTorch models, acquisition values by hand."""

import math
import subprocess
import sys

import gpytorch
import pytest
import torch

import ntkgp

botorch = pytest.importorskip("botorch")
from botorch.acquisition import LogExpectedImprovement, UpperConfidenceBound, qLogNoisyExpectedImprovement  # noqa: E402
from botorch.acquisition.objective import ScalarizedPosteriorTransform  # noqa: E402
from botorch.optim import optimize_acqf  # noqa: E402
from botorch.posteriors.gpytorch import GPyTorchPosterior  # noqa: E402
from botorch.sampling import SobolQMCNormalSampler  # noqa: E402

D = 2


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def problem(c=1, n=15, seed=0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(D, 12), torch.nn.Tanh(), torch.nn.Linear(12, c)).double()
    x = torch.rand(n, D, dtype=torch.float64, generator=gen)
    y = torch.sin(3 * x).sum(-1, keepdim=True).expand(n, c) + 0.05 * torch.randn(n, c, dtype=torch.float64, generator=gen)
    if c == 1:
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = 0.01
        y = y.squeeze(-1)
    else:
        lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=c, has_global_noise=False).double()
        lik.task_noises = torch.full((c,), 0.01, dtype=torch.float64)
    return net, x, y, lik


def make(kind, c=1, n=15, seed=0):
    net, x, y, lik = problem(c, n, seed)
    if kind == "ntkgp":
        return ntkgp.NTKGP(net, x, y, lik, prior_precision=1.0).eval()
    return ntkgp.SFR(net, x, y, lik, num_inducing=10, prior_precision=1.0).eval()


def dense_gp(model, X):
    """Exact GP posterior of the linearized network from dense kernel matrices (independent of the model's algebra)."""
    k = model.covar_module
    xt, yt = model.train_x, model.train_y.reshape(-1)
    m = lambda z: model.mean_module.values(z).reshape(-1)  # noqa: E731
    kxx = k(xt).to_dense() + model.likelihood.noise.detach() * torch.eye(len(yt), dtype=torch.float64)
    ksx = k(X, xt).to_dense()
    mean = m(X) + ksx @ torch.linalg.solve(kxx, yt - m(xt))
    cov = k(X).to_dense() - ksx @ torch.linalg.solve(kxx, ksx.T)
    return mean, cov


@pytest.mark.parametrize("kind", ["ntkgp", "sfr"])
def test_posterior_is_a_gpytorch_posterior_with_botorch_shapes(kind):
    model = make(kind, c=2)
    X = torch.rand(4, 3, D, dtype=torch.float64)
    post = model.posterior(X)
    assert isinstance(post, GPyTorchPosterior)
    assert post.mean.shape == (4, 3, 2) and post.variance.shape == (4, 3, 2)
    dist = model(X)
    assert rel_err(post.mean, dist.mean) < 1e-12 and (post.variance > 0).all()
    assert model.num_outputs == 2 and model.batch_shape == torch.Size([])
    # output_indices: the second output's joint distribution
    one = model.posterior(X, output_indices=[1])
    assert one.mean.shape == (4, 3, 1)
    assert rel_err(one.mean[..., 0], dist.mean[..., 1]) < 1e-12
    rows = torch.arange(3) * 2 + 1
    assert rel_err(one.distribution.covariance_matrix, dist.covariance_matrix[:, rows][:, :, rows]) < 1e-10
    # observation noise: True adds the likelihood's, a tensor adds its own
    noisy = model.posterior(X, observation_noise=True)
    assert rel_err(noisy.variance - post.variance, torch.full((4, 3, 2), 0.01, dtype=torch.float64)) < 1e-10
    given = torch.full((4, 3, 2), 0.2, dtype=torch.float64)
    assert rel_err(model.posterior(X, observation_noise=given).variance - post.variance, given) < 1e-10
    # posterior_transform: hand-weighted mean and variance of w·f
    w = torch.tensor([0.7, -1.3], dtype=torch.float64)
    scal = model.posterior(X, posterior_transform=ScalarizedPosteriorTransform(w))
    cov = dist.covariance_matrix  # (4, 6, 6), interleaved
    W = torch.kron(torch.eye(3, dtype=torch.float64), w[None])  # (3, 6)
    assert rel_err(scal.mean[..., 0], dist.mean @ w) < 1e-10
    assert rel_err(scal.variance[..., 0], torch.diagonal(W @ cov @ W.T, dim1=-2, dim2=-1)) < 1e-10


def test_ntkgp_posterior_equals_a_dense_gp():
    model = make("ntkgp")
    X = torch.rand(5, D, dtype=torch.float64)
    mean, cov = dense_gp(model, X)
    with torch.no_grad():
        post = model.posterior(X)
    assert rel_err(post.mean.squeeze(-1), mean) < 1e-10
    assert rel_err(post.distribution.covariance_matrix, cov) < 1e-8


@pytest.mark.parametrize("kind", ["ntkgp", "sfr"])
def test_analytic_acquisitions_equal_hand_computation_with_input_gradients(kind):
    model = make(kind)
    X = torch.rand(6, 1, D, dtype=torch.float64).requires_grad_(True)
    post = model.posterior(X)
    mu, sigma = post.mean[..., 0, 0], post.variance[..., 0, 0].sqrt()
    ucb = UpperConfidenceBound(model, beta=2.5)(X)
    assert rel_err(ucb, mu + math.sqrt(2.5) * sigma) < 1e-8
    best = mu.detach().median()  # EI not in its far tail, where the closed form underflows
    normal = torch.distributions.Normal(torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64))
    z = (mu - best) / sigma
    ei = sigma * (z * normal.cdf(z) + normal.log_prob(z).exp())
    log_ei = LogExpectedImprovement(model, best_f=best)(X)
    assert rel_err(log_ei, ei.log()) < 1e-8
    (grad,) = torch.autograd.grad(log_ei.sum() + ucb.sum(), X)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_ucb_on_ntkgp_equals_the_dense_gp():
    model = make("ntkgp")
    X = torch.rand(4, 1, D, dtype=torch.float64)
    mean, cov = dense_gp(model, X.reshape(4, D))
    with torch.no_grad():
        ucb = UpperConfidenceBound(model, beta=4.0)(X)
    assert rel_err(ucb, mean + 2.0 * cov.diagonal().sqrt()) < 1e-8


@pytest.mark.parametrize("kind", ["ntkgp", "sfr"])
def test_optimize_acqf_runs_with_gradients(kind):
    model = make(kind)
    bounds = torch.tensor([[0.0] * D, [1.0] * D], dtype=torch.float64)
    torch.manual_seed(1)
    for acqf, q in [
        (LogExpectedImprovement(model, best_f=0.5), 1),
        (UpperConfidenceBound(model, beta=2.0), 1),
        (
            qLogNoisyExpectedImprovement(
                model, X_baseline=torch.rand(5, D, dtype=torch.float64), sampler=SobolQMCNormalSampler(torch.Size([32])), cache_root=False
            ),
            2,
        ),
    ]:
        candidate, value = optimize_acqf(acqf, bounds=bounds, q=q, num_restarts=2, raw_samples=16)
        assert candidate.shape == (q, D) and torch.isfinite(value).all()
        assert ((candidate >= 0) & (candidate <= 1)).all()


@pytest.mark.parametrize("kind", ["ntkgp", "sfr"])
def test_condition_on_observations_is_condition_on_or_update(kind):
    model = make(kind)
    X = torch.rand(3, D, dtype=torch.float64)
    Y = torch.randn(3, 1, dtype=torch.float64)
    Xt = torch.rand(4, D, dtype=torch.float64)
    n0, before = model.num_data, model.posterior(Xt).mean
    new = model.condition_on_observations(X, Y)
    assert new is not model and model.num_data == n0 and new.num_data == n0 + 3
    assert rel_err(model.posterior(Xt).mean, before) < 1e-14  # the model itself is unchanged
    ref = model.condition_on(X, Y.squeeze(-1)) if kind == "ntkgp" else model.update(X, Y.squeeze(-1))
    assert rel_err(new.posterior(Xt).mean, ref.posterior(Xt).mean) < 1e-12
    assert rel_err(new.posterior(Xt).variance, ref.posterior(Xt).variance) < 1e-12


@pytest.mark.parametrize("kind", ["ntkgp", "sfr"])
def test_fantasize_has_the_sampler_batch_shape(kind):
    model = make(kind)
    X = torch.rand(2, D, dtype=torch.float64)
    sampler = SobolQMCNormalSampler(torch.Size([3]), seed=0)
    fantasy = model.fantasize(X, sampler)
    assert fantasy.batch_shape == torch.Size([3])
    Xt = torch.rand(4, D, dtype=torch.float64)
    post = fantasy.posterior(Xt)
    assert post.mean.shape == (3, 4, 1)
    # member 1 = conditioning on its own fantasy observations
    Y = sampler(model.posterior(X, observation_noise=True))
    ref = model.condition_on_observations(X, Y[1])
    assert rel_err(post.mean[1], ref.posterior(Xt).mean) < 1e-10
    assert rel_err(post.variance[1], ref.posterior(Xt).variance) < 1e-10


def test_as_botorch_is_a_botorch_model():
    from botorch.models.model import Model

    model = make("ntkgp")
    wrapped = ntkgp.botorch.as_botorch(model)
    assert isinstance(wrapped, Model) and wrapped.num_outputs == 1
    X = torch.rand(2, 1, D, dtype=torch.float64)
    assert rel_err(wrapped.posterior(X).mean, model.posterior(X).mean) < 1e-12


def test_core_imports_without_botorch():
    code = (
        "import sys; sys.modules['botorch'] = None\n"
        "import ntkgp, ntkgp.botorch, torch, gpytorch\n"
        "net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()\n"
        "x = torch.rand(5, 2, dtype=torch.float64); y = x.sum(-1)\n"
        "m = ntkgp.NTKGP(net, x, y, gpytorch.likelihoods.GaussianLikelihood().double()).eval()\n"
        "assert m(x).mean.shape == (5,)\n"
        "try:\n    m.posterior(x)\nexcept ImportError as e:\n    assert 'ntkgp[botorch]' in str(e); print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _fsvi(c=1):
    from ntkgp.fsvi import FSVI

    net, _, _, lik = problem(c)
    return FSVI(net, lik, prior_precision=1.0, init_std=0.1).eval()


@pytest.mark.parametrize("kind", ["ntkgp", "fsvi"])
def test_knowledge_gradient_gradients_equal_finite_differences(kind):
    """qKnowledgeGradient differentiates through the fantasy models (BoTorch's propagate_grads): the gradient
    w.r.t. the candidate and the fantasy solutions equals central finite differences."""
    from botorch.acquisition import qKnowledgeGradient

    model = make("ntkgp") if kind == "ntkgp" else _fsvi()
    acq = qKnowledgeGradient(model, num_fantasies=2, sampler=SobolQMCNormalSampler(torch.Size([2]), seed=0))
    X = torch.rand(1, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    Xg = X.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(acq(Xg).sum(), Xg)
    # central differences: truncation O(eps²) ≈ 1e-8 relative; the solves' rounding (≈ 1e-12) divided by eps stays below
    eps, fd = 1e-4, torch.zeros_like(X)
    with torch.no_grad():
        for i in range(3):
            for d in range(D):
                e = torch.zeros_like(X)
                e[0, i, d] = eps
                fd[0, i, d] = (acq(X + e) - acq(X - e)).sum() / (2 * eps)
    torch.testing.assert_close(grad, fd, rtol=1e-5, atol=1e-8)
    assert grad[0, 0].abs().max() > 1e-6  # the candidate's own gradient is not zero


def test_sfr_refuses_to_condition_on_inputs_that_require_grad():
    """SFR.update sums its statistics without a graph: conditioning on X that requires grad would give zero
    gradients w.r.t. X, so it raises (before anything is built) instead."""
    model = make("sfr")
    X = torch.rand(2, D, dtype=torch.float64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="not differentiable in the new inputs"):
        model.condition_on_observations(X, torch.randn(2, 1, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="not differentiable in the new inputs"):
        model.fantasize(X, SobolQMCNormalSampler(torch.Size([2]), seed=0))
    new = model.condition_on_observations(X.detach(), torch.randn(2, 1, dtype=torch.float64))  # detached: fine
    assert new.num_data == model.num_data + 2


def test_fsvi_posterior_samples_in_float64():
    """FSVI's kernel has no parameters of its own: its dtype is the variational parameters' (GPyTorch's base
    samples follow it), so rsample and Thompson sampling work on a float64 model."""
    from botorch.generation.sampling import MaxPosteriorSampling

    model = _fsvi()
    assert model.covar_module.dtype == torch.float64
    X = torch.rand(4, 2, D, dtype=torch.float64)
    post = model.posterior(X)
    samples = post.rsample(torch.Size([4000]))
    assert samples.shape == (4000, 4, 2, 1) and samples.dtype == torch.float64
    assert ((samples.mean(0) - post.mean).abs() / post.variance.sqrt()).max() < 0.1  # 4000 draws: SE ≈ 0.016 std
    chosen = MaxPosteriorSampling(model, replacement=False)(torch.rand(10, D, dtype=torch.float64), num_samples=2)
    assert chosen.shape == (2, D)
