"""The one-object path of a weight-space posterior (``laplace_posterior``): its evidence, the choice of δ (evidence
by gradient steps or a grid, validation by a grid), its predictive samples and its state dict, each against an
independent dense computation (explicit GGN / EF from autograd, ``torch.linalg.slogdet``, torch.distributions)."""

from __future__ import annotations

import io
import math

import pytest
import torch

import ntkgp
from ntkgp.laplace import laplace_posterior
from ntkgp.likelihoods import SoftmaxLikelihood
from tests.helpers import attains_optimum, float32_precision_error, mlp
from tests.posteriors.reference import (
    DTYPE,
    dense_curvature,
    jacobian,
    kronecker_precision,
    likelihood_case,
    targets,
)

N = 14
STRUCTURES = ("full_ggn", "full_ef", "kfac", "diag_ggn", "diag_ef")


def problem(name: str = "softmax", seed: int = 0):
    lik, c, log_prob = likelihood_case(name)
    net = mlp(d_in=2, width=5, d_out=c, depth=1, seed=seed)
    x = torch.randn(N, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(seed + 1))
    return net, x, targets(name, N), lik, log_prob


def group_columns(net) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer group of every column (one per Linear layer, written here) and ‖θ*‖² per column."""
    cols = [torch.full((p.numel(),), int(n.split(".")[0]) // 2) for n, p in net.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return torch.cat(cols), theta


def reference_evidence(net, x, y, log_prob, delta: torch.Tensor, structure: str, posterior=None) -> torch.Tensor:
    """log p(y|f) − ½ Σ δ θ² + ½ Σ log δ − ½ log|H + P0|, with H dense (full), its diagonal, or explicit Kronecker
    products of the posterior's factors (KFAC), from autograd; differentiable in ``delta`` (one per layer)."""
    cols, theta = group_columns(net)
    d = delta[cols] if delta.numel() > 1 else delta.expand(cols.shape[0])
    with torch.no_grad():
        f = net(x)
    fit = log_prob(f, y).sum()
    if structure == "kfac":
        # explicit torch.kron blocks of the posterior's factors plus δI (differentiable in δ)
        h = kronecker_precision(net, posterior.evidence_curvature, posterior.likelihood, delta.expand(2))
    else:
        h = dense_curvature(net, x, y, log_prob, "ef" if structure.endswith("ef") else "ggn")
        if structure.startswith("diag"):
            h = torch.diag(torch.diagonal(h))
        h = h + torch.diag(d)
    return fit - 0.5 * (d * theta**2).sum() + 0.5 * d.log().sum() - 0.5 * torch.linalg.slogdet(h)[1]


