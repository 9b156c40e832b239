"""One prior precision: the eigen route of the evidence against the Cholesky route (values and gradients, 1e-10),
its validity rule, its cache and its use by "auto"."""

import copy
import math

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.laplace.function_space import EvidenceOptions, evidence_method, laplace_log_marginal_likelihood
from tests.helpers import (
    EPS32,
    brute_jacobian,
    dense_laplace,
    float32_laplace_tolerances,
    float32_roundings,
    mlp,
    reference_log_prob,
    rel_err,
)
from tests.problems import LEARNABLE_KINDS as KINDS
from tests.problems import learnable_problem as make_problem


def hyperparameters(model):
    return [p for p in model.hyperparameters() if p.requires_grad]


def value_and_grads(model, **kwargs):
    value = model.log_marginal_likelihood(**kwargs)
    return value.detach(), [g.detach() for g in torch.autograd.grad(value, hyperparameters(model))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("curvature", ["ggn", "ef"])
@pytest.mark.parametrize("space", ["function", "weight"])
def test_eigen_equals_cholesky_in_value_and_gradient(kind, curvature, space):
    net, x, y, lik = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=2.5, prior_structure="network")
    params = hyperparameters(model)
    assert len(params) == 2  # δ and the noise or temperature
    ref, ref_grads = value_and_grads(model, curvature=curvature, space=space, method="cholesky")
    for _ in range(2):  # first call decomposes, second reads the cache
        value, grads = value_and_grads(model, curvature=curvature, space=space, method="eigen")
        assert rel_err(value, ref) < 1e-10
        for g, r in zip(grads, ref_grads):
            assert rel_err(g, r) < 1e-10


def test_eigen_equals_the_dense_weight_space_formula():
    net, x, y, lik = make_problem("softmax3", n=20)
    lik.temperature = 1.0
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=3.0, prior_structure="network")
    delta_cols = torch.full((sum(p.numel() for p in net.parameters()),), 3.0, dtype=torch.float64)
    ref = dense_laplace(net, x, y, lambda f, yy: reference_log_prob("softmax", f, yy), delta_cols)["evidence"]
    assert rel_err(model.log_marginal_likelihood(method="eigen").detach(), ref) < 1e-10


def test_steps_after_the_first_do_not_decompose_again(monkeypatch):
    net, x, y, lik = make_problem("binary", n=15)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.0, prior_structure="network")
    calls = []
    eigvalsh = torch.linalg.eigvalsh
    monkeypatch.setattr(torch.linalg, "eigvalsh", lambda a: calls.append(a.shape) or eigvalsh(a))
    optimizer = torch.optim.Adam(hyperparameters(model), lr=0.1)
    for _ in range(5):
        optimizer.zero_grad()
        (-model.log_marginal_likelihood()).backward()
        optimizer.step()
    assert len(calls) == 1
    # a change of the network's weights (a .data write) is seen: one new decomposition, still exact
    net[0].weight.data.mul_(1.1)
    value = model.log_marginal_likelihood().detach()
    assert len(calls) == 2
    assert rel_err(value, model.log_marginal_likelihood(method="cholesky").detach()) < 1e-10


def test_adam_trajectories_of_both_routes_agree():
    net, x, y, lik = make_problem("softmax3", n=15)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.0, prior_structure="network")
    start = [p.detach().clone() for p in hyperparameters(model)]
    trajectories = {}
    for method in ("cholesky", "eigen"):
        with torch.no_grad():
            for p, s in zip(hyperparameters(model), start):
                p.copy_(s)
        optimizer = torch.optim.Adam(hyperparameters(model), lr=0.2)
        values = []
        for _ in range(10):
            optimizer.zero_grad()
            loss = -model.log_marginal_likelihood(method=method)
            loss.backward()
            optimizer.step()
            values.append(loss.detach())
        trajectories[method] = (torch.stack(values), [p.detach().clone() for p in hyperparameters(model)])
    assert rel_err(trajectories["eigen"][0], trajectories["cholesky"][0]) < 1e-10
    for a, b in zip(trajectories["eigen"][1], trajectories["cholesky"][1]):
        assert rel_err(a, b) < 1e-9


