"""docs/ntkgp.md and docs/ntk.md, claim by claim (issue 15's errata): each test fails if the page is wrong."""

import copy

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from tests.helpers import float32_gram_tolerance, float32_laplace_tolerances, mlp, rel_err
from tests.problems import make_problem


@pytest.mark.parametrize("kind", ["binary", "softmax4"])
def test_mc_class_probabilities_for_both_classification_likelihoods(kind):
    """"`link_approx="mc"` for `LogisticLikelihood` and `SoftmaxLikelihood` alike": against torch.distributions."""
    net, x, y, lik, _ = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    x_test = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():
        pred = model(x_test)
        probs = model.likelihood(pred, link_approx="mc", num_samples=20000,
                                 generator=torch.Generator().manual_seed(1))
        probs = probs.probs
        c = model.num_outputs
        mean = pred.mean.reshape(5, c)
        blocks = pred.covariance_matrix.reshape(5, c, 5, c).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
        blocks = blocks + 1e-10 * torch.eye(c, dtype=torch.float64)
        torch.manual_seed(2)
        f = torch.distributions.MultivariateNormal(mean, blocks).sample((20000,))
        reference = torch.sigmoid(f.squeeze(-1)).mean(0) if c == 1 else torch.softmax(f, -1).mean(0)
    assert probs.shape == reference.shape
    assert (probs - reference).abs().max() < 0.02


def test_batched_training_data_are_refused_naming_train_x():
    """"`train_x` ... never GPyTorch's batch of training sets; ... raises `ValueError` naming `train_x`"."""
    net = mlp(d_out=1)
    x = torch.randn(2, 10, 3, dtype=torch.float64)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    with pytest.raises(ValueError, match=r"train_x.*batch-mode training data.*one NTKGP per training set"):
        ntkgp.NTKGP(net, x, torch.randn(2, 10, dtype=torch.float64), lik)
    with pytest.raises(ValueError, match=r"train_x.*batch-mode training data.*one NTKGP per training set"):
        ntkgp.NTKGP(net, x, torch.randn(2, dtype=torch.float64), lik)
    # test inputs do take GPyTorch's batch dimensions: (b, n, d) is b joint distributions
    model = ntkgp.NTKGP(net, x[0], torch.randn(10, dtype=torch.float64), lik).eval()
    with torch.no_grad():
        batch = model(x)
        assert batch.mean.shape == (2, 10)
        assert rel_err(batch.covariance_matrix[1], model(x[1]).covariance_matrix) < 1e-12


@pytest.mark.parametrize("kind", ["regression1", "regression2", "softmax4"])
def test_the_model_computes_in_the_float32_network_dtype(kind):
    """"the model computes in the network's dtype (float64 data on a float32 network are converted to float32)"."""
    net64, x, y, lik64, log_prob = make_problem(kind)
    net = copy.deepcopy(net64).float()
    lik = copy.deepcopy(lik64).float()
    model = ntkgp.NTKGP(net, x, y, lik)  # float64 data
    reference = ntkgp.NTKGP(net64, x, y, lik64)
    x_test = torch.randn(4, 3, dtype=torch.float64)
    assert model.dtype == torch.float32 and model.train_x.dtype == torch.float32
    with torch.no_grad():
        lml = model.log_marginal_likelihood()
        model.train()
        mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)(model(model.train_x), model.train_y)
        model.eval()
        reference.eval()
        pred, ref = model(x_test), reference(x_test)
        over_y = model.likelihood(pred)
    assert lml.dtype == mll.dtype == torch.float32
    # bounds from the error model of float32_laplace_tolerances (ε32·κ of H, κ measured on the dense float64 GGN)
    tol = float32_laplace_tolerances(net64, x, y, log_prob, x_test, gaussian=kind != "softmax4")
    evidence = reference.log_marginal_likelihood().item()
    assert max(tol["mean"], tol["variance"], tol["evidence"] / abs(evidence)) < 1e-2  # a 1 % error fails
    assert abs(lml.double().item() - evidence) < tol["evidence"]
    assert pred.mean.dtype == pred.variance.dtype == torch.float32
    assert rel_err(pred.mean.double(), ref.mean) < tol["mean"]
    assert rel_err(pred.variance.double(), ref.variance) < tol["variance"]
    values = over_y.probs if kind == "softmax4" else over_y.variance
    assert values.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in net.parameters())  # the network is never converted


def test_kernel_dtype_follows_the_network():
    """docs/ntk.md: "Jacobians are computed in the network's dtype ... the kernel matrix is returned in the dtype
    of the kernel's hyperparameters ... by default everything follows the network"."""
    net = mlp(d_out=2).float()
    kernel = ntkgp.NTKKernel(net)
    x = torch.randn(5, 3, dtype=torch.float64)
    gram = kernel(x).to_dense()
    assert kernel.prior_precision.dtype == torch.float32 and gram.dtype == torch.float32
    kernel.double()
    gram64 = kernel(x).to_dense()
    assert gram64.dtype == torch.float64
    # both from float32 Jacobians, each within rε√(tr K tr K) of the float64 network's Gram in Frobenius norm
    # (tests.helpers.float32_gram_tolerance, the trace measured here): about 50ε32 relative for the two together
    tolerance = 2 * float32_gram_tolerance(net, gram64.detach().diagonal())
    assert (gram64 - gram.double()).norm() <= tolerance
    assert all(p.dtype == torch.float32 for p in net.parameters())
