"""The FSVI objective: its value from independent pieces, its gradients against finite differences."""

from __future__ import annotations

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood
from torch.func import functional_call

from ntkgp.fsvi import FSVI, FunctionSpaceELBO
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood

from . import reference as ref


def _setup(kind):
    c = {"gaussian": 1, "logistic": 1, "softmax": 3}[kind]
    net = ref.mlp(d_in=2, width=4, d_out=c, seed=3)
    lik = {"gaussian": GaussianLikelihood, "logistic": LogisticLikelihood,
           "softmax": lambda: SoftmaxLikelihood(3)}[kind]().double()
    model = FSVI(net, lik, prior_precision=2.0, init_std=0.1, context_jitter=0.0)  # the exact objective
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, generator=g, dtype=torch.float64)
    y = {"gaussian": torch.randn(6, generator=g, dtype=torch.float64),
         "logistic": torch.randint(2, (6,), generator=g).double(),
         "softmax": torch.randint(3, (6,), generator=g)}[kind]
    xc = torch.randn(3, 2, generator=g, dtype=torch.float64)
    return net, model, x, y, xc


@pytest.mark.parametrize("kind", ["gaussian", "logistic", "softmax"])
def test_value_from_independent_pieces(kind):
    net, model, x, y, xc = _setup(kind)
    elbo = FunctionSpaceELBO(model, num_data=60, num_samples=2)
    terms = elbo(x, y, xc, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    q = model.variational_distribution
    log_ps = []
    for _ in range(2):  # the same draws: mu + s * eps, eps in parameter order
        theta = {n: m + s * torch.randn(m.shape, generator=g, dtype=m.dtype)
                 for n, m, s in zip(q.names, q.mean, q.stds().values())}
        f = functional_call(net, theta, (x,))
        if kind == "gaussian":
            noise = model.likelihood.noise.detach()
            log_ps.append(torch.distributions.Normal(f[:, 0], noise.sqrt()).log_prob(y).sum())
        elif kind == "logistic":
            log_ps.append(torch.distributions.Bernoulli(logits=f[:, 0]).log_prob(y).sum())
        else:
            log_ps.append(torch.distributions.Categorical(logits=f).log_prob(y).sum())
    ell = torch.stack(log_ps).mean() * 60 / 6
    torch.testing.assert_close(terms.expected_log_likelihood, ell, rtol=1e-9, atol=1e-12)  # logsigmoid vs BCE
    torch.testing.assert_close(terms.kl, model.function_space_kl(xc), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(terms.value, (ell - terms.kl) / 60, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["gaussian", "softmax"])
def test_gradients_match_finite_differences(kind):
    """∂/∂μ and ∂/∂log s of the objective (fixed draws, fixed context) by autograd vs central differences."""
    _, model, x, y, xc = _setup(kind)
    q = model.variational_distribution
    elbo = FunctionSpaceELBO(model, num_data=60)

    def objective():
        return elbo(x, y, xc, generator=torch.Generator().manual_seed(11)).value

    params = list(q.mean) + list(q.raw_std)
    groups = (range(len(q.mean)), range(len(q.mean), len(params)))  # μ, then log s
    ref.check_directional_derivatives(objective, params, groups, directions=5,  # every coordinate moves
                                      generator=torch.Generator().manual_seed(1))


def test_errors_name_the_argument():
    _, model, x, y, xc = _setup("gaussian")
    with pytest.raises(ValueError, match="num_data"):
        FunctionSpaceELBO(model, num_data=0)
    with pytest.raises(ValueError, match="num_samples"):
        FunctionSpaceELBO(model, num_data=5, num_samples=0)
    with pytest.raises(TypeError, match="model"):
        FunctionSpaceELBO("model", num_data=5)
    with pytest.raises(ValueError, match="y"):
        FunctionSpaceELBO(model, num_data=6)(x, y[:4], xc)
