"""The evidence of a known spectrum as one node of the graph (``ntkgp.laplace.spectral_evidence``): its derivatives
against finite differences (first and second order), its cache against the Cholesky route after every change of the
network, the targets, δ and the noise or temperature, and the data fit through ``f`` when ``f`` carries a graph."""

import pytest
import torch

import ntkgp
from ntkgp.laplace.function_space import laplace_log_marginal_likelihood
from ntkgp.laplace.spectral_evidence import Spectrum, spectral_evidence
from tests.helpers import rel_err
from tests.problems import LEARNABLE_KINDS as KINDS
from tests.problems import learnable_problem as make_problem


@pytest.mark.parametrize("power", [1, 2])
@pytest.mark.parametrize("components", [1, 3])
@pytest.mark.parametrize("num_groups", [1, 3])
def test_the_node_against_finite_differences(power, components, num_groups):
    """First and second derivatives in δ (G,) and the variances v = 1/s (K,) by float64 finite differences
    (gradcheck, gradgradcheck), and the value against the formula written out in plain torch."""
    g = torch.Generator().manual_seed(0)
    lam = torch.rand(12, generator=g, dtype=torch.float64) * 3
    lam[::5] = 0  # zero eigenvalues: dropped by Spectrum, nothing to add
    groups = torch.arange(12) % num_groups
    stats = torch.randn(3, components, generator=g, dtype=torch.float64)
    norms = torch.rand(num_groups, generator=g, dtype=torch.float64)
    variance = (torch.rand(components, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    delta = (torch.rand(num_groups, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    spectrum = Spectrum(lam, groups, power, norms)

    def fn(d, v):
        return spectral_evidence(d, v, spectrum, stats)

    assert torch.autograd.gradcheck(fn, (delta, variance))
    assert torch.autograd.gradgradcheck(fn, (delta, variance))
    alpha, beta, gamma = stats
    s = 1 / variance
    expected = ((alpha + beta * s.log() + gamma * s).sum() - 0.5 * (delta * norms).sum()
                - 0.5 * torch.log1p(lam * s[0] ** power / delta[groups]).sum())
    assert rel_err(fn(delta, variance).detach(), expected.detach()) < 1e-13


def _grads(value, params):
    return [g.detach() for g in torch.autograd.grad(value, params)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("curvature", ["ggn", "ef"])
def test_the_cached_route_follows_every_change(kind, curvature):
    """The eigen route (cached eigenvalues, fit statistics and norms) against the Cholesky route (built anew
    after each change), value and gradient, after writes that leave no trace on the tensors' version counters."""
    net, x, y, lik = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.5, prior_structure="network")
    params = [p for p in model.hyperparameters() if p.requires_grad]
    first = next(p for p in net.parameters() if p.requires_grad)
    y_other = y.flip(0)

    def noise_or_temperature():
        raw = params[0] if params[0] is not model.covar_module.raw_prior_precision else params[1]
        raw.data.add_(0.3)

    changes = [lambda: None, lambda: first.data.mul_(1.3), lambda: model.covar_module.raw_prior_precision.data.add_(0.4),
               noise_or_temperature]
    for change in changes:
        change()
        for target in (None, y_other):
            value = model.log_marginal_likelihood(target, curvature=curvature, method="eigen")
            exact = model.log_marginal_likelihood(target, curvature=curvature, method="cholesky")
            assert rel_err(value.detach(), exact.detach()) < 1e-10
            for a, b in zip(_grads(value, params), _grads(exact, params)):
                assert rel_err(a, b) < 1e-10


def test_outputs_with_a_graph_keep_their_gradient():
    """``f`` that requires grad: the eigen route's data fit stays differentiable in ``f``."""
    net, x, y, lik = make_problem("softmax3")
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=2.0, prior_structure="network")
    kernel = model.covar_module
    f = model.train_outputs.detach().clone().requires_grad_()
    value = laplace_log_marginal_likelihood(kernel, lik, model.train_x, f, model.train_y, method="eigen")
    (grad,) = torch.autograd.grad(value, f)
    from ntkgp.likelihoods import log_likelihood  # the log-determinant holds f's curvature fixed: the fit's alone

    (fit_grad,) = torch.autograd.grad(log_likelihood(lik, f, model.train_y).sum(), f)
    assert grad.abs().sum() > 0
    assert rel_err(grad, fit_grad) < 1e-12
