"""The weight-space full GGN / empirical Fisher of data-parallel Algorithm 1, in one process.

Against brute force (autograd Jacobians, the softmax Hessian written out) and against NTKGP's
function-space evidence: values and gradients in the hyperparameters to 1e-10.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.laplace.ggn.full_curvature import full_curvature
from tests.helpers import brute_jacobian, mlp


def softmax_problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 2, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (11,), generator=g)
    return mlp(d_in=2, width=4, d_out=3, depth=1, seed=1), x, y, SoftmaxLikelihood(num_classes=3).double()


def gaussian_problem():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 2, generator=g, dtype=torch.float64)
    y = torch.randn(9, 2, generator=g, dtype=torch.float64)
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, has_global_noise=False).double()
    lik.task_noises = torch.tensor([0.2, 0.5])
    return mlp(d_in=2, width=3, d_out=2, depth=1, seed=3), x, y, lik


def test_softmax_ggn_and_ef_equal_brute_force():
    net, x, y, lik = softmax_problem()
    j, _ = brute_jacobian(net, x)
    j = j.reshape(x.shape[0], 3, -1)
    with torch.no_grad():
        p = torch.softmax(net(x), -1)
    t = lik.temperature.detach()  # 1 up to the constraint's rounding
    lam = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) / t
    ggn = torch.einsum("ncp,ncd,ndq->pq", j, lam, j)
    grad = (torch.nn.functional.one_hot(y, 3).double() - p) / t
    ef = torch.einsum("ncp,nc,nd,ndq->pq", j, grad, grad, j)
    for kind, expected in (("ggn", ggn), ("ef", ef)):
        curv = full_curvature(net, x, y, lik, kind, batch_size=4)
        torch.testing.assert_close(curv.dense(lik), expected, rtol=0, atol=1e-12)


def test_gaussian_per_output_noise_equals_brute_force():
    net, x, y, lik = gaussian_problem()
    j, _ = brute_jacobian(net, x)
    j = j.reshape(x.shape[0], 2, -1)
    s = 1 / lik.task_noises.detach().reshape(-1)  # 0.2 and 0.5 up to the constraint's rounding
    with torch.no_grad():
        g = (y - net(x)) * s
    ggn = torch.einsum("ncp,c,ncq->pq", j, s, j)
    ef = torch.einsum("ncp,nc,nd,ndq->pq", j, g, g, j)
    for kind, expected in (("ggn", ggn), ("ef", ef)):
        curv = full_curvature(net, x, y, lik, kind, batch_size=4)
        torch.testing.assert_close(curv.dense(lik), expected, rtol=0, atol=1e-11)


@pytest.mark.parametrize("problem", [softmax_problem, gaussian_problem])
@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_evidence_and_gradients_equal_ntkgp_function_space(problem, kind):
    net, x, y, lik = problem()
    delta = torch.tensor([0.5, 2.0], dtype=torch.float64)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=delta)
    curv = full_curvature(net, x, y, lik, kind, batch_size=5)
    hypers = [p for p in (model.covar_module.raw_prior_precision, *lik.parameters()) if p.requires_grad]
    reference = model.log_marginal_likelihood(curvature=kind, space="function")
    expected = torch.autograd.grad(reference, hypers)
    value = curv.log_marginal_likelihood(model.covar_module.prior_precision, lik)
    grads = torch.autograd.grad(value, hypers)
    torch.testing.assert_close(value, reference, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
