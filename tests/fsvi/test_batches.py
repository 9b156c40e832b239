"""FSVI under GPyTorch's batch convention: ``model(x)`` for ``x`` of shape ``(*batch, n, d)``, against dense
Jacobians of every batch element (autograd), input gradients, images, and inputs checked before any change."""

from __future__ import annotations

import pytest
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from torch.func import functional_call

from ntkgp.fsvi import FSVI
from ntkgp.likelihoods import SoftmaxLikelihood

from . import reference as ref
from .test_conditioning import _dense_posterior, _likelihood, _model
from .test_model import _perturbed

F64 = torch.float64


def _weights(model):
    q = model.variational_distribution
    return ({n: t.detach() for n, t in q.means().items()}, {n: t.detach() for n, t in q.variances().items()}, q.names)


@pytest.mark.parametrize("c", [1, 3])
def test_batched_inputs_equal_dense_per_element(c):
    net, model = _model(c)
    mu, var, names = _weights(model)
    x = torch.randn(2, 3, 4, 2, dtype=F64)
    with torch.no_grad():
        dist = model(x)
        assert isinstance(dist, MultivariateNormal if c == 1 else MultitaskMultivariateNormal)
        assert dist.batch_shape == (2, 3)
        assert dist.mean.shape == ((2, 3, 4) if c == 1 else (2, 3, 4, c))
        variance, covariance = dist.variance, dist.covariance_matrix  # the lazy diagonal, then the dense matrix
    for i in range(2):
        for j in range(3):
            mean = functional_call(net, mu, (x[i, j],))
            cov = ref.covariance(net, mu, var, names, x[i, j])
            torch.testing.assert_close(dist.mean[i, j].reshape(-1), mean.reshape(-1), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(covariance[i, j], cov, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(variance[i, j].reshape(-1), cov.diagonal(), rtol=1e-10, atol=1e-12)


def test_cross_covariance_broadcasts_batch_shapes():
    net, model = _model(3)
    mu, var, names = _weights(model)
    x1, x2 = torch.randn(2, 1, 3, 2, dtype=F64), torch.randn(4, 5, 2, dtype=F64)
    with torch.no_grad():
        cross = model.covar_module(x1, x2).to_dense()
    assert cross.shape == (2, 4, 9, 15)
    for i in range(2):
        for j in range(4):
            torch.testing.assert_close(cross[i, j], ref.covariance(net, mu, var, names, x1[i, 0], x2[j]),
                                       rtol=1e-10, atol=1e-12)


def test_slices_longer_than_a_chunk():
    net, model = _model(1)
    model.linearized.chunk_size = 2  # each element by chunks of rows
    mu, var, names = _weights(model)
    x = torch.randn(2, 5, 2, dtype=F64)
    with torch.no_grad():
        covariance = model(x).covariance_matrix
    for i in range(2):
        torch.testing.assert_close(covariance[i], ref.covariance(net, mu, var, names, x[i]), rtol=1e-10, atol=1e-12)


def test_input_gradients_of_a_batch_equal_dense():
    net, model = _model(3)
    mu, var, names = _weights(model)
    x = torch.randn(2, 3, 2, dtype=F64, requires_grad=True)
    dist = model(x)
    (dist.mean.square().sum() + dist.variance.sum() + dist.covariance_matrix[..., 0, 1:].sum()).backward()
    x_ref = x.detach().clone().requires_grad_()
    total = 0
    for i in range(2):
        mean = functional_call(net, mu, (x_ref[i],))
        cov = ref.covariance(net, mu, var, names, x_ref[i], create_graph=True)
        total = total + mean.square().sum() + cov.diagonal().sum() + cov[0, 1:].sum()
    total.backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-9, atol=1e-12)


def test_conditioned_model_on_a_batch():
    net, model = _model(1)
    x_obs = torch.randn(4, 2, dtype=F64)
    y_obs = torch.randn(4, dtype=F64)
    new = model.condition_on(x_obs, y_obs)
    x = torch.randn(3, 2, 2, dtype=F64)
    with torch.no_grad():
        dist = new(x)
        variance, covariance = dist.variance, dist.covariance_matrix
    for i in range(3):
        mean, cov = _dense_posterior(net, model, x[i], x_obs, y_obs)
        torch.testing.assert_close(dist.mean[i], mean, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(covariance[i], cov, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(variance[i], cov.diagonal(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("c", [1, 3])
def test_monte_carlo_predictive_on_a_batch(c):
    net, model = _model(c)
    x = torch.randn(2, 4, 2, dtype=F64)
    with torch.no_grad():
        pred = model.predict(x, method="mc", num_samples=6, generator=torch.Generator().manual_seed(2))
    f = ref.mean_field_draws(net, model.variational_distribution, x.reshape(8, 2), 6, seed=2).reshape(6, 2, 4, c)
    noise = model.likelihood.noise.reshape(-1) if c == 1 else model.likelihood.task_noises + model.likelihood.noise
    with torch.no_grad():
        torch.testing.assert_close(pred.mean.reshape(2, 4, c), f.mean(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pred.variance.reshape(2, 4, c), f.var(0, unbiased=False) + noise,
                                   rtol=1e-12, atol=1e-12)


def test_batches_of_images():
    net = ref.small_cnn(3)
    model = _perturbed(FSVI(net, SoftmaxLikelihood(3).double(), init_std=0.1, input_shape=(1, 6, 6)))
    mu, var, names = _weights(model)
    x = torch.randn(2, 3, 1, 6, 6, dtype=F64)
    with torch.no_grad():
        dist, flat = model(x), model(x.flatten(-3))
        probs = model.predict(x, method="mc", num_samples=3).probs
    assert dist.mean.shape == (2, 3, 3) and probs.shape == (2, 3, 3)
    for i in range(2):
        torch.testing.assert_close(dist.covariance_matrix[i], ref.covariance(net, mu, var, names, x[i]),
                                   rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(flat.covariance_matrix, dist.covariance_matrix, rtol=0, atol=0)


def test_input_shape_is_inferred_only_from_inputs_that_fit():
    net = ref.small_cnn(3)
    model = _perturbed(FSVI(net, SoftmaxLikelihood(3).double(), init_std=0.1))
    with pytest.raises(ValueError, match="x of shape"):
        model(torch.randn(4, 5, 7, dtype=F64))  # neither rows nor images this network takes
    assert model.linearized.input_shape is None  # nothing changed
    x = torch.randn(4, 1, 6, 6, dtype=F64)
    with torch.no_grad():
        assert model(x).mean.shape == (4, 3)
    assert model.linearized.input_shape == (1, 6, 6)
    with pytest.raises(ValueError, match=r"x must have shape \(\*batch, N, 36\)"):
        model(torch.randn(4, 1, 5, 5, dtype=F64))


def test_a_batch_of_flat_inputs_does_not_fix_an_input_shape():
    net, model = _model(1)
    with torch.no_grad():
        model(torch.randn(3, 4, 2, dtype=F64))
    assert model.linearized.input_shape is None


def test_context_points_take_no_batch_dimensions():
    _, model = _model(1)
    with pytest.raises(ValueError, match="x_context must have shape"):
        model.function_space_kl(torch.randn(2, 4, 2, dtype=F64))


def test_float32_batch():
    net = ref.mlp(d_in=2, width=8, d_out=3, dtype=torch.float32)
    model = FSVI(net, _likelihood(3).float(), init_std=0.05)
    with torch.no_grad():
        dist = model(torch.randn(2, 5, 2))
    assert dist.mean.dtype == torch.float32 and (dist.variance > 0).all() and dist.variance.shape == (2, 5, 3)
