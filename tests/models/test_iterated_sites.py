"""Iterated sites: NTKGP.condition_on(iterate=True) and SFR.update(iterate=True) against brute-force modes.

The references optimize the linearized model's log joint densely in float64, by Newton's method in the
weights (NTKGP) or in the inducing coefficients (SFR) with autograd Hessians, using torch.distributions for
log p(y|f): independent of ntkgp's site algebra.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ntkgp
from ntkgp.laplace.function_space.site_posterior import SiteIterationWarning, damped_newton
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from tests.helpers import brute_jacobian, mlp, reference_log_prob, rel_err

DELTA = 0.7


def problem(kind: str, n: int = 18, seed: int = 0):
    torch.manual_seed(seed)
    x = 1.5 * torch.randn(n, 2, dtype=torch.float64)
    if kind == "binary":
        net, lik = mlp(d_in=2, width=5, d_out=1, seed=seed), LogisticLikelihood(temperature=0.8).double()
        y = (torch.rand(n) > 0.5).double()
        log_prob = lambda f, yy: reference_log_prob("logistic", f, yy, temperature=0.8)
    else:
        net, lik = mlp(d_in=2, width=5, d_out=3, seed=seed), SoftmaxLikelihood(num_classes=3).double()
        y = torch.randint(0, 3, (n,))
        log_prob = lambda f, yy: reference_log_prob("softmax", f, yy)
    with torch.no_grad():  # large weights: confident outputs, far from the mode of the linearized model
        for p in net.parameters():
            p.mul_(3.0)
    return net, x, y, lik, log_prob


def newton_maximize(objective, start: torch.Tensor, iterations: int = 100) -> torch.Tensor:
    """Dense Newton with backtracking on a smooth concave objective (autograd gradient and Hessian)."""
    v = start.clone()
    for _ in range(iterations):
        grad = torch.autograd.functional.jacobian(objective, v)
        if grad.abs().max() < 1e-13:
            break
        hess = torch.autograd.functional.hessian(objective, v)
        step = torch.linalg.solve(-hess, grad)
        t, value = 1.0, objective(v)
        while objective(v + t * step) < value - 1e-14 * value.abs() and t > 1e-10:
            t /= 2
        v = v + t * step
    return v


def brute_force_linearized_mode(net, x, y, log_prob, delta: float):
    """θ̂ maximizing Σ log p(y | f(X;θ*) + J(θ − θ*)) − δ/2 ‖θ‖², with J by autograd rows."""
    j, _ = brute_jacobian(net, x)
    theta_star = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    with torch.no_grad():
        f0 = net(x)
    n, c = f0.shape

    def objective(theta):
        f = f0 + (j @ (theta - theta_star)).reshape(n, c)
        return log_prob(f, y).sum() - 0.5 * delta * theta @ theta

    return newton_maximize(objective, theta_star), theta_star, j


@pytest.mark.parametrize("kind", ["binary", "softmax"])
@pytest.mark.parametrize("space", ["function", "weight"])
def test_condition_on_iterates_to_the_brute_force_mode(kind, space):
    net, x, y, lik, log_prob = problem(kind)
    model = ntkgp.NTKGP(
        net, x[:12], y[:12], lik, prior_precision=DELTA, prior_structure="network", space=space
    ).eval()
    updated = model.condition_on(x[12:], y[12:])  # iterate=True is the default
    assert updated.iterated_sites and not model.iterated_sites
    theta_hat, theta_star, j = brute_force_linearized_mode(net, x, y, log_prob, DELTA)
    post = updated.site_posterior()
    assert post.newton_steps > 1
    with torch.no_grad():
        f_hat = net(x) + (j @ (theta_hat - theta_star)).reshape(x.shape[0], -1)
    assert rel_err(post.sites, f_hat) < 1e-8
    # the predictive at new inputs is the Laplace approximation at the mode: mean J*θ̂-linearized, covariance J* H⁻¹ J*ᵀ
    x_test = torch.randn(5, 2, dtype=torch.float64)
    j_test, _ = brute_jacobian(net, x_test)
    with torch.no_grad():
        f_test = net(x_test) + (j_test @ (theta_hat - theta_star)).reshape(5, -1)
        n, c = f_hat.shape
        lam = -torch.stack(
            [
                torch.autograd.functional.hessian(
                    lambda f, i=i: log_prob(f.unsqueeze(0), y[i : i + 1]).sum(), f_hat[i]
                )
                for i in range(n)
            ]
        )
        jn = j.reshape(n, c, -1)
        h = torch.einsum("ncp,ncd,ndq->pq", jn, lam, jn) + DELTA * torch.eye(j.shape[1], dtype=torch.float64)
        covariance = j_test @ torch.linalg.solve(h, j_test.T)
        pred = updated(x_test)
    assert rel_err(pred.mean.reshape(5, -1), f_test) < 1e-8
    assert rel_err(pred.covariance_matrix, covariance) < 1e-8


@pytest.mark.parametrize("kind", ["binary", "softmax"])
def test_one_step_stays_available_and_differs(kind):
    net, x, y, lik, _ = problem(kind)
    model = ntkgp.NTKGP(net, x[:12], y[:12], lik, prior_precision=DELTA).eval()
    one_step = model.condition_on(x[12:], y[12:], iterate=False)
    iterated = model.condition_on(x[12:], y[12:], iterate=True)
    union = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA).eval()
    x_test = torch.randn(4, 2, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(one_step(x_test).mean, union(x_test).mean) < 1e-10
        assert rel_err(iterated(x_test).mean, union(x_test).mean) > 1e-3
    assert one_step.site_posterior().newton_steps == 0 and not one_step.iterated_sites


def test_iterated_mode_follows_the_hyperparameters():
    net, x, y, lik, log_prob = problem("binary")
    model = ntkgp.NTKGP(net, x[:12], y[:12], lik, prior_precision=DELTA, prior_structure="network").eval()
    updated = model.condition_on(x[12:], y[12:])
    first = updated.site_posterior().sites.clone()
    updated.covar_module.prior_precision = 3.0  # the mode depends on δ: recomputed, never stale
    theta_hat, theta_star, j = brute_force_linearized_mode(net, x, y, log_prob, 3.0)
    with torch.no_grad():
        f_hat = net(x) + (j @ (theta_hat - theta_star)).reshape(x.shape[0], -1)
    assert rel_err(updated.site_posterior().sites, f_hat) < 1e-8
    assert rel_err(first, f_hat) > 1e-3


def test_gaussian_sites_are_exact_and_iterate_is_validated():
    torch.manual_seed(0)
    x, y = torch.randn(14, 3, dtype=torch.float64), torch.randn(14, dtype=torch.float64)
    net = mlp(d_out=1)
    import gpytorch

    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x[:10], y[:10], lik).eval()
    a, b = model.condition_on(x[10:], y[10:]), model.condition_on(x[10:], y[10:], iterate=False)
    assert not a.iterated_sites
    with torch.no_grad():
        assert torch.equal(a(x).mean, b(x).mean)
    for bad in ("yes", 1, 1.0):
        with pytest.raises(TypeError, match="iterate"):
            model.condition_on(x[10:], y[10:], iterate=bad)


# ---------------------------------------------------------------------- SFR
def brute_force_sfr_mode(net, x_old, y_old, x_new, y_new, z, log_prob, delta: float):
    """α̂ maximizing Σ_new log p(y | m + K_nZ α) − ½ αᵀ(K_ZZ + B_old)α + αᵀ ỹ_old (joint outputs, dense)."""

    def gram(a, b):
        ja, _ = brute_jacobian(net, a)
        jb, _ = brute_jacobian(net, b)
        return ja @ jb.T / delta

    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def mean(a):
        ja, _ = brute_jacobian(net, a)
        with torch.no_grad():
            return net(a) - (ja @ theta).reshape(a.shape[0], -1)

    with torch.no_grad():
        f_old = net(x_old)
    n = f_old.shape[0]
    g_old, lam_old = [], []
    for i in range(n):
        fn = lambda f, i=i: log_prob(f.unsqueeze(0), y_old[i : i + 1]).sum()
        g_old.append(torch.autograd.functional.jacobian(fn, f_old[i]))
        lam_old.append(-torch.autograd.functional.hessian(fn, f_old[i]))
    g_old, lam_old = torch.stack(g_old), torch.stack(lam_old)
    r_old = torch.einsum("nij,nj->ni", lam_old, f_old - mean(x_old)) + g_old
    k_zo = gram(z, x_old)
    lam_block = torch.block_diag(*lam_old)
    b_old = k_zo @ lam_block @ k_zo.T
    y_u = k_zo @ r_old.reshape(-1)
    k_zz, k_zn = gram(z, z), gram(z, x_new)
    m_new = mean(x_new)

    def objective(alpha):
        f = m_new + (k_zn.T @ alpha).reshape(m_new.shape)
        return log_prob(f, y_new).sum() - 0.5 * alpha @ (k_zz + b_old) @ alpha + alpha @ y_u

    return newton_maximize(objective, torch.zeros(k_zz.shape[0], dtype=torch.float64)), mean, gram


@pytest.mark.parametrize("kind", ["binary", "softmax"])
def test_sfr_update_iterates_to_the_brute_force_mode(kind):
    net, x, y, lik, log_prob = problem(kind)
    z = x[:7].clone()
    sfr = ntkgp.SFR(
        net, x[:12], y[:12], lik, inducing_points=z, prior_precision=DELTA, prior_structure="network"
    )
    sfr.update(x[12:], y[12:])  # iterate=True is the default for classification
    alpha, mean, gram = brute_force_sfr_mode(net, x[:12], y[:12], x[12:], y[12:], z, log_prob, DELTA)
    x_test = torch.cat([x[12:], torch.randn(4, 2, dtype=torch.float64)])
    expected = mean(x_test) + (gram(x_test, z) @ alpha).reshape(x_test.shape[0], -1)
    with torch.no_grad():
        got = sfr(x_test).mean.reshape(x_test.shape[0], -1)
    assert rel_err(got, expected) < 1e-8


def test_sfr_one_step_update_is_still_the_union():
    net, x, y, lik, _ = problem("softmax")
    z = x[:7].clone()
    kw = {"inducing_points": z, "prior_precision": DELTA}
    one_step = ntkgp.SFR(net, x[:12], y[:12], lik, **kw).update(x[12:], y[12:], iterate=False)
    iterated = ntkgp.SFR(net, x[:12], y[:12], lik, **kw).update(x[12:], y[12:])
    union = ntkgp.SFR(net, x, y, lik, **kw)
    x_test = torch.randn(4, 2, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(one_step(x_test).mean, union(x_test).mean) < 1e-10
        assert rel_err(iterated(x_test).mean, union(x_test).mean) > 1e-3
    with pytest.raises(TypeError, match="iterate"):
        one_step.update(x[12:], y[12:], iterate="no")


def test_damped_newton_warns_without_convergence():
    # a concave objective whose "Newton target" only halves the distance: never within tolerance in 3 steps
    def target(state):
        return (state[0] / 2,)

    def objective(state):
        return -(state[0] ** 2).sum()

    state, steps, converged = damped_newton(
        (torch.ones(3, dtype=torch.float64),), target, objective, max_steps=3
    )
    assert steps == 3 and not converged
    state, steps, converged = damped_newton(
        (torch.ones(3, dtype=torch.float64),), target, objective, max_steps=200
    )
    assert converged and state[0].abs().max() < 1e-7
    assert issubclass(SiteIterationWarning, RuntimeWarning)


# ---------------------------------------------------------------------- the held-back moon tip
def two_moons(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's make_moons, written out (importing scikit-learn costs seconds)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, torch.pi, n // 2, dtype=torch.float64)
    upper = torch.stack([t.cos(), t.sin()], -1)
    lower = torch.stack([1 - t.cos(), 0.5 - t.sin()], -1)
    x = torch.cat([upper, lower]) + 0.1 * torch.randn(n // 2 * 2, 2, generator=g, dtype=torch.float64)
    return x, torch.cat([torch.zeros(n // 2), torch.ones(n // 2)]).long()


def moon_tip(seed: int = 0):
    """A 2-layer tanh MLP trained (MAP, δ = 0.1) on two moons without the right tip of the lower moon."""
    x, y = two_moons(120, seed)
    x_test, y_test = two_moons(400, seed + 100)
    tip = (y == 1) & (x[:, 0] > 1.5)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    optimizer = torch.optim.LBFGS(
        net.parameters(), max_iter=300, tolerance_grad=1e-7, line_search_fn="strong_wolfe"
    )

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(
            net(x[~tip]).squeeze(-1), y[~tip].double(), reduction="sum"
        )
        loss = loss + 0.05 * sum((p**2).sum() for p in net.parameters())
        loss.backward()
        return loss

    optimizer.step(closure)
    return net, x[~tip], y[~tip], x[tip], y[tip], x_test, y_test


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return ((model(x).mean.reshape(-1) > 0).long() == y).double().mean().item()


def test_moon_tip_accuracy_is_recovered_by_iterated_sites():
    net, x, y, x_tip, y_tip, x_test, y_test = moon_tip()
    with torch.no_grad():
        assert net(x_tip).min() < -5  # the network is confidently wrong on the held-out tip
    lik = LogisticLikelihood().double()
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=0.1, prior_structure="network").eval()
    before = accuracy(model, x_test, y_test)
    one_step = accuracy(model.condition_on(x_tip, y_tip, iterate=False), x_test, y_test)
    iterated = accuracy(model.condition_on(x_tip, y_tip), x_test, y_test)
    assert one_step < before - 0.1  # one Newton step from θ* overshoots
    assert iterated > max(before, 0.97)
    sfr = ntkgp.SFR(net, x, y, lik, num_inducing=40, prior_precision=0.1, prior_structure="network")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SiteIterationWarning)
        sfr.update(x_tip, y_tip)
    assert accuracy(sfr, x_test, y_test) > max(before, 0.97)
