"""The dense route of the evidence at the kernel's own covariance: the exact curvature built once per network state
(function_space/evidence_curvature.py), its value and gradients in every δ_g and in the noise / temperature
against autograd through the dense weight-space brute force, and its cache (built once, rebuilt when the weights
change)."""

import gpytorch
import pytest
import torch

import ntkgp
import ntkgp.laplace.function_space.evidence_curvature as evidence_curvature
from ntkgp.laplace.function_space import laplace_log_marginal_likelihood
from ntkgp.laplace.weight_space import FullCurvature
from ntkgp.likelihoods import LogisticLikelihood
from ntkgp.ntk import resolve_groups
from tests.helpers import brute_jacobian, column_groups, dense_laplace, mlp, rel_err
from tests.problems import make_problem

DELTA = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)


def brute_evidence(net, x, y, kind, delta, scale, curvature, prior_structure="layer"):
    r"""log q(D) by the dense P×P formula, a differentiable function of δ (per group) and the output scale s
    (1/σ_c² per output, or 1/T), written here with torch.distributions and explicit Jacobians."""
    j, _ = brute_jacobian(net, x)
    with torch.no_grad():
        f = net(x)
    n, c = f.shape
    jn = j.reshape(n, c, -1)
    groups = resolve_groups(net, prior_structure)
    cols = delta[column_groups(net, dict(zip(groups.names, groups.group_of)))]
    if kind == "gaussian":
        fit = torch.distributions.Normal(f, scale.rsqrt()).log_prob(y.reshape(f.shape)).sum()
        lam = torch.diag_embed(scale.expand(n, c))
        g = (y.reshape(f.shape) - f) * scale
    else:  # tempered logistic: log p / T, Λ = p(1 − p) / T, g = (y − p) / T
        fit = torch.distributions.Bernoulli(logits=f[:, 0]).log_prob(y).sum() * scale[0]
        p = torch.sigmoid(f)
        lam = (p * (1 - p) * scale).unsqueeze(-1)
        g = (y.reshape(f.shape) - p) * scale
    if curvature == "ggn":
        h = torch.einsum("ncp,ncd,ndq->pq", jn, lam, jn)
    else:
        rows = torch.einsum("nc,ncp->np", g, jn)
        h = rows.T @ rows
    theta = torch.cat([q.detach().reshape(-1) for q in net.parameters()])
    return (fit - 0.5 * (cols * theta**2).sum() + 0.5 * cols.log().sum()
            - 0.5 * torch.linalg.slogdet(h + torch.diag(cols))[1])


def problem(kind):
    torch.manual_seed(0)
    x = torch.randn(12, 3, dtype=torch.float64)
    if kind == "gaussian1":
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = 0.3
        return mlp(d_out=1), x, torch.randn(12, dtype=torch.float64), lik
    if kind == "gaussian2":
        lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_global_noise=False).double()
        lik.task_noises = torch.tensor([0.2, 0.5], dtype=torch.float64)
        return mlp(d_out=2), x, torch.randn(12, 2, dtype=torch.float64), lik
    lik = LogisticLikelihood(temperature=0.7, learn_temperature=True).double()
    return mlp(d_out=1), x, (torch.rand(12) > 0.5).double(), lik


def scale_of(lik):
    if isinstance(lik, gpytorch.likelihoods.MultitaskGaussianLikelihood):
        return lik.task_noises.reciprocal()
    if isinstance(lik, gpytorch.likelihoods.GaussianLikelihood):
        return lik.noise.reshape(1).reciprocal()
    return lik.temperature.reshape(1).reciprocal()


