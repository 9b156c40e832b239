"""FSVI as a GPyTorch model: the linearized GP against dense Jacobians, the Monte Carlo predictive, state."""

from __future__ import annotations

import copy

import pytest
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import GaussianLikelihood, MultitaskGaussianLikelihood
from torch.func import functional_call

from ntkgp.fsvi import FSVI
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood

from . import reference as ref


def _perturbed(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m, t in zip(model.variational_distribution.mean, model.variational_distribution.raw_std):
            m.add_(0.3 * torch.randn(m.shape, generator=g, dtype=m.dtype))
            t.copy_(-1.0 + 0.5 * torch.randn(t.shape, generator=g, dtype=t.dtype))
    return model


def _dense(net, model, x1, x2=None):
    q = model.variational_distribution
    mu = {n: t.detach() for n, t in q.means().items()}
    var = {n: t.detach() for n, t in q.variances().items()}
    return functional_call(net, mu, (x1,)), ref.covariance(net, mu, var, q.names, x1, x2)


@pytest.mark.parametrize("c", [1, 3])
def test_linearized_gp_equals_dense(c):
    net = ref.mlp(d_in=2, width=5, d_out=c)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    lik = GaussianLikelihood().double() if c == 1 else MultitaskGaussianLikelihood(c, rank=0).double()
    model = _perturbed(FSVI(net, lik)).eval()
    x, x2 = torch.randn(5, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    mean, cov = _dense(net, model, x)
    with torch.no_grad():
        dist = model(x)
        assert isinstance(dist, MultivariateNormal if c == 1 else MultitaskMultivariateNormal)
        torch.testing.assert_close(dist.mean, mean.squeeze(-1) if c == 1 else mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dist.variance.reshape(-1), cov.diagonal(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(dist.covariance_matrix, cov, rtol=1e-10, atol=1e-12)
        cross = model.covar_module(x, x2).to_dense()
        torch.testing.assert_close(cross, _dense(net, model, x, x2)[1], rtol=1e-10, atol=1e-12)
        predictive = model.predict(x, method="linearized")
        noise = model.likelihood.noise.reshape(-1)
        if c > 1:  # GPyTorch: task noises plus the global noise
            noise = model.likelihood.task_noises + noise
        torch.testing.assert_close(predictive.variance.reshape(-1), cov.diagonal() + noise.repeat(5), rtol=1e-10, atol=0)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


def test_gradients_flow_to_inputs_and_variational_parameters():
    net = ref.mlp(d_in=2, width=4, d_out=1)
    model = _perturbed(FSVI(net, GaussianLikelihood().double()))
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    dist = model(x)
    (dist.mean.sum() + dist.variance.sum()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(t.grad is not None for t in model.variational_distribution.raw_std)
    assert net[0].weight.grad is None  # the network is not touched


@pytest.mark.parametrize("kind", ["logistic", "softmax", "gaussian"])
def test_monte_carlo_predictive(kind):
    c = 3 if kind == "softmax" else 1
    net = ref.mlp(d_in=2, width=4, d_out=c)
    lik = {"logistic": LogisticLikelihood, "softmax": lambda: SoftmaxLikelihood(3),
           "gaussian": GaussianLikelihood}[kind]().double()
    model = _perturbed(FSVI(net, lik))
    x = torch.randn(4, 2, dtype=torch.float64)
    with torch.no_grad():
        pred = model.predict(x, method="mc", num_samples=7, generator=torch.Generator().manual_seed(5))
    f = ref.mean_field_draws(net, model.variational_distribution, x, 7, seed=5)
    if kind == "logistic":
        torch.testing.assert_close(pred.probs, torch.sigmoid(f[..., 0]).mean(0), rtol=1e-12, atol=1e-12)
    elif kind == "softmax":
        torch.testing.assert_close(pred.probs, torch.softmax(f, -1).mean(0), rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(pred.mean, f[..., 0].mean(0), rtol=1e-12, atol=1e-12)
        expected = f[..., 0].var(0, unbiased=False) + model.likelihood.noise.reshape(-1)
        torch.testing.assert_close(pred.variance, expected, rtol=1e-12, atol=1e-12)


def test_images_are_flattened_for_gpytorch():
    net = ref.small_cnn(3)
    model = _perturbed(FSVI(net, SoftmaxLikelihood(3).double(), init_std=0.1))
    x = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        dist = model(x)
        flat = model(x.flatten(1))
    mean, cov = _dense(net, model, x)
    torch.testing.assert_close(dist.mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(flat.covariance_matrix, cov, rtol=1e-10, atol=1e-12)
    probs = model.predict(x, method="linearized").probs
    assert probs.shape == (4, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=torch.float64))


def test_state_holds_variational_parameters_not_the_network():
    net = ref.mlp(d_in=2, width=4, d_out=1)
    model = FSVI(net, GaussianLikelihood().double())
    keys = set(model.state_dict())
    assert not any(k.startswith(("0.", "2.", "4.")) for k in keys)
    assert {"variational_distribution.mean.0", "variational_distribution.raw_std.0", "prior.prior_precision"} <= keys
    names = {n for n, _ in model.named_parameters()}
    variational = {n for n, _ in model.named_variational_parameters()}
    assert variational == {n for n in names if n.startswith("variational_distribution.")} and len(variational) == 12
    assert {n for n, _ in model.named_hyperparameters()} == names - variational == {"likelihood.noise_covar.raw_noise"}
    twin = copy.deepcopy(model)
    assert twin.net is net  # the network is shared, never copied
    with torch.no_grad():
        twin.variational_distribution.raw_std[0].fill_(0.0)
        x = torch.randn(3, 2, dtype=torch.float64)
        assert not torch.allclose(twin(x).variance, model(x).variance)


def test_float32():
    net = ref.mlp(d_in=2, width=8, d_out=3, dtype=torch.float32)
    model = FSVI(net, SoftmaxLikelihood(3), init_std=0.05)
    x = torch.randn(5, 2)
    with torch.no_grad():
        dist = model(x)
        assert dist.mean.dtype == torch.float32 and (dist.variance > 0).all()
        kl = model.function_space_kl(torch.randn(6, 2))
    assert torch.isfinite(kl) and kl.dtype == torch.float32


def test_errors_name_the_argument():
    net = ref.mlp()
    with pytest.raises(TypeError, match="likelihood"):
        FSVI(net, "gaussian")
    with pytest.raises(ValueError, match="prior_precision"):
        FSVI(net, GaussianLikelihood(), prior_precision=-1.0)
    with pytest.raises(ValueError, match="prior_precision"):
        FSVI(net, GaussianLikelihood(), prior_precision=torch.ones(5))
    with pytest.raises(ValueError, match="prior_structure"):
        FSVI(net, GaussianLikelihood(), prior_structure="block")
    with pytest.raises(ValueError, match="prior_mean"):
        FSVI(net, GaussianLikelihood(), prior_mean="random")
    with pytest.raises(ValueError, match="prior_mean"):
        FSVI(net, GaussianLikelihood(), prior_mean={"0.weight": torch.zeros(6, 3)})
    with pytest.raises(ValueError, match="prior_linearization"):
        FSVI(net, GaussianLikelihood(), prior_linearization="data")
    with pytest.raises(ValueError, match="init_std"):
        FSVI(net, GaussianLikelihood(), init_std=0.0)
    model = FSVI(net, GaussianLikelihood().double())
    with pytest.raises(ValueError, match="method"):
        model.predict(torch.randn(2, 3, dtype=torch.float64), method="exact")
    with pytest.raises(ValueError, match="num_samples"):
        model.predict(torch.randn(2, 3, dtype=torch.float64), num_samples=0)


def test_inputs_on_the_meta_device_are_refused_naming_the_argument():
    """A meta tensor (shapes, no values) reached torch's "Tensor.item() cannot be called on meta tensors"."""
    model = FSVI(ref.mlp(), GaussianLikelihood().double())
    meta = torch.zeros(4, 3, dtype=torch.float64, device="meta")
    calls = {"x": lambda: model(meta), "x_context": lambda: model.function_space_kl(meta),
             "x_new": lambda: model.condition_on(meta, torch.zeros(4, dtype=torch.float64))}
    for argument, call in calls.items():
        with pytest.raises(ValueError, match=f"^{argument} is on the meta device"):
            call()
    with pytest.raises(ValueError, match="meta device"):
        model.predict(meta)


def test_prior_precision_bool_refused_and_user_tensor_not_shared():
    from ntkgp.fsvi.prior import GaussianParameterPrior

    net = ref.mlp()
    with pytest.raises(TypeError, match="prior_precision"):
        FSVI(net, GaussianLikelihood(), prior_precision=True)
    prior = GaussianParameterPrior(net, prior_precision=1.0, prior_structure="layer")
    delta = torch.full((len(prior.prior_precision),), 2.0, dtype=torch.float64)
    kept = delta.clone()
    prior = GaussianParameterPrior(net, prior_precision=delta, prior_structure="layer")
    prior.prior_precision.mul_(3.0)  # the prior's state is its own copy
    assert torch.equal(delta, kept)
    delta.fill_(5.0)  # and the user's later changes do not reach it
    assert torch.equal(prior.prior_precision, torch.full_like(kept, 6.0))
