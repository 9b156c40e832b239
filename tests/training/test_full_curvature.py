"""The exact full GGN / EF of ntkgp.laplace.ggn.full_curvature (weight space, function space, spectral) against brute force:
explicit per-example Jacobians (autograd, row by row), explicit dense matrices and their log-determinants."""

import math

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.laplace.ggn.full_curvature import (
    FullCurvature,
    FunctionSpaceCurvature,
    exact_curvature,
    full_ef,
    full_ggn,
    function_space_curvature,
)
from tests.helpers import mlp
from tests.posteriors.reference import columns, dense_curvature, jacobian, likelihood_case, targets

DTYPE = torch.float64


def brute_evidence(net, x, y, lik, log_prob, kind, delta_groups, names_by_group):
    """log q(D) from the explicit dense curvature: Σ log p − ½ Σ δ‖θ‖² + ½ log|P0| − ½ log|H + P0|."""
    h = dense_curvature(net, x, y, log_prob, kind)
    cols = torch.zeros(h.shape[0], dtype=DTYPE)
    norms = torch.zeros(len(names_by_group), dtype=DTYPE)
    params = dict(net.named_parameters())
    for g, names in enumerate(names_by_group):
        cols[columns(net, names)] = delta_groups[g]
        norms[g] = sum(params[n].detach().square().sum() for n in names)
    with torch.no_grad():
        fit = log_prob(net(x), y).sum()
    return (fit - 0.5 * (delta_groups * norms).sum() + 0.5 * cols.log().sum()
            - 0.5 * torch.linalg.slogdet(h + torch.diag(cols))[1])


@pytest.mark.parametrize("name", ["gaussian", "multitask", "softmax", "logistic"])
@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("width", [2, 9])  # P < N·C (weight space cheaper) and P > N·C (function space)
def test_every_space_equals_the_dense_brute_force(name, kind, width):
    lik, c, log_prob = likelihood_case(name)
    x = torch.randn(11, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    y = targets(name, 11)
    net = mlp(d_in=2, width=width, d_out=c, depth=1, seed=2)
    delta = torch.tensor([0.7, 1.9], dtype=DTYPE)
    expected = brute_evidence(net, x, y, lik, log_prob, kind, delta, [["0.weight", "0.bias"], ["2.weight", "2.bias"]])
    spaces = ["weight", "function"] if not (kind == "ef" and name == "multitask") else ["weight"]
    for space in spaces:
        curv = exact_curvature(net, x, y, lik, kind, "layer", space=space)
        assert curv.log_marginal_likelihood(delta, lik).item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-10)
    # a single prior precision: the spectral form (one eigendecomposition) agrees too
    expected1 = brute_evidence(net, x, y, lik, log_prob, kind, delta[:1],
                               [["0.weight", "0.bias", "2.weight", "2.bias"]])
    for space in spaces:
        for spectral in (False, True):
            curv = exact_curvature(net, x, y, lik, kind, "network", space=space, spectral=spectral)
            value = curv.log_marginal_likelihood(delta[:1], lik).item()
            assert value == pytest.approx(expected1.item(), rel=1e-10, abs=1e-10)


