"""NTKGP's options after construction beyond the generated sweep (tests/test_option_attributes.py): one storage
for the kernel's options, conditioning with the current options, the engine rebuilt for a new strategy."""

import gpytorch
import pytest
import torch

import ntkgp
from tests.helpers import mlp

D64 = torch.float64


def problem():
    torch.manual_seed(0)
    x = torch.randn(12, 3, dtype=D64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = 0.05
    return x, torch.sin(x.sum(-1)), likelihood, torch.randn(4, 3, dtype=D64)


def predict(model, x):
    with torch.no_grad():
        pred = model.eval()(x)
        return pred.mean, pred.variance


def test_kernel_options_have_one_storage():
    """``model.space`` is ``model.covar_module.space``: assigned on either, read on both, seen by the predictive."""
    x, y, likelihood, x_test = problem()
    model = ntkgp.NTKGP(mlp(), x, y, likelihood, space="function")
    predict(model, x_test)
    model.covar_module.space = "weight"  # on the kernel directly
    assert model.space == "weight" and model.site_posterior().space == "weight"
    fresh = ntkgp.NTKGP(mlp(), x, y, likelihood, space="weight")
    for a, b in zip(predict(model, x_test), predict(fresh, x_test)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    model.space = ntkgp.options.Space.FUNCTION  # on the model, as the enum member
    assert model.covar_module.space == "function" and model.site_posterior().space == "function"


def test_condition_on_copies_the_current_options():
    x, y, likelihood, x_test = problem()
    model = ntkgp.NTKGP(mlp(), x[:8], y[:8], likelihood)
    model.predictive_mean, model.space, model.chunk_size, model.prediction_chunk_size = "nn", "weight", 3, 2
    updated = model.condition_on(x[8:], y[8:])
    assert (updated.predictive_mean, updated.space, updated.chunk_size, updated.prediction_chunk_size) == (
        "nn", "weight", 3, 2
    )
    fresh = ntkgp.NTKGP(mlp(), x, y, likelihood, predictive_mean="nn", space="weight", chunk_size=3,
                        prediction_chunk_size=2)
    for a, b in zip(predict(updated, x_test), predict(fresh, x_test)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_a_new_strategy_rebuilds_the_engine_and_the_means_follow():
    x, y, likelihood, x_test = problem()
    model = ntkgp.NTKGP(mlp(), x, y, likelihood, strategy="structured")
    predict(model, x_test)
    old = model.covar_module.engine
    model.strategy = "contraction"
    engine = model.covar_module.engine
    assert engine is not old and engine.strategy == "contraction"
    assert model.mean_module.engine is engine and engine.net is old.net
    assert len(model.covar_module._cache) == 0  # nothing computed by the old engine is served


def test_fixed_options_say_to_build_a_new_model():
    x, y, likelihood, _ = problem()
    model = ntkgp.NTKGP(mlp(), x, y, likelihood)
    with pytest.raises(AttributeError, match=r"NTKGP.prior_structure cannot be changed.*build a new ExactNTKGP"):
        model.prior_structure = "network"
    with pytest.raises(AttributeError, match=r"NTKKernel.input_shape cannot be changed.*build a new NTKKernel"):
        model.covar_module.input_shape = (3,)
    model.prior_structure = "layer"  # its own value: accepted
