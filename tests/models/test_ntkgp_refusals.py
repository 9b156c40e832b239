"""What NTKGP refuses or warns about instead of a silent wrong result (issue 25, items 7, 8, 10, 11, 14)."""

import copy
import unittest
import warnings

import gpytorch
import pytest
import torch
from gpytorch.test.model_test_case import BaseModelTestCase
from linear_operator.utils.warnings import NumericalWarning

import ntkgp
from tests.helpers import assert_unchanged, mlp, snapshot

D64 = torch.float64


def regression(n=20, d=3, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(n, d, dtype=D64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = 0.01
    return x, torch.sin(x.sum(-1)), likelihood


# ---------------------------------------------------------------------------------------------- item 7: tiny δ
def test_a_prior_precision_below_the_rounding_warns_and_a_sane_one_does_not():
    """δ = 1e-16 (float64): the prior is lost against the data term; the predictive stops depending on δ."""
    x, y, likelihood = regression()
    x_test = torch.randn(5, 3, dtype=D64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        sane = [ntkgp.NTKGP(mlp(), x, y, likelihood, prior_precision=1e-2, space=s).eval()(x_test) for s in
                ("weight", "function")]
    assert (sane[0].mean - sane[1].mean).abs().max() < 1e-8  # two exact forms agree
    for delta in (1e-16, 1e-30):
        model = ntkgp.NTKGP(mlp(), x, y, likelihood, prior_precision=delta).eval()
        with pytest.warns(NumericalWarning, match=r"prior is below the rounding.*prior precisions above about"):
            model(x_test)


# ---------------------------------------------------------------------------------------------- item 8: freezing
@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_freezing_a_parameter_after_construction_is_refused(change):
    x, y, likelihood = regression()
    net = mlp()
    if change == "unfreeze":
        net[0].bias.requires_grad_(False)
    model = ntkgp.NTKGP(net, x, y, likelihood).eval()
    with torch.no_grad():
        model(x[:3])
    net[0].bias.requires_grad_(change == "unfreeze")
    for call in (lambda: model(x[:3]), lambda: model.covar_module(x).to_dense(), lambda: model.mean_module(x)):
        with pytest.raises(RuntimeError, match=r"trainable parameters of net changed.*\['0.bias'\].*build a new"):
            call()
    net[0].bias.requires_grad_(change == "freeze")  # restored: usable again, equal to a fresh model
    fresh = ntkgp.NTKGP(net, x, y, likelihood).eval()
    with torch.no_grad():
        assert torch.allclose(model(x[:3]).variance, fresh(x[:3]).variance, rtol=1e-10, atol=0)


# ---------------------------------------------------------------------------------------------- item 10: half precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_networks_are_refused_at_construction(dtype):
    x, y, likelihood = regression()
    net = mlp().to(dtype)
    before = snapshot(net)
    with pytest.raises(TypeError, match=rf"net has '0.weight' of dtype {dtype}; .*float32 or float64"):
        ntkgp.NTKGP(net, x, y, likelihood)
    with pytest.raises(TypeError, match="float32 or float64"):
        ntkgp.NTKKernel(net)
    assert_unchanged(net, before)


# ---------------------------------------------------------------------------------------------- item 11: random nets
class FunctionalDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(3, 16), torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.nn.functional.dropout(torch.tanh(self.hidden(x)), p=0.5, training=True))


def test_functional_dropout_gets_the_named_random_network_error():
    x, y, likelihood = regression()
    net = FunctionalDropout().double().eval()
    state = torch.random.get_rng_state()
    with pytest.raises(ValueError, match=r"net is random: .*functional dropout.*torch.nn.Dropout"):
        ntkgp.NTKGP(net, x, y, likelihood)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global random state is left as it was
    kernel = ntkgp.NTKKernel(net)  # the kernel alone has no inputs to probe: its first Jacobian says so
    with pytest.raises(ValueError, match=r"net is random"):
        kernel(x, x).to_dense()


# ---------------------------------------------------------------------------------------------- item 14: GPyTorch's suite
class TestNTKGPWithGPyTorchModelSuite(BaseModelTestCase, unittest.TestCase):
    """GPyTorch's own model test suite. The non-batch cases pass; the batch-mode cases (a batch of independent
    training sets, ``train_x`` ``(3, 20, d)`` and ``(2, 3, 20, d)``) are refused with a ``ValueError`` naming the
    alternative: the kernel and mean are the network's, linearized at weights trained on one data set
    (docs/ntkgp.md, "Batch-mode training data")."""

    def create_model(self, train_x, train_y, likelihood):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        return ntkgp.NTKGP(net, train_x, train_y, likelihood)

    def create_test_data(self):
        return torch.linspace(0, 1, 20).unsqueeze(-1)

    def create_likelihood_and_labels(self):
        return gpytorch.likelihoods.GaussianLikelihood(), torch.sin(6 * torch.linspace(0, 1, 20))

    def create_batch_test_data(self, batch_shape=torch.Size([3])):
        return torch.linspace(0, 1, 20).expand(*batch_shape, 20).unsqueeze(-1)

    def create_batch_likelihood_and_labels(self, batch_shape=torch.Size([3])):
        likelihood = gpytorch.likelihoods.GaussianLikelihood(batch_shape=batch_shape)
        return likelihood, torch.randn(*batch_shape, 20)

    def _refused(self, case):
        with pytest.raises(ValueError, match=r"batch-mode training data.*one NTKGP per training set"):
            case()

    def test_batch_forward_train(self):
        self._refused(super().test_batch_forward_train)

    def test_multi_batch_forward_train(self):
        self._refused(super().test_multi_batch_forward_train)

    def test_batch_forward_eval(self):
        self._refused(super().test_batch_forward_eval)

    def test_multi_batch_forward_eval(self):
        self._refused(super().test_multi_batch_forward_eval)


def test_batch_mode_data_with_a_plain_likelihood_are_refused_naming_train_x():
    """(3, 20, 1) training inputs with an unbatched likelihood: read as 3 inputs of shape (20, 1), which the MLP
    cannot take: the error names train_x and the alternative."""
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.linspace(0, 1, 20).expand(3, 20).unsqueeze(-1)
    with pytest.raises(ValueError, match=r"train_x.*batch-mode training data.*IndependentModelList"):
        ntkgp.NTKGP(net, x, torch.randn(3, 20), gpytorch.likelihoods.GaussianLikelihood())
    with pytest.raises(ValueError, match=r"batch_shape=\(3,\).*batch-mode"):
        ntkgp.NTKGP(copy.deepcopy(net), x[0], torch.randn(20), gpytorch.likelihoods.GaussianLikelihood(),
                    batch_shape=torch.Size([3]))
