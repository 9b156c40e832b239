"""The Laplace-GGN evidence against the dense weight-space formula (log-determinant of the P×P GGN + prior)."""

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from ntkgp.ntk import resolve_groups
from tests.helpers import column_groups, dense_laplace, reference_log_prob, rel_err
from tests.problems import KINDS, make_problem


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("space", ["function", "weight"])
@pytest.mark.parametrize("curvature", ["ggn", "ef"])
def test_evidence_equals_dense_weight_space_formula(kind, per_group, space, curvature):
    net, x, y, lik, log_prob = make_problem(kind)
    delta = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64) if per_group else torch.tensor(3.0, dtype=torch.float64)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=delta)
    pg = resolve_groups(net)
    cols = column_groups(net, dict(zip(pg.names, pg.group_of)))
    delta_cols = delta.expand(3)[cols]
    ref = dense_laplace(net, x, y, log_prob, delta_cols, curvature)["evidence"]
    ours = model.log_marginal_likelihood(curvature=curvature, space=space)
    assert rel_err(ours.detach(), ref) < 1e-8
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, curvature=curvature, space=space)
    assert rel_err(mll(model(x), y).detach() * x.shape[0], ref) < 1e-8


def test_auto_space_picks_the_cheaper_route(monkeypatch):
    net, x, y, lik, _ = make_problem("regression1", n=12)  # N·C = 12 < P = 100: function space
    model = ntkgp.NTKGP(net, x, y, lik)
    calls = []
    monkeypatch.setattr(type(model.covar_module), "jacobian", lambda self, xx: calls.append("J") or torch.zeros(1))
    model.log_marginal_likelihood()
    assert calls == []
    big_x = torch.randn(150, 3, dtype=torch.float64)  # N·C = 150 > P = 100: weight space
    big = ntkgp.NTKGP(net, big_x, torch.randn(150, dtype=torch.float64), lik)
    monkeypatch.undo()
    ref = big.log_marginal_likelihood(space="function")
    assert rel_err(big.log_marginal_likelihood(space="auto").detach(), ref.detach()) < 1e-9


@pytest.mark.parametrize("kind", KINDS)
def test_evidence_gradients_match_finite_differences(kind):
    net, x, y, lik, _ = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64))
    params = [p for p in model.hyperparameters() if p.requires_grad]
    value = model.log_marginal_likelihood()
    grads = torch.autograd.grad(value, params)
    eps = 1e-6
    for p, g in zip(params, grads):
        for i in range(p.numel()):
            flat = p.data.view(-1)
            old = flat[i].item()
            flat[i] = old + eps
            up = model.log_marginal_likelihood().item()
            flat[i] = old - eps
            down = model.log_marginal_likelihood().item()
            flat[i] = old
            fd = (up - down) / (2 * eps)
            assert abs(fd - g.view(-1)[i].item()) < 1e-5 * max(1.0, abs(fd))


def test_grams_are_computed_once_across_hyperparameter_steps(monkeypatch):
    net, x, y, lik, _ = make_problem("softmax4")
    model = ntkgp.NTKGP(net, x, y, lik)
    model.log_marginal_likelihood()
    engine = model.covar_module.engine
    monkeypatch.setattr(engine, "group_grams", lambda *a, **k: pytest.fail("Grams recomputed"))
    optimizer = torch.optim.Adam(model.hyperparameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        (-model.log_marginal_likelihood()).backward()
        optimizer.step()


def test_mll_uses_the_likelihood_it_is_given():
    net, x, y, lik, log_prob = make_problem("regression1")
    model = ntkgp.NTKGP(net, x, y, lik).train()
    other = gpytorch.likelihoods.GaussianLikelihood().double()
    other.noise = 0.7
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(other, model)
    value = mll(model(x), y).detach() * x.shape[0]
    pg = resolve_groups(net)
    cols = column_groups(net, dict(zip(pg.names, pg.group_of)))
    ref = dense_laplace(
        net, x, y, lambda f, yy: reference_log_prob("gaussian", f, yy, other.noise.detach()), torch.ones(3, dtype=torch.float64)[cols]
    )["evidence"]
    assert rel_err(value, ref) < 1e-8
    assert rel_err(value, model.log_marginal_likelihood().detach()) > 1e-3  # not the model's own likelihood


def test_mll_takes_the_prior_covariance_from_function_dist():
    net, x, y, lik, _ = make_problem("softmax4")
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=2.0).train()
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, space="function")
    prior = model(x)
    scaled = type(prior)(prior.mean, prior.lazy_covariance_matrix * 4.0)  # 4 K ⇔ δ/4 in the log-determinant
    value = mll(scaled, y) * x.shape[0]
    model.covar_module.prior_precision = 0.5
    expected = model.log_marginal_likelihood().detach()
    model.covar_module.prior_precision = 2.0
    # only the log-determinant reads the covariance; the prior term stays that of δ = 2
    delta_term = 0.5 * (0.5 - 2.0) * model.covar_module.engine.group_sq_norms().sum()
    assert rel_err(value.detach(), expected + delta_term) < 1e-10


