"""One prior precision: the eigen route of the evidence against the Cholesky route (values and gradients, 1e-10),
its validity rule, its cache and its use by "auto"."""

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.laplace.function_space import EvidenceOptions, evidence_method, laplace_log_marginal_likelihood
from tests.helpers import dense_laplace, mlp, reference_log_prob, rel_err
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


def test_float32():
    net, x, y, lik = make_problem("softmax3", n=20, dtype=torch.float32)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=2.0, prior_structure="network")
    ref, ref_grads = value_and_grads(model, method="cholesky")
    value, grads = value_and_grads(model, method="eigen")
    assert value.dtype == torch.float32
    assert rel_err(value, ref) < 1e-4
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-3


def test_bad_method_is_named():
    net, x, y, lik = make_problem("regression1")
    model = ntkgp.NTKGP(net, x, y, lik, prior_structure="network")
    with pytest.raises(ValueError, match="method"):
        model.log_marginal_likelihood(method="svd")
    with pytest.raises(TypeError, match="options"):
        model.log_marginal_likelihood(options={"num_probes": 3})
