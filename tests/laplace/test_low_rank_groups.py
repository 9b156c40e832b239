"""The low-rank route of the several-δ weight-space evidence (ggn/low_rank_groups.py): value and gradients
in every δ_g and in the component weight against torch.logdet of the dense w·D + P0 (autograd through it, central
finite differences), with the other precisions above and below the large group's by up to 1e8 and a rank-deficient
D; the route taken inside NTKGP's evidence where it pays and not elsewhere, each step against the dense brute force
as δ and the noise / temperature change and after the weights change; the Cholesky route when C̃'s factorization
fails; float32 against float64."""

import gpytorch
import pytest
import torch

import ntkgp
import ntkgp.laplace.ggn.low_rank_groups as low_rank_groups
from ntkgp.laplace.ggn.low_rank_groups import GroupSchur, low_rank_cheaper
from ntkgp.likelihoods import LogisticLikelihood
from tests.helpers import EPS32, brute_jacobian, mlp, rel_err

from .test_evidence_curvature import brute_evidence

DELTAS = [
    [1.0, 2.0, 0.5, 3.0],  # D of both signs
    [1e4, 1e-4, 1e-2, 1.0],  # the large group's δ far above the others (D ≈ −δ_b)
    [1e-4, 1e4, 1e2, 1.0],  # far below
]


def network_component(n: int, seed: int = 0):
    """D = JᵀJ of a 4-tensor MLP (8-12-1: 96, 12, 12, 1 columns) at n inputs, its column groups and sizes."""
    net = mlp(d_in=8, width=12, d_out=1, depth=1, seed=seed)
    x = torch.randn(n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    j, _ = brute_jacobian(net, x)
    sizes = torch.tensor([p.numel() for p in net.parameters()])
    return j.T @ j, torch.repeat_interleave(torch.arange(4), sizes), sizes


def dense_ratio(weight, delta, component, groups):
    cols = delta[groups]
    return torch.logdet(weight[0] * component + torch.diag(cols)) - cols.log().sum()


@pytest.mark.parametrize("n", [300, 40])  # full rank; rank 40 < P_b = 96 (eigenvalues at the rounding level)
@pytest.mark.parametrize("deltas", DELTAS)
def test_value_and_gradients_equal_autograd_through_the_dense_logdet(n, deltas):
    component, groups, sizes = network_component(n)
    schur = GroupSchur(component, groups, sizes)
    assert schur.block == 0 and int(schur.above.sum()) == min(n, 96)
    weight = torch.tensor([0.7], dtype=torch.float64)
    delta = torch.tensor(deltas, dtype=torch.float64)
    w1, d1 = weight.clone().requires_grad_(), delta.clone().requires_grad_()
    w2, d2 = weight.clone().requires_grad_(), delta.clone().requires_grad_()
    value = schur.log_det_ratio(w1, d1)
    reference = dense_ratio(w2, d2, component, groups)
    assert rel_err(value.detach(), reference.detach()) < 1e-10
    for got, expected in zip(torch.autograd.grad(value, [w1, d1]), torch.autograd.grad(reference, [w2, d2])):
        assert rel_err(got, expected) < 1e-10


def test_gradients_equal_central_finite_differences():
    component, groups, sizes = network_component(300, seed=2)
    schur = GroupSchur(component, groups, sizes)
    weight = torch.tensor([1.3], dtype=torch.float64, requires_grad=True)
    delta = torch.tensor([2.0, 0.3, 5.0, 0.8], dtype=torch.float64, requires_grad=True)
    grad_w, grad_d = torch.autograd.grad(schur.log_det_ratio(weight, delta), [weight, delta])
    h = 1e-6
    with torch.no_grad():
        e = torch.tensor([h], dtype=torch.float64)
        fd = (dense_ratio(weight + e, delta, component, groups) - dense_ratio(weight - e, delta, component, groups))
        assert abs(grad_w.item() - fd.item() / (2 * h)) < 1e-6 * abs(fd.item() / (2 * h))
        for g in range(4):
            e = torch.zeros(4, dtype=torch.float64)
            e[g] = h
            fd = (dense_ratio(weight, delta + e, component, groups)
                  - dense_ratio(weight, delta - e, component, groups)) / (2 * h)
            assert abs(grad_d[g].item() - fd.item()) < 1e-6 * abs(fd.item())


def test_the_rule_takes_the_route_only_where_one_group_dominates():
    assert low_rank_cheaper(torch.tensor([2048, 32, 320, 10]))  # digits, P = 2410
    assert low_rank_cheaper(torch.tensor([400, 50, 50, 1]))  # UCI energy, P = 501
    assert not low_rank_cheaper(torch.tensor([2500, 2500, 50, 150, 50, 1]))  # two equal tensors
    assert not low_rank_cheaper(torch.tensor([500]))  # one group: nothing outside it


def regression(n=150, per_output=False):
    net = mlp(d_in=8, width=12, d_out=2 if per_output else 1, depth=1)
    x = torch.randn(n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if per_output:
        lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_global_noise=False).double()
        return net, x, torch.randn(n, 2, dtype=torch.float64), lik
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = 0.2
    return net, x, torch.randn(n, dtype=torch.float64), lik


def count_calls(monkeypatch):
    calls = []
    original = GroupSchur.log_det_ratio
    monkeypatch.setattr(GroupSchur, "log_det_ratio", lambda self, *a: calls.append(1) or original(self, *a))
    return calls


@pytest.mark.parametrize("kind", ["gaussian", "logistic"])
@pytest.mark.parametrize("curvature", ["ggn", "ef"])
def test_ntkgp_steps_follow_delta_noise_and_weights_against_the_brute_force(monkeypatch, kind, curvature):
    calls = count_calls(monkeypatch)
    if kind == "gaussian":
        net, x, y, lik = regression()
        scale = lambda: lik.noise.reshape(1).reciprocal()  # noqa: E731
    else:
        net, x, _, _ = regression()
        lik = LogisticLikelihood(temperature=0.8, learn_temperature=True).double()
        y = (torch.rand(x.shape[0], generator=torch.Generator().manual_seed(3)) > 0.5).double()
        scale = lambda: lik.temperature.reshape(1).reciprocal()  # noqa: E731
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=torch.tensor(DELTAS[0], dtype=torch.float64),
                        prior_structure="parameter")
    raw = [p for p in [*model.covar_module.parameters(), *lik.parameters()] if p.requires_grad]
    steps = [(DELTAS[0], 0.2), (DELTAS[1], 0.5), (DELTAS[2], 0.05), (DELTAS[0], 1.3)]
    for step, (deltas, hyper) in enumerate(steps):
        with torch.no_grad():
            model.covar_module.prior_precision = torch.tensor(deltas, dtype=torch.float64)
            if kind == "gaussian":
                lik.noise = hyper
            else:
                lik.temperature = hyper
            if step == 3:  # a new network state: a new curvature, decomposed again
                next(net.parameters()).mul_(1.2)
        value = model.log_marginal_likelihood(curvature=curvature, space="weight", method="cholesky")
        reference = brute_evidence(net, x, y, kind, model.covar_module.prior_precision, scale(), curvature,
                                   "parameter")
        assert rel_err(value.detach(), reference.detach()) < 1e-10
        for g, e in zip(torch.autograd.grad(value, raw), torch.autograd.grad(reference, raw)):
            assert rel_err(g, e) < 1e-9
    assert len(calls) == 2  # evaluations 2 and 3 of the first state; each state's first is one Cholesky


