"""NTKGP(predictive_mean=...): "nn" is the network's output f(x*), "gp" the linearized posterior mean (dense GLM)."""

import copy

import pytest
import torch

import ntkgp
from ntkgp.models.ntkgp import DEFAULT_PREDICTIVE_MEAN
from tests.helpers import dense_glm_predictive, dense_laplace, rel_err
from tests.problems import KINDS, make_problem
from tests.models.test_ntkgp import delta_columns

DELTA = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_both_means_against_independent_computations(kind):
    net, x, y, lik, log_prob = make_problem(kind)
    x_test = torch.randn(2, 5, 3, dtype=torch.float64)  # a batch of 2 joint distributions
    mean_ref, cov_ref = dense_glm_predictive(net, x_test.reshape(-1, 3), dense_laplace(net, x, y, log_prob, delta_columns(net, DELTA)))
    with torch.no_grad():
        f = net(x_test)  # the network itself, called directly
        preds = {}
        for choice in ("gp", "nn"):
            model = ntkgp.NTKGP(copy.deepcopy(net), x, y, copy.deepcopy(lik), prior_precision=DELTA, predictive_mean=choice)
            assert model.predictive_mean == choice
            preds[choice] = model.eval()(x_test)
    c = f.shape[-1]
    shape = (2, 5) if c == 1 else (2, 5, c)
    assert preds["nn"].mean.shape == shape and preds["gp"].mean.shape == shape
    assert rel_err(preds["nn"].mean, f.reshape(shape)) < 1e-12
    assert rel_err(preds["gp"].mean.reshape(-1), mean_ref) < 1e-8
    # the network output is not the linearized posterior mean here (θ* is no MAP of these hyperparameters)
    assert rel_err(preds["gp"].mean, preds["nn"].mean) > 1e-3
    # the covariance does not depend on the choice
    assert torch.equal(preds["nn"].covariance_matrix, preds["gp"].covariance_matrix)
    cov = preds["nn"].covariance_matrix
    k = 5 * c
    assert rel_err(cov[0], cov_ref[:k, :k]) < 1e-8 and rel_err(cov[1], cov_ref[k:, k:]) < 1e-8


@pytest.mark.parametrize("kind", ["regression1", "softmax4"])
def test_option_is_validated_before_anything_is_computed(kind):
    net, x, y, lik, _ = make_problem(kind)
    calls = []
    handle = net.register_forward_hook(lambda *args: calls.append(1))
    for bad in ("network", "GP", None, 1):
        with pytest.raises(ValueError, match="predictive_mean"):
            ntkgp.NTKGP(net, x, y, lik, predictive_mean=bad)
    assert not calls
    handle.remove()
    model = ntkgp.NTKGP(net, x, y, lik)
    assert model.predictive_mean == DEFAULT_PREDICTIVE_MEAN
    with pytest.raises(ValueError, match="predictive_mean"):
        model.predictive_mean = "linearized"
    assert model.predictive_mean == DEFAULT_PREDICTIVE_MEAN


@pytest.mark.parametrize("kind", ["regression2", "binary"])
def test_setter_and_conditioning_keep_the_choice(kind):
    net, x, y, lik, _ = make_problem(kind, n=16)
    model = ntkgp.NTKGP(net, x[:10], y[:10], lik, prior_precision=DELTA, predictive_mean="gp").eval()
    x_test = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        gp_before = model(x_test).mean
        model.predictive_mean = "nn"
        nn_before = model(x_test)
        assert rel_err(nn_before.mean, net(x_test).squeeze(-1)) < 1e-12 and rel_err(gp_before, nn_before.mean) > 1e-3
        updated = model.condition_on(x[10:], y[10:])
        after = updated(x_test)
    # "nn": conditioning moves the covariance only; the mean stays the network's output
    assert updated.predictive_mean == "nn"
    assert torch.equal(after.mean, nn_before.mean)
    assert (after.variance < nn_before.variance).all()
    updated.predictive_mean = "gp"
    with torch.no_grad():
        union = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA, predictive_mean="gp").eval()
        if kind.startswith("regression"):  # exact: the model on the union
            assert rel_err(updated(x_test).mean, union(x_test).mean) < 1e-10


def test_input_gradients_of_the_network_mean():
    net, x, y, lik, _ = make_problem("softmax4")
    model = ntkgp.NTKGP(net, x, y, lik, predictive_mean="nn").eval()
    x_test = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(model(x_test).mean.pow(2).sum(), x_test)
    (ref,) = torch.autograd.grad(net(x_test).pow(2).sum(), x_test)
    assert rel_err(grad, ref) < 1e-12


def test_float32_network():
    net, x, y, lik, _ = make_problem("binary")
    net = copy.deepcopy(net).float()
    model = ntkgp.NTKGP(net, x, y, lik.float(), predictive_mean="nn").eval()
    x_test = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        mean = model(x_test).mean
        direct = net(x_test.float()).squeeze(-1)
        # the engine's forward and the module's call: the same float32 operations, possibly summed in another order;
        # each output of this depth-2 MLP is a sum of at most `width` products per layer, so the two differ by at most
        # γ_w Σ|terms| ≤ w ε |W||h| (bounded here by w ε times the outputs' scale plus one)
        width = max(p.shape[-1] for p in net.parameters() if p.dim() == 2)
        tolerance = width * torch.finfo(torch.float32).eps * (1 + direct.abs().max())
        assert mean.dtype == torch.float32 and (mean - direct).abs().max() <= tolerance