@pytest.mark.parametrize("name", ["softmax", "gaussian"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_evidence_equals_the_dense_reference(structure, name):
    net, x, y, lik, log_prob = problem(name)
    posterior = laplace_posterior(net, x, y, lik, structure=structure)
    delta = torch.tensor([0.7, 2.5], dtype=DTYPE, requires_grad=True)
    value = posterior.log_marginal_likelihood(delta)
    reference = reference_evidence(net, x, y, log_prob, delta, structure, posterior)
    # float64 throughout: P = 33 terms of log-determinants, errors ~ 1e-13 relative
    assert abs(value.item() - reference.item()) <= 1e-9 * abs(reference.item())
    (grad,) = torch.autograd.grad(value, delta)
    (expected,) = torch.autograd.grad(reference, delta)
    torch.testing.assert_close(grad, expected, rtol=1e-8, atol=1e-10)
    # default: the posterior's current δ
    posterior.prior_precision = delta.detach()
    assert abs(posterior.log_marginal_likelihood().item() - reference.item()) <= 1e-9 * abs(reference.item())


def test_evidence_optimum_matches_a_dense_brute_force_grid():
    net, x, y, lik, log_prob = problem("softmax")
    h = dense_curvature(net, x, y, log_prob, "ggn")
    eigenvalues = torch.linalg.eigvalsh(h)
    theta_sq = sum(p.detach().square().sum() for p in net.parameters())
    with torch.no_grad():
        fit = log_prob(net(x), y).sum()
    grid = torch.logspace(-3, 3, 3001, dtype=DTYPE)
    dense = fit - 0.5 * grid * theta_sq + 0.5 * eigenvalues.numel() * grid.log() \
        - 0.5 * (eigenvalues[None, :] + grid[:, None]).log().sum(-1)
    best = grid[dense.argmax()]
    spacing = math.log(grid[1] / grid[0])
    for optimizer, steps in (("adam", 300), ("lbfgs", 100)):
        posterior = laplace_posterior(net, x, y, lik, structure="full_ggn", prior_structure="network")
        delta = posterior.optimize_prior_precision(optimizer=optimizer, steps=steps, lr=0.1)
        assert delta.shape == (1,) and torch.equal(posterior.prior_precision, delta)
        # the optimum of a smooth function of log δ: within one step of the dense grid
        assert abs(math.log(delta.item() / best.item())) <= spacing, (optimizer, delta.item(), best.item())
        found = posterior.log_marginal_likelihood().item()
        assert found >= dense.max().item() - 1e-9 * abs(dense.max().item())
    coarse = torch.logspace(-2, 2, 17, dtype=DTYPE)
    posterior = laplace_posterior(net, x, y, lik, structure="full_ggn", prior_structure="network")
    chosen = posterior.optimize_prior_precision(optimizer="grid", grid=coarse)
    on_coarse = fit - 0.5 * coarse * theta_sq + 0.5 * eigenvalues.numel() * coarse.log() \
        - 0.5 * (eigenvalues[None, :] + coarse[:, None]).log().sum(-1)
    assert attains_optimum(coarse, on_coarse, chosen)


@pytest.mark.parametrize("structure", ["kfac", "diag_ggn"])
def test_per_layer_optimum_is_a_maximum_of_the_reference(structure):
    net, x, y, lik, log_prob = problem("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure=structure, prior_precision=torch.tensor([3.0, 0.2]))
    delta = posterior.optimize_prior_precision(optimizer="lbfgs", steps=100)
    log_delta = delta.log().clone().requires_grad_(True)
    value = reference_evidence(net, x, y, log_prob, log_delta.exp(), structure, posterior)
    (grad,) = torch.autograd.grad(value, log_delta)
    # stationary in log δ: the gradient is ~1e-6 of the evidence's scale (L-BFGS's tolerance)
    assert grad.abs().max().item() <= 1e-5 * abs(value.item())
    for k in range(2):
        for factor in (1.1, 1 / 1.1):
            moved = delta.clone()
            moved[k] *= factor
            assert reference_evidence(net, x, y, log_prob, moved, structure, posterior) < value


def test_validation_picks_the_lowest_independent_nll_regression():
    net, x, y, lik, _ = problem("gaussian")
    x_val = torch.randn(9, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(7))
    y_val = torch.randn(9, 1, dtype=DTYPE, generator=torch.Generator().manual_seed(8))
    posterior = laplace_posterior(net, x, y, lik, structure="full_ggn", prior_structure="network")
    grid = torch.tensor([0.01, 0.1, 1.0, 10.0, 100.0], dtype=DTYPE)
    h = dense_curvature(net, x, y, lambda f, t: torch.distributions.Normal(f, lik.noise.detach().sqrt())
                        .log_prob(t.reshape(f.shape)).sum(-1), "ggn")
    jac = jacobian(net, x_val)[:, 0]  # (N, P)
    with torch.no_grad():
        mean = net(x_val)[:, 0]
    nll = []
    for delta in grid:
        sigma = torch.linalg.inv(h + delta * torch.eye(h.shape[0], dtype=DTYPE))
        var = torch.einsum("np,pq,nq->n", jac, sigma, jac) + lik.noise.detach()
        nll.append(-torch.distributions.Normal(mean, var.sqrt()).log_prob(y_val[:, 0]).mean())
    chosen = posterior.optimize_prior_precision(method="validation", grid=grid, x_val=x_val, y_val=y_val)
    assert attains_optimum(grid, torch.stack(nll), chosen, maximize=False)
    # the same data as an iterable of batches
    batches = [(x_val[:4], y_val[:4]), (x_val[4:], y_val[4:])]
    posterior.prior_precision = 1.0
    by_batches = posterior.optimize_prior_precision(method="validation", grid=grid, x_val=batches)  # sums by batch
    assert attains_optimum(grid, torch.stack(nll), by_batches, maximize=False)


def test_validation_picks_the_lowest_independent_nll_classification():
    net, x, y, lik, log_prob = problem("softmax")
    x_val = torch.randn(10, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(3)) * 2
    y_val = torch.randint(0, 3, (10,), generator=torch.Generator().manual_seed(4))
    posterior = laplace_posterior(net, x, y, lik, structure="full_ggn", prior_structure="network")
    grid = torch.logspace(-2, 2, 9, dtype=DTYPE)
    h = dense_curvature(net, x, y, log_prob, "ggn")
    jac = jacobian(net, x_val)  # (N, C, P)
    with torch.no_grad():
        mean = net(x_val)
    nll = []
    for delta in grid:
        sigma = torch.linalg.inv(h + delta * torch.eye(h.shape[0], dtype=DTYPE))
        var = torch.einsum("ncp,pq,ncq->nc", jac, sigma, jac)
        probs = torch.softmax(mean / (1 + math.pi / 8 * var).sqrt(), dim=-1)  # the probit approximation
        nll.append(-probs[torch.arange(10), y_val].log().mean())
    chosen = posterior.optimize_prior_precision(method="validation", grid=grid, x_val=x_val, y_val=y_val,
                                                link="probit")
    assert attains_optimum(grid, torch.stack(nll), chosen, maximize=False)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_state_dict_restores_without_a_pass(structure):
    net, x, y, lik, _ = problem("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure=structure, prior_precision=torch.tensor([0.5, 3.0]))
    buffer = io.BytesIO()
    torch.save(posterior.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # tensors, strings, numbers and lists only
    restored = type(posterior).from_state_dict(state, net, lik)
    torch.testing.assert_close(restored.prior_precision, posterior.prior_precision, rtol=0, atol=0)
    torch.testing.assert_close(restored.dense_precision(), posterior.dense_precision(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(restored.log_marginal_likelihood(), posterior.log_marginal_likelihood(), rtol=1e-12,
                               atol=0)
    other = laplace_posterior(net, x[:7], y[:7], lik, structure=structure)
    other.load_state_dict(state)
    torch.testing.assert_close(other.dense_covariance(), posterior.dense_covariance(), rtol=1e-10, atol=1e-12)


def test_state_dict_refuses_another_network_or_class():
    net, x, y, lik, _ = problem("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure="kfac")
    state = posterior.state_dict()
    moved = mlp(d_in=2, width=5, d_out=3, depth=1, seed=9)
    with pytest.raises(ValueError, match="weights"):
        type(posterior).from_state_dict(state, moved, lik)
    diag = laplace_posterior(net, x, y, lik, structure="diag_ggn", prior_precision=2.0)
    before = diag.dense_precision()
    with pytest.raises(ValueError, match="KFACLaplace"):
        diag.load_state_dict(state)
    torch.testing.assert_close(diag.dense_precision(), before, rtol=0, atol=0)


def test_predictive_samples_are_linearized_functions():
    net, x, y, lik, _ = problem("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure="kfac")
    x_test = torch.randn(4, 2, dtype=DTYPE)
    samples = posterior.predictive_samples(x_test, n_samples=6, generator=torch.Generator().manual_seed(2))
    eta = posterior.sample(6, generator=torch.Generator().manual_seed(2))  # the same draws
    jac = jacobian(net, x_test)
    with torch.no_grad():
        expected = net(x_test) + torch.einsum("ncp,sp->snc", jac, eta)
    torch.testing.assert_close(samples, expected, rtol=1e-10, atol=1e-12)
    through_net = posterior.predictive_samples(x_test, n_samples=3, method="nn",
                                               generator=torch.Generator().manual_seed(2))
    eta = posterior.sample(3, generator=torch.Generator().manual_seed(2))
    names = [n for n, _ in net.named_parameters()]
    for s in range(3):
        params = dict(zip(names, (posterior.function.theta() + eta[s]).split([p.numel() for p in net.parameters()])))
        params = {n: v.reshape(p.shape) for (n, p), v in zip(net.named_parameters(), params.values())}
        torch.testing.assert_close(through_net[s], torch.func.functional_call(net, params, (x_test,)), rtol=1e-10,
                                   atol=1e-12)
    prediction = posterior.predict(x_test, link="probit")
    torch.testing.assert_close(prediction.probs, ntkgp.laplace.predict(posterior, x_test, link="probit").probs)


@pytest.mark.parametrize("structure", ["full_ggn", "kfac", "diag_ggn"])
def test_float32_network_matches_its_float64_copy(structure):
    net, x, y, lik, _ = problem("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure=structure, prior_structure="network")
    delta64 = posterior.optimize_prior_precision(optimizer="lbfgs")
    evidence64 = posterior.log_marginal_likelihood()
    cond = torch.linalg.cond(posterior.dense_precision()).item()
    single = laplace_posterior(mlp(d_in=2, width=5, d_out=3, depth=1, seed=0, dtype=torch.float32), x.float(), y,
                               SoftmaxLikelihood(3, temperature=1.3), structure=structure, prior_structure="network")
    delta32 = single.optimize_prior_precision(optimizer="lbfgs")
    evidence32 = single.log_marginal_likelihood()
    assert delta32.dtype == torch.float32
    # float32 rounding of the curvature amplified by the condition number of H + δI in log|H + δI|: the error model
    # of tests.helpers.float32_precision_error (softmax sites at temperature 1.3: ‖Λ_n‖ ≤ ½ / 1.3, ‖g_n‖ ≤ √2 / 1.3),
    # |Δ log Z| ≤ ½ P ηκ + ‖g‖ ‖Δf‖ with η = ‖ΔH‖_F/‖H‖, relative to |log Z| (the structures' H approximate the
    # full GGN: their rounding is bounded by the same sum)
    params = sum(q.numel() for q in net.parameters())
    error = float32_precision_error(net, x, 0.5 / 1.3, factorized=params, delta=float(delta64.max()))
    eta = error["precision"] / torch.linalg.matrix_norm(posterior.dense_precision(), ord=2).item()
    fit = math.sqrt(2 * x.shape[0]) / 1.3 * error["outputs"]
    tolerance = (0.5 * params * eta * cond + fit) / abs(evidence64.item())
    assert tolerance < 1e-2  # a meaningful bound: a 1 % error fails
    assert abs(evidence32.item() - evidence64.item()) <= tolerance * abs(evidence64.item())
    # at the optimum the evidence is flat: δ moves by √(tolerance) relative at most
    assert abs(delta32.item() / delta64.item() - 1) <= math.sqrt(tolerance) + 1e-3


def test_invalid_arguments_are_refused_before_any_change():
    net, x, y, lik, _ = problem("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure="kfac", prior_precision=2.0)
    bad = [
        ({"method": "marglik"}, "method"),
        ({"optimizer": "sgd"}, "optimizer"),
        ({"steps": 0}, "steps"),
        ({"lr": -1.0}, "lr"),
        ({"grid": torch.tensor([1.0, -1.0])}, "grid"),
        ({"grid": torch.ones(3, 5)}, "grid"),
        ({"method": "validation"}, "x_val"),
        ({"method": "validation", "x_val": x, "y_val": y[:3]}, "y_val"),
        ({"method": "validation", "x_val": x, "y_val": y, "metric": "auroc"}, "metric"),
        ({"x_val": x, "y_val": y}, "x_val"),
    ]
    for kwargs, name in bad:
        with pytest.raises((ValueError, TypeError), match=name):
            posterior.optimize_prior_precision(**kwargs)
        assert torch.equal(posterior.prior_precision, torch.full((2,), 2.0, dtype=DTYPE))
    with pytest.raises(ValueError, match="prior_precision"):
        posterior.log_marginal_likelihood(torch.tensor([1.0, -1.0]))
    posterior.damping = True
    with pytest.raises(ValueError, match="damping"):
        posterior.log_marginal_likelihood()


def test_optimizing_leaves_the_likelihood_without_gradients():
    net, x, y, lik, _ = problem("gaussian")
    posterior = laplace_posterior(net, x, y, lik, structure="diag_ggn")
    posterior.optimize_prior_precision(steps=5)
    posterior.optimize_prior_precision(optimizer="lbfgs", steps=5)
    assert all(p.grad is None for p in lik.parameters())
    assert all(p.grad is None for p in net.parameters())
