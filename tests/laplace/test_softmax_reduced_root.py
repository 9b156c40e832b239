"""A softmax likelihood's site factor with C − 1 columns (ntkgp.laplace.ggn.scaling.fewest_columns): the
evidence and the GLM predictive of NTKGP, which now factorize N·(C − 1)-square matrices, against the dense
brute force with the full Λ (log|I + K Λ| and K − K Λ (I + K Λ)⁻¹ K from a jacrev Jacobian), in float64, and a
float32 network against its float64 copy."""

import copy

import pytest
import torch

import ntkgp
from ntkgp.laplace.ggn.scaling import fewest_columns
from ntkgp.likelihoods import SoftmaxLikelihood, hessian, hessian_sqrt, log_likelihood
from tests.helpers import float32_laplace_tolerances, reference_log_prob


def problem(dtype=torch.float64, c=4):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, c)).to(dtype)
    x = torch.randn(9, 3, dtype=dtype)
    y = torch.randint(0, c, (9,))
    return net, x, y


def jacobian(net, x):
    params = dict(net.named_parameters())
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(net, p, (x,)))(params)
    return torch.cat([j.reshape(x.shape[0] * j.shape[1], -1) for j in jac.values()], dim=1)  # (N·C, P)


def test_the_reduced_root_is_a_root_of_lambda_with_one_column_fewer():
    net, x, y = problem()
    likelihood = SoftmaxLikelihood(4, temperature=0.6).double()
    f = net(x).detach()
    root = fewest_columns(likelihood, f, hessian_sqrt(likelihood, f, y))
    assert root.shape == (9, 4, 3)
    assert torch.allclose(root @ root.mT, hessian(likelihood, f, y), atol=1e-14)


@pytest.mark.parametrize("space", ["function", "weight"])
def test_evidence_and_predictive_against_the_dense_full_lambda(space):
    net, x, y = problem()
    delta = 1.7
    likelihood = SoftmaxLikelihood(4, temperature=0.6).double()
    model = ntkgp.NTKGP(net, x, y, likelihood, prior_precision=delta, prior_structure="network", space=space)
    value = model.log_marginal_likelihood(space=space, method="cholesky").item()
    f = net(x).detach()
    jac = jacobian(net, x).detach()
    k = jac @ jac.T / delta
    lam = torch.block_diag(*hessian(likelihood, f, y))
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    expected = (log_likelihood(likelihood, f, y).sum() - 0.5 * delta * theta.square().sum()
                - 0.5 * torch.linalg.slogdet(torch.eye(k.shape[0], dtype=k.dtype) + k @ lam)[1]).item()
    assert value == pytest.approx(expected, rel=1e-11)
    model.eval()
    x_test = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():
        variance = model(x_test).variance.reshape(-1)
    jac_test = jacobian(net, x_test).detach()
    k_tx = jac_test @ jac.T / delta
    dense = jac_test @ jac_test.T / delta - k_tx @ lam @ torch.linalg.solve(
        torch.eye(k.shape[0], dtype=k.dtype) + k @ lam, k_tx.T)
    assert torch.allclose(variance, dense.diagonal(), rtol=1e-9, atol=1e-12)


def test_float32_network_against_its_float64_copy():
    net, x, y = problem(torch.float32)
    net64 = copy.deepcopy(net).double()
    results = []
    for network, inputs in ((net, x), (net64, x.double())):
        likelihood = SoftmaxLikelihood(4).to(inputs.dtype)
        model = ntkgp.NTKGP(network, inputs, y, likelihood, prior_precision=2.0, prior_structure="network",
                            space="function")
        value = model.log_marginal_likelihood(space="function", method="cholesky").item()
        model.eval()
        with torch.no_grad():
            variance = model(torch.linspace(-1, 1, 12).reshape(4, 3).to(inputs.dtype)).variance.double()
        results.append((value, variance))
    (value32, var32), (value64, var64) = results
    # the error model of float32_laplace_tolerances (ε32·κ of H, κ measured on dense float64 Jacobians)
    x_test = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)
    tol = float32_laplace_tolerances(net64, x.double(), y, lambda f, yy: reference_log_prob("softmax", f, yy),
                                     x_test, delta=2.0, gaussian=False)
    assert max(tol["evidence"] / abs(value64), tol["variance"]) < 1e-2  # a meaningful bound: a 1 % error fails
    assert abs(value32 - value64) <= tol["evidence"]
    assert ((var32 - var64).norm() / var64.norm()).item() <= tol["variance"]