def test_auto_takes_the_eigen_route_where_it_applies():
    net, x, y, lik = make_problem("regression1")
    one = ntkgp.NTKGP(net, x, y, lik, prior_structure="network")
    layered = ntkgp.NTKGP(net, x, y, lik, prior_structure="layer")
    f = one.train_outputs
    assert evidence_method(one.covar_module, lik, x, f) == "eigen"
    assert evidence_method(layered.covar_module, lik, x, f) == "cholesky"
    multitask = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0).double()  # task noises
    net2 = mlp(d_out=2)
    two = ntkgp.NTKGP(net2, x, torch.randn(12, 2, dtype=torch.float64), multitask, prior_structure="network")
    assert evidence_method(two.covar_module, multitask, x, two.train_outputs) == "cholesky"
    with pytest.raises(ValueError, match="per-output noises"):
        two.log_marginal_likelihood(method="eigen")
    with pytest.raises(ValueError, match="one prior precision"):
        layered.log_marginal_likelihood(method="eigen")
    # the dense memory limit sends "auto" to the matrix-free route
    tiny = EvidenceOptions(dense_memory_limit=0)
    assert evidence_method(one.covar_module, lik, x, f, options=tiny) == "matrix_free"


def test_the_mll_takes_the_eigen_route_through_the_kernels_own_covariance(monkeypatch):
    net, x, y, lik = make_problem("binary", n=15)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=0.7, prior_structure="network")
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    model.train()
    ref = model.log_marginal_likelihood(method="cholesky").detach() / 15
    from ntkgp.laplace.function_space import evidence

    calls = []
    spectral = evidence.checked_spectral_evidence  # the eigen route, once its conditions are checked
    monkeypatch.setattr(evidence, "checked_spectral_evidence", lambda *a, **k: calls.append(1) or spectral(*a, **k))
    value = mll(model(x), y)
    assert calls == [1]
    assert rel_err(value.detach(), ref) < 1e-10
    # a covariance that is not the kernel's own is factorized as given
    dense = model(x).lazy_covariance_matrix.to_dense()
    assert evidence_method(model.covar_module, lik, x, model.train_outputs, covariance=dense) == "cholesky"
    with pytest.raises(ValueError, match="covariance"):
        laplace_log_marginal_likelihood(
            model.covar_module, lik, x, model.train_outputs, model.train_y, covariance=dense, method="eigen"
        )


def dense_softmax_evidence(jac, out, y, theta, temperature, delta, perturbation, form):
    """The tempered-softmax Laplace-GGN evidence with one δ from dense float64 matrices, in the weight-space form
    (−½ log|JᵀΛJ + δI| + ½P log δ) or the function-space one (−½ log|I + ΛJJᵀ/δ|, Sylvester), with an additive
    ``perturbation`` of the matrix that form factorizes (JᵀΛJ + δI, or the Gram JJᵀ)."""
    n, c = out.shape
    probs = out.softmax(-1)
    lam = torch.block_diag(*(torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :])) / temperature
    fit = torch.distributions.Categorical(logits=out).log_prob(y).sum() / temperature
    prior = 0.5 * delta * theta.square().sum()
    if form == "weight":
        h = jac.T @ lam @ jac + delta * torch.eye(jac.shape[1], dtype=jac.dtype) + perturbation
        return fit - prior - 0.5 * torch.logdet(h) + 0.5 * jac.shape[1] * delta.log()
    eye = torch.eye(n * c, dtype=jac.dtype)
    return fit - prior - 0.5 * torch.logdet(eye + lam @ (jac @ jac.T + perturbation) / delta)