def test_other_structures_take_the_cholesky_route(monkeypatch):
    calls = count_calls(monkeypatch)
    net, x, y, lik = regression(per_output=True)  # two components (one per output noise): no single D
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=torch.tensor(DELTAS[0], dtype=torch.float64),
                        prior_structure="parameter")
    balanced = mlp(d_in=12, width=12, d_out=1, depth=2)  # 144, 12, 144, 12, 12, 1: no dominant group
    x3 = torch.randn(300, 12, dtype=torch.float64)
    other = ntkgp.NTKGP(balanced, x3, torch.randn(300, dtype=torch.float64), regression()[3],
                        prior_precision=1.0, prior_structure="parameter")
    for _ in range(3):
        model.log_marginal_likelihood(space="weight", method="cholesky")
        other.log_marginal_likelihood(space="weight", method="cholesky")
    assert calls == []


def test_a_failed_factorization_takes_the_cholesky_route(monkeypatch):
    component, groups, sizes = network_component(300)
    schur = GroupSchur(component, groups, sizes)
    weight = torch.tensor([0.7], dtype=torch.float64)
    delta = torch.tensor(DELTAS[0], dtype=torch.float64)
    failing = lambda a: (a, torch.ones((), dtype=torch.int32))  # noqa: E731
    monkeypatch.setattr(low_rank_groups.torch.linalg, "cholesky_ex", failing)
    assert schur.log_det_ratio(weight, delta) is None
    monkeypatch.undo()
    net, x, y, lik = regression()
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=delta, prior_structure="parameter")
    reference = brute_evidence(net, x, y, "gaussian", delta, lik.noise.reshape(1).reciprocal(), "ggn", "parameter")
    model.log_marginal_likelihood(space="weight", method="cholesky")
    monkeypatch.setattr(GroupSchur, "log_det_ratio", lambda self, *a: None)
    value = model.log_marginal_likelihood(space="weight", method="cholesky")
    assert rel_err(value.detach(), reference.detach()) < 1e-10