@pytest.mark.parametrize("kind", ["gaussian1", "gaussian2", "logistic"])
@pytest.mark.parametrize("space", ["function", "weight"])
@pytest.mark.parametrize("curvature", ["ggn", "ef"])
def test_value_and_gradients_equal_autograd_through_the_dense_brute_force(kind, space, curvature):
    net, x, y, lik = problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    raw = [p for p in [*model.covar_module.parameters(), *lik.parameters()] if p.requires_grad]
    value = model.log_marginal_likelihood(curvature=curvature, space=space, method="cholesky")
    reference = brute_evidence(net, x, y, "gaussian" if kind != "logistic" else "logistic",
                               model.covar_module.prior_precision, scale_of(lik), curvature)
    assert rel_err(value.detach(), reference.detach()) < 1e-10
    grads = torch.autograd.grad(value, raw, allow_unused=True)
    expected = torch.autograd.grad(reference, raw, allow_unused=True)
    for g, e in zip(grads, expected):
        if e is None:
            assert g is None or bool((g == 0).all())
        else:
            assert rel_err(g, e) < 1e-9


def test_weight_space_takes_the_cached_components_and_builds_them_once(monkeypatch):
    net, x, y, lik, log_prob = make_problem("softmax4", n=40)  # N·C = 160 > P = 116: weight space
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    builds = []
    original = FullCurvature.__init__  # either build (Jacobian rows or layer blocks) constructs one
    monkeypatch.setattr(FullCurvature, "__init__", lambda self, *a, **k: builds.append(1) or original(self, *a, **k))
    optimizer = torch.optim.Adam(model.hyperparameters(), lr=0.05)
    for _ in range(4):
        optimizer.zero_grad()
        (-model.log_marginal_likelihood(method="cholesky")).backward()
        optimizer.step()
    assert builds == [1]
    groups = resolve_groups(net)
    cols = column_groups(net, dict(zip(groups.names, groups.group_of)))
    delta = model.covar_module.prior_precision.detach()
    reference = dense_laplace(net, x, y, log_prob, delta[cols])["evidence"]
    assert rel_err(model.log_marginal_likelihood(method="cholesky").detach(), reference) < 1e-10


@pytest.mark.parametrize("space", ["function", "weight"])
def test_changed_weights_rebuild_the_curvature(space):
    """The cache is keyed by the network's weights: after an in-place change (an optimizer step would do the same)
    the evidence at the new outputs equals the brute force at the new weights, never a mix."""
    net, x, y, lik, log_prob = make_problem("binary")
    kernel = ntkgp.NTKKernel(net, prior_precision=DELTA)
    groups = resolve_groups(net)
    cols = DELTA[column_groups(net, dict(zip(groups.names, groups.group_of)))]
    yy = y.to(torch.float64)
    for step in range(2):
        with torch.no_grad():
            f = net(x)
        value = laplace_log_marginal_likelihood(kernel, lik, x, f, yy, "ggn", space, method="cholesky")
        assert rel_err(value.detach(), dense_laplace(net, x, y, log_prob, cols)["evidence"]) < 1e-10
        with torch.no_grad():
            next(net.parameters()).mul_(1.3)
    assert len(evidence_curvature._CURVATURES[kernel]) == 2


def test_a_given_covariance_or_inputs_with_gradients_take_the_direct_factorization(monkeypatch):
    net, x, y, lik, log_prob = make_problem("regression1")
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA).train()
    monkeypatch.setattr(evidence_curvature, "evidence_curvature", lambda *a, **k: pytest.fail("cached route"))
    monkeypatch.setattr("ntkgp.laplace.function_space.evidence.evidence_curvature",
                        lambda *a, **k: pytest.fail("cached route"))
    prior = model(x)
    scaled = type(prior)(prior.mean, prior.lazy_covariance_matrix * 1.0)  # not the kernel's own lazy tensor
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, method="cholesky")
    groups = resolve_groups(net)
    cols = DELTA[column_groups(net, dict(zip(groups.names, groups.group_of)))]
    reference = dense_laplace(net, x, y, log_prob, cols)["evidence"]
    assert rel_err(mll(scaled, y).detach() * x.shape[0], reference) < 1e-10
    xg = x.clone().requires_grad_(True)
    value = laplace_log_marginal_likelihood(model.covar_module, lik, xg, model.train_outputs, model.train_y,
                                            method="cholesky")
    assert rel_err(value.detach(), reference) < 1e-10