def test_mll_checks_its_arguments():
    net, x, y, lik, _ = make_problem("binary")
    model = ntkgp.NTKGP(net, x, y, lik)
    with pytest.raises(TypeError, match="model"):
        ntkgp.LaplaceGGNMarginalLogLikelihood(lik, torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="outputs"):
        ntkgp.LaplaceGGNMarginalLogLikelihood(SoftmaxLikelihood(num_classes=3), model)
    with pytest.raises(ValueError, match="curvature"):
        ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, curvature="hessian")
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    model.train()
    with pytest.raises(ValueError, match="training outputs"):
        mll(model(x[:5]), y)
    with pytest.raises(ValueError, match="target"):
        mll(model(x), y[:5])
    model.eval()
    with pytest.raises(RuntimeError, match="model.train"):
        mll(model(x), y)


@pytest.mark.parametrize("method", ["cholesky", "eigen", "matrix_free"])
def test_mll_method_override_matches_dense_formula(method, monkeypatch):
    """The MLL's ``method=`` reaches the evidence routes (the route's own function is called): each equals the
    dense weight-space formula (exactly for the dense routes; within the stochastic estimate's tolerance for the
    matrix-free one), value and gradient."""
    import ntkgp.laplace.function_space.evidence as evidence_module

    route_function = {"cholesky": "evidence_curvature", "eigen": "checked_spectral_evidence", "matrix_free": "matrix_free_log_det"}
    calls = []
    original = getattr(evidence_module, route_function[method])
    monkeypatch.setattr(evidence_module, route_function[method], lambda *a, **k: calls.append(1) or original(*a, **k))
    net, x, y, lik, log_prob = make_problem("softmax4", n=10)
    delta = torch.tensor(2.0, dtype=torch.float64)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=delta, prior_structure="network")  # one δ: eigen applies
    num_params = sum(p.numel() for p in net.parameters())
    ref = dense_laplace(net, x, y, log_prob, delta.expand(num_params), "ggn")["evidence"]
    options = ntkgp.laplace.EvidenceOptions(num_probes=2000, cg_tolerance=1e-5, max_cg_iterations=200,
                                            lanczos_iterations=60, seed=0)
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, method=method, options=options)
    model.train()
    value = mll(model(x), y) * x.shape[0]
    assert calls, f"method={method!r} did not take its route"
    tol = 1e-8 if method != "matrix_free" else 2e-2
    assert rel_err(value.detach(), ref) < tol
    # the gradient in the raw prior precision against the Cholesky route
    (grad,) = torch.autograd.grad(value, [p for p in model.hyperparameters() if p.requires_grad][0])
    exact = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, method="cholesky")
    (grad_ref,) = torch.autograd.grad(exact(model(x), y) * x.shape[0],
                                      [p for p in model.hyperparameters() if p.requires_grad][0])
    assert rel_err(grad, grad_ref) < (1e-8 if method != "matrix_free" else 0.1)


def test_mll_rejects_bad_method_and_options_before_any_side_effect():
    net, x, y, lik, _ = make_problem("regression1")
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="method"):
        ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, method="lanczos")
    with pytest.raises(TypeError, match="options"):
        ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, options={"num_probes": 3})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_prior_on_the_noise_is_added_once():
    """A GPyTorch prior on the likelihood's noise adds log p(σ²) to the evidence once (the likelihood is reached
    both as the MLL's likelihood and as the model's), as in GPyTorch's ExactMarginalLogLikelihood."""
    torch.manual_seed(0)
    x = torch.randn(20, 2, dtype=torch.float64)
    y = torch.sin(2 * x[:, 0])
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    prior = gpytorch.priors.GammaPrior(torch.tensor(2.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64))

    def evidence(noise_prior):
        lik = gpytorch.likelihoods.GaussianLikelihood(noise_prior=noise_prior).double()
        lik.noise = 0.2
        model = ntkgp.NTKGP(net, x, y, lik).train()
        return ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)(model(x), y) * 20

    expected = prior.log_prob(torch.tensor(0.2, dtype=torch.float64))
    difference = (evidence(prior) - evidence(None)).item()
    assert abs(difference - expected.item()) < 1e-5 * abs(expected.item())  # twice would be off by 100 %


def test_the_prior_at_other_inputs_and_out_of_range_options_are_refused():
    """model(x_other) with the same N is the kernel at other inputs: refused, as the site factors are at
    train_x; a seed whose successor overflows the generator is refused when the options are made."""
    from ntkgp.laplace import EvidenceOptions

    torch.manual_seed(0)
    x = torch.randn(10, 2, dtype=torch.float64)
    y = (x[:, 0] > 0).double()
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    lik = LogisticLikelihood().double()  # a LaplaceNTKGP (an ExactGP refuses other inputs in train mode itself)
    model = ntkgp.NTKGP(net, x, y, lik).train()
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    with pytest.raises(ValueError, match="at other inputs"):
        mll(model(torch.randn(10, 2, dtype=torch.float64)), y)
    assert torch.isfinite(mll(model(x), y))
    with pytest.raises(ValueError, match="seed"):
        EvidenceOptions(seed=2**64 - 1)
    import numpy as np

    assert EvidenceOptions(num_probes=np.int64(4), seed=np.int64(3)).num_probes == 4