@pytest.mark.parametrize("deltas", DELTAS)
def test_float32_agrees_with_float64(deltas):
    component, groups, sizes = network_component(300)
    weight = torch.tensor([0.7], dtype=torch.float64)
    delta = torch.tensor(deltas, dtype=torch.float64)
    expected = dense_ratio(weight, delta, component, groups)
    schur32 = GroupSchur(component.float(), groups, sizes)
    got = schur32.log_det_ratio(weight.float(), delta.float())
    assert got.dtype == torch.float32
    # Error model (ε = ε32), first order, measured on the float64 D: log|wD + P0| − log|P0| = log|B| with
    # B = I + w P0^-½ D P0^-½. Rounding D, w and δ to float32 perturbs B componentwise by 3ε|B_ij|; the Cholesky of
    # the other groups' Schur complement (scaled by P0^-½) has backward error |ΔB_ij| ≤ (P+1)ε√(B_ii B_jj), which a
    # diagonal scaling leaves unchanged; the eigendecomposition of the large group's D_bb has backward error
    # (P_b+1)ε‖D_bb‖ normwise. With |Δ log|B|| = |tr(B⁻¹ΔB)|:
    # |Δ| ≤ ε Σ_ij |B⁻¹_ij|(3|B_ij| + (P+1)√(B_ii B_jj)) + (P_b+1)ε‖B_bb − I‖ tr((B⁻¹)_bb), a worst case over the
    # roundings' directions (any CPU, any thread count).
    cols = delta[groups].rsqrt()
    b = torch.eye(cols.shape[0], dtype=torch.float64) + weight * cols[:, None] * component * cols[None, :]
    inverse, root = torch.linalg.inv(b), torch.diagonal(b).sqrt()
    p, block = cols.shape[0], groups == 0  # group 0 holds 96 of the 121 columns
    bound = EPS32 * (inverse.abs() * (3 * b.abs() + (p + 1) * root[:, None] * root[None, :])).sum()
    bound += (int(block.sum()) + 1) * EPS32 * (
        torch.linalg.matrix_norm(b[block][:, block] - torch.eye(int(block.sum()), dtype=torch.float64), ord=2)
        * torch.diagonal(inverse[block][:, block]).sum()
    )
    assert abs(got.double() - expected).item() <= bound.item()
    # The bound is below 1e-2 relative (a real bug of that size fails) except where the large group's δ_b is far
    # below the others (DELTAS[2]): there the honest eigendecomposition term, ε‖D_bb‖/δ_b times tr((B⁻¹)_bb), is
    # ~4e-2 of the value; the same code paths are held to about 1e-3 relative by the other two cases.
    if deltas != DELTAS[2]:
        assert bound.item() < 1e-2 * abs(expected).item()


def test_eigenvalues_at_the_rounding_level_keep_their_coupling_against_a_50_digit_reference():
    """D_bb diagonal (its decomposition exact) with two eigenvalues below the rounding level τ = P_b·ε·max μ, coupled
    to the other columns (D_bo = diag(√μ) A), and δ_b of their size: their terms −w²G_iG_iᵀ/(wμ_i + δ_b) are of
    order one in C̃. Value and gradients against mpmath at 50 digits (the dense float64 factorizations lose ~1e-1
    at this conditioning)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    mu = torch.tensor([1.0, 0.8, 0.5, 0.3, 1e-15, 2e-16], dtype=torch.float64)
    a = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    component = torch.zeros(9, 9, dtype=torch.float64)
    component[:6, :6] = torch.diag(mu)
    component[:6, 6:] = mu.sqrt()[:, None] * a
    component[6:, :6] = component[:6, 6:].T
    component[6:, 6:] = a.T @ a + torch.eye(3, dtype=torch.float64)
    groups = torch.tensor([0] * 6 + [1, 2, 2])
    schur = GroupSchur(component, groups, torch.tensor([6, 1, 2]))
    assert int((~schur.above).sum()) == 2
    weight = torch.tensor([0.9], dtype=torch.float64, requires_grad=True)
    delta = torch.tensor([3e-16, 0.7, 2.0], dtype=torch.float64, requires_grad=True)
    value = schur.log_det_ratio(weight, delta)
    grad_w, grad_d = torch.autograd.grad(value, [weight, delta])
    d = mpmath.matrix(component.tolist())
    cols = [mpmath.mpf(float(delta.detach()[g])) for g in groups.tolist()]
    h = mpmath.mpf(float(weight.detach())) * d + mpmath.diag(cols)
    inverse = h**-1
    expected = mpmath.log(mpmath.det(h)) - sum(mpmath.log(c) for c in cols)
    expected_w = sum(inverse[i, j] * d[j, i] for i in range(9) for j in range(9))
    expected_d = [sum(inverse[i, i] - 1 / cols[i] for i in range(9) if groups[i] == g) for g in range(3)]
    assert abs(value.item() - float(expected)) < 1e-12 * abs(float(expected))
    assert abs(grad_w.item() - float(expected_w)) < 1e-10 * abs(float(expected_w))
    for g in range(3):
        assert abs(grad_d[g].item() - float(expected_d[g])) < 1e-10 * abs(float(expected_d[g]))