def test_float32():
    net, x, y, lik = make_problem("softmax3", n=20, dtype=torch.float32)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=2.0, prior_structure="network")
    ref, ref_grads = value_and_grads(model, method="cholesky")
    value, grads = value_and_grads(model, method="eigen")
    assert value.dtype == torch.float32
    # Both routes in float32, each against the dense float64 evidence of the same weights, temperature and δ
    # (gradients with respect to the raw temperature (softplus) and δ (exp), in the model's order). Error
    # model (ε = ε32, r from float32_roundings), first order and a worst case over the roundings' directions (any
    # CPU, any thread count): Jacobian rows within rε of their norm, outputs within rε(|f_n| + ‖J_n‖‖θ‖), the
    # transform of each raw hyperparameter within 3ε relatively, the sum over the N·C rows (log2(NC)ε‖Λ‖‖J‖_F‖J‖)
    # and the factorization's backward error ((m+1)ε‖·‖_F of the m×m matrix factorized: JᵀΛJ + δI, or the Gram
    # JJᵀ for the eigen route, the larger of the two read). Each term is weighted by the sensitivity of the value
    # or gradient to that input, measured here by autograd on the dense float64 formula (a componentwise
    # condition number). The value's bound is that of tests.helpers.float32_laplace_tolerances.
    net64 = copy.deepcopy(net).double()
    x64 = x.double()
    jac, _ = brute_jacobian(net64, x64)
    with torch.no_grad():
        out = net64(x64)
    theta = torch.cat([q.detach().reshape(-1) for q in net64.parameters()])
    raw_t, raw_d = (q.detach().double() for q in hyperparameters(model))  # temperature, then δ
    r, eps, (n, c), count = float32_roundings(net64), EPS32, out.shape, theta.numel()
    temperature = torch.nn.functional.softplus(raw_t).requires_grad_()
    delta = raw_d.exp().reshape(()).requires_grad_()  # δ = exp(raw)
    assert torch.allclose(delta, model.covar_module.prior_precision.detach().double(), rtol=4 * eps, atol=0)
    jac, out = jac.requires_grad_(), out.clone().requires_grad_()
    d_jac = r * eps * jac.detach().norm(dim=-1, keepdim=True).expand_as(jac)
    d_out = r * eps * (out.detach().abs() + (jac.detach().norm(dim=-1) * theta.norm()).reshape(n, c))
    lam_max = 0.5 / temperature.item()  # ‖Λ_n‖ ≤ ½/T (Gershgorin)
    summed = math.log2(n * c) * eps * lam_max * (torch.linalg.matrix_norm(jac.detach()).item()
                                                 * torch.linalg.matrix_norm(jac.detach(), ord=2).item())
    bounds, expected = [0.0, 0.0], None
    for form, size in (("weight", count), ("function", n * c)):
        perturbation = torch.zeros(size, size, dtype=torch.float64, requires_grad=True)
        value64 = dense_softmax_evidence(jac, out, y, theta, temperature, delta, perturbation, form)
        g_t, g_d = torch.autograd.grad(value64, [temperature, delta], create_graph=True)
        chain = (torch.sigmoid(raw_t), delta.detach())  # d softplus(raw) / d raw, d exp(raw) / d raw
        expected = [g_t * chain[0], g_d * chain[1]]
        with torch.no_grad():
            if form == "weight":
                lam_j = jac.T @ torch.block_diag(*((torch.diag_embed(p) - p[:, None] * p[None]) / temperature
                                                   for p in out.softmax(-1)))
                matrix = lam_j @ jac + delta * torch.eye(count, dtype=torch.float64)
                d_matrix = summed + (count + 1) * eps * torch.linalg.matrix_norm(matrix).item()
            else:
                d_matrix = (n * c + 1) * eps * torch.linalg.matrix_norm(jac @ jac.T).item()
        for k, grad in enumerate(expected):
            s_jac, s_out, s_t, s_d, s_m = torch.autograd.grad(
                grad.reshape(()), [jac, out, temperature, delta, perturbation], retain_graph=True)
            bound = ((s_jac.abs() * d_jac).sum() + (s_out.abs() * d_out).sum()
                     + 3 * eps * ((s_t * temperature).abs() + (s_d * delta).abs() + grad.abs())
                     + torch.linalg.matrix_norm(s_m) * d_matrix).item()
            bounds[k] = max(bounds[k], bound)
        value64 = value64.detach()
    tolerance = float32_laplace_tolerances(net64, x64, y, lambda f, yy: reference_log_prob(
        "softmax", f, yy, temperature=temperature.item()), x64[:2], delta=delta.item(), gaussian=False)["evidence"]
    for v in (value, ref):
        assert abs(v.double() - value64).item() <= tolerance
    assert tolerance < 1e-2 * abs(value64).item()  # a 1e-2 bug still fails
    for route in (grads, ref_grads):
        for got, want, bound in zip(route, expected, bounds):
            assert abs(got.double().reshape(()) - want.detach().reshape(())).item() <= bound
    for want, bound in zip(expected, bounds):
        assert bound < 1e-2 * abs(want.item())


def test_bad_method_is_named():
    net, x, y, lik = make_problem("regression1")
    model = ntkgp.NTKGP(net, x, y, lik, prior_structure="network")
    with pytest.raises(ValueError, match="method"):
        model.log_marginal_likelihood(method="svd")
    with pytest.raises(TypeError, match="options"):
        model.log_marginal_likelihood(options={"num_probes": 3})