@pytest.mark.parametrize("space", ["weight", "function"])
@pytest.mark.parametrize("spectral", [False, True])
@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_gradients_in_delta_and_noise_match_autograd_through_the_dense_matrix(space, spectral, kind):
    torch.manual_seed(0)
    x = torch.randn(13, 3, dtype=DTYPE)
    y = torch.randn(13, dtype=DTYPE)
    net = mlp(d_in=3, width=6, d_out=1, depth=1, seed=3)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = 0.4
    groups = "network" if spectral else "layer"
    g = 1 if spectral else 2
    curv = exact_curvature(net, x, y, lik, kind, groups, space=space, spectral=spectral)
    log_delta = torch.linspace(-0.3, 0.5, g, dtype=DTYPE).requires_grad_()
    ours = curv.log_marginal_likelihood(log_delta.exp(), lik)
    d_delta, d_noise = torch.autograd.grad(ours, [log_delta, lik.raw_noise])

    # brute force: explicit Jacobian, H(σ²) = JᵀJ/σ² (GGN) or Σ J_nᵀ g_n g_nᵀ J_n with g_n = (y − f)/σ² (EF)
    jac = jacobian(net, x)[:, 0, :]  # (N, P), autograd row by row
    log_delta2 = log_delta.detach().clone().requires_grad_()
    raw = lik.raw_noise.detach().clone().requires_grad_()
    noise = lik.noise_covar.raw_noise_constraint.transform(raw)
    with torch.no_grad():
        f = net(x).squeeze(-1)
    if kind == "ggn":
        h = jac.T @ jac / noise
    else:
        rows = jac * ((y - f) / noise)[:, None]
        h = rows.T @ rows
    sizes = [p.numel() for p in net.parameters()]
    group_of = [0, 0, 1, 1] if g == 2 else [0, 0, 0, 0]
    delta = log_delta2.exp()
    cols = torch.cat([delta[gi].expand(s) for gi, s in zip(group_of, sizes)])
    norms = torch.stack([sum(p.detach().square().sum() for p, gi in zip(net.parameters(), group_of) if gi == k)
                         for k in range(g)])
    fit = (-0.5 * (math.log(2 * math.pi) + noise.log() + (y - f) ** 2 / noise)).sum()
    ref = fit - 0.5 * (delta * norms).sum() + 0.5 * cols.log().sum() - 0.5 * torch.logdet(h + torch.diag(cols))
    r_delta, r_noise = torch.autograd.grad(ref, [log_delta2, raw])
    assert ours.item() == pytest.approx(ref.item(), rel=1e-10)
    torch.testing.assert_close(d_delta, r_delta, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(d_noise, r_noise, rtol=1e-8, atol=1e-10)


def test_auto_space_takes_the_smaller_side_and_weight_space_wrappers():
    torch.manual_seed(0)
    x, y = torch.randn(8, 2, dtype=DTYPE), torch.randn(8, dtype=DTYPE)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    wide, narrow = mlp(d_in=2, width=10, d_out=1, depth=1), mlp(d_in=2, width=1, d_out=1, depth=1)
    assert isinstance(exact_curvature(wide, x, y, lik), FunctionSpaceCurvature)  # N = 8 < P = 41
    assert isinstance(exact_curvature(narrow, x, y, lik), FullCurvature)  # P = 5 < N = 8
    assert isinstance(full_ggn(wide, x, y, lik), FullCurvature) and full_ggn(wide, x, y, lik).structure == "full_ggn"
    assert full_ef(wide, x, y, lik).structure == "full_ef"
    with pytest.raises(ValueError, match="space"):
        exact_curvature(wide, x, y, lik, space="both")
    multitask = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, has_global_noise=False).double()
    with pytest.raises(ValueError, match="single output scale"):
        function_space_curvature(mlp(d_in=2, width=3, d_out=2, depth=1), x, torch.randn(8, 2, dtype=DTYPE), multitask,
                                 "ef")
    with pytest.raises(NotImplementedError):
        exact_curvature(wide, x, y, lik).dense(lik)


def test_the_posteriors_dense_ggn_is_the_full_ggn():
    torch.manual_seed(0)
    x, y = torch.randn(6, 2, dtype=DTYPE), torch.randn(6, dtype=DTYPE)
    net = mlp(d_in=2, width=3, d_out=1, depth=1)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    b = full_ggn(net, x, y, lik)
    # the posterior's dense GGN comes from the same components
    post = ntkgp.laplace.laplace_posterior(net, x, y, lik, structure="full_ggn", prior_precision=1.0)
    torch.testing.assert_close(post.curvature_matrix(), b.dense(lik))
