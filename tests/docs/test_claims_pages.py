"""Documented claims about behaviour in README.md, docs/guarantees.md, docs/predictive.md,
docs/gpytorch_and_botorch.md, docs/curvature.md and docs/likelihoods.md: each test fails if its page's
statement becomes false (issue 15). Errata fixed in the pages: guarantees.md said `posterior_transform`
outside BoTorch raises NotImplementedError (it is a TypeError, an unknown keyword); predictive.md's bridge
with one logit raises rather than return the MAP probability.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch
from torch import nn

import ntkgp
from ntkgp import NTKKernel
from ntkgp.laplace.weight_space import compute_curvature
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from tests.helpers import float32_gram_tolerance


def _data(c=3):
    torch.manual_seed(0)
    x = torch.randn(10, 2, dtype=torch.float64)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, c)).double().eval()
    return net, x


def test_kernel_dtype_follows_the_network_not_the_data():
    """gpytorch_and_botorch.md, "dtype and device": float64 data on a float32 network gives a float32 kernel;
    kernel.double() gives float64; the network is not converted."""
    net32 = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(6, 2, dtype=torch.float64)
    assert NTKKernel(net32)(x).to_dense().dtype == torch.float32
    assert NTKKernel(net32).double()(x).to_dense().dtype == torch.float64
    assert all(p.dtype == torch.float32 for p in net32.parameters())
    # the float64 kernel of a float32 network has float32-accurate entries: compare with the float64 network
    net64 = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    net64.load_state_dict({k: v.double() for k, v in net32.state_dict().items()})
    ref = NTKKernel(net64)(x).to_dense()
    got = NTKKernel(net32).double()(x).to_dense()
    # float32 Jacobians: within rε√(tr K tr K) of the float64 Gram in Frobenius norm (tests.helpers.float32_gram_tolerance,
    # r from the network, the trace measured here; about 30ε32 relative)
    assert (got - ref).norm() <= float32_gram_tolerance(net64, ref.detach().diagonal())


def test_not_implemented_and_type_errors_of_guarantees_md():
    """guarantees.md, "Errors": the NotImplementedError cases and posterior_transform outside BoTorch."""
    from botorch.sampling import SobolQMCNormalSampler

    net, x = _data(3)
    y = torch.randint(0, 3, (10,))
    classifier = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(3).double()).eval()
    with pytest.raises(NotImplementedError, match="Gaussian"):
        classifier.fantasize(x[:2], SobolQMCNormalSampler(torch.Size([2])))
    with pytest.raises(ValueError, match="observation_noise"):
        classifier.posterior(x[:2], observation_noise=True)
    with pytest.raises(TypeError, match="posterior_transform"):
        classifier.predictive_distribution(x[:2], posterior_transform=lambda p: p)
    net1, _ = _data(1)
    regression = ntkgp.NTKGP(net1, x, torch.randn(10, dtype=torch.float64),
                             gpytorch.likelihoods.GaussianLikelihood().double()).eval()
    with pytest.raises(NotImplementedError, match="noise"):
        regression.condition_on_observations(x[:2], torch.randn(2, 1, dtype=torch.float64), noise=torch.ones(2, 1))
    with pytest.raises(NotImplementedError, match="batched"):
        regression.get_fantasy_model(x[:2], torch.randn(3, 2, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="rank"):
        ntkgp.likelihoods.hessian(gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=1),
                                  torch.randn(4, 2), torch.randn(4, 2))


def test_counts_are_rejected_not_truncated_and_training_mode_batchnorm_is_refused():
    """guarantees.md (`num_inducing=2.7`, `batch_size=0`) and README (BatchNorm in training mode)."""
    net, x = _data(3)
    y = torch.randint(0, 3, (10,))
    with pytest.raises(ValueError, match="num_inducing"):
        ntkgp.SFR(net, x, y, SoftmaxLikelihood(3).double(), num_inducing=2.7)
    with pytest.raises(ValueError, match="batch_size"):
        compute_curvature(net, x, y, SoftmaxLikelihood(3).double(), structure="diag_ggn", batch_size=0)
    bn = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)).double()
    state = {k: v.clone() for k, v in bn.state_dict().items()}
    with pytest.raises(ValueError, match="BatchNorm1d"):
        ntkgp.NTKGP(bn, x, torch.randn(10, dtype=torch.float64), gpytorch.likelihoods.GaussianLikelihood().double())
    assert bn.training and all(torch.equal(state[k], v) for k, v in bn.state_dict().items())


def test_kfac_refuses_what_curvature_md_says_it_refuses():
    """curvature.md: KFAC needs weight and bias in one prior group; grouped convolutions raise (KFAC) but take
    the per-example route in the diagonal structures."""
    net, x = _data(3)
    y = torch.randint(0, 3, (10,))
    lik = SoftmaxLikelihood(3).double()
    with pytest.raises(ValueError, match="one prior precision"):
        compute_curvature(net, x, y, lik, structure="kfac", prior_structure="parameter")

    class Grouped(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, groups=2)
            self.head = nn.Linear(2 * 4 * 4, 3)

        def forward(self, z):
            return self.head(torch.tanh(self.conv(z)).flatten(1))

    grouped = Grouped().double().eval()
    images = torch.randn(10, 2 * 6 * 6, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="groups"):
        compute_curvature(grouped, images, y, lik, structure="kfac", input_shape=(2, 6, 6))
    diag = compute_curvature(grouped, images, y, lik, structure="diag_ggn", input_shape=(2, 6, 6))
    assert torch.isfinite(diag.log_marginal_likelihood(1.0, lik))


def test_tempered_likelihood_conditional_uses_the_untempered_link():
    """likelihoods.md, "Temperature": likelihood(f) is the untempered Categorical / Bernoulli."""
    f = torch.randn(4, 3)
    assert torch.allclose(SoftmaxLikelihood(3, temperature=5.0)(f).probs, torch.softmax(f, -1))
    g = torch.randn(4)
    assert torch.allclose(LogisticLikelihood(temperature=0.2)(g).probs, torch.sigmoid(g))


def test_bridge_needs_a_softmax_and_predictions_are_detached():
    """predictive.md: link="bridge" with one logit raises; everything predict returns is detached."""
    from ntkgp.laplace.weight_space import laplace_posterior
    from ntkgp.laplace.weight_space.posterior.predictive_estimators import predict

    net, x = _data(1)
    y = (torch.rand(10, generator=torch.Generator().manual_seed(1)) > 0.5).double()
    posterior = laplace_posterior(net, x, y, LogisticLikelihood().double(), structure="kfac")
    with pytest.raises(ValueError, match="bridge"):
        predict(posterior, x, link="bridge")
    out = predict(posterior, x, method="glm_mc", num_samples=5, generator=torch.Generator().manual_seed(0))
    assert not out.f.mean.requires_grad and not out.samples.requires_grad and not out.probs.requires_grad
