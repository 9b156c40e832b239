"""SFR's evidence along one prior precision from one eigendecomposition (``evidence_scale.ScaledEvidence``) against
the direct route (``log_marginal_likelihood``, which refactorizes K_ZZ and I + A at each δ): values and derivatives
at δ over five decades, and ``optimize_prior_precision(method="evidence")`` against the same search on the direct
route alone."""

from __future__ import annotations

import pytest
import torch

from ntkgp.models.sfr import SFR
from ntkgp.models.sfr.evidence_scale import ScaledEvidence
from tests.models.sfr.problems import problem

SCALES = [1e-2, 0.3, 1.0, 7.0, 300.0]


def model(kind: str, c: int, mean: str, coupling: str, dtype=torch.float64, structure: str = "network", m: int = 6):
    net, x, y, lik, _ = problem(kind, c, n=24)
    net, x, lik = net.to(dtype), x.to(dtype), lik.to(dtype)
    return SFR(net, x, y, lik, inducing_points=x[:m], prior_precision=0.7, prior_mean=mean, output_coupling=coupling,
               prior_structure=structure)


def direct(sfr, delta: float) -> float:
    sfr.covar_module.prior_precision = delta
    with torch.no_grad():
        return sfr.log_marginal_likelihood().item()


@pytest.mark.parametrize("coupling", ["joint", "independent"])
@pytest.mark.parametrize("kind,c,mean", [("softmax", 3, "zero"), ("softmax", 3, "linearized"),
                                         ("gaussian", 2, "linearized")])
def test_scaled_evidence_equals_the_direct_route_and_its_derivative(kind, c, mean, coupling):
    sfr = model(kind, c, mean, coupling)
    scaled = ScaledEvidence.at(sfr)
    assert scaled is not None
    for s in SCALES:
        delta = torch.tensor(0.7 * s, dtype=torch.float64)
        assert scaled.covers(delta)  # a well-conditioned K_ZZ: every direction kept at each δ
        ref = direct(sfr, float(delta))
        # float64, the same sums factorized once or at each δ: rounding of κ(K_ZZ) ≈ 1e6 times ε, well inside 1e-10
        assert scaled(delta).item() == pytest.approx(ref, rel=1e-10, abs=1e-10)
        # the derivative in the kernel's raw parameter (log δ): autograd through the direct route (train mode)
        # against the scaled formula's
        sfr.train()
        raw = sfr.covar_module.raw_prior_precision
        (g_ref,) = torch.autograd.grad(sfr.log_marginal_likelihood(), raw)
        (g,) = torch.autograd.grad(scaled(sfr.covar_module.prior_precision), raw)
        sfr.eval()
        assert g.item() == pytest.approx(g_ref.item(), rel=1e-8, abs=1e-8)


@pytest.mark.parametrize("optimizer", ["grid", "adam", "lbfgs"])
def test_optimize_prior_precision_by_evidence_takes_the_scaled_route_and_finds_the_direct_searchs_delta(
        optimizer, monkeypatch):
    grid = torch.logspace(-2, 3, 11, dtype=torch.float64)
    kwargs = {"grid": grid} if optimizer == "grid" else {"steps": 25, "lr": 0.2}
    fast = model("softmax", 3, "zero", "independent")
    calls = []
    original = SFR.log_marginal_likelihood
    monkeypatch.setattr(SFR, "log_marginal_likelihood", lambda self: calls.append(1) or original(self))
    chosen = fast.optimize_prior_precision("evidence", optimizer=optimizer, **kwargs)
    assert calls == []  # every value by the scaled route
    slow = model("softmax", 3, "zero", "independent")
    monkeypatch.setattr(ScaledEvidence, "at", classmethod(lambda cls, sfr: None))  # the direct route only
    reference = slow.optimize_prior_precision("evidence", optimizer=optimizer, **kwargs)
    assert calls  # the direct route ran
    # grid: the same argmax of values equal to 1e-10; adam / lbfgs: the same iterates to rounding
    assert chosen.item() == pytest.approx(reference.item(), rel=1e-8)
    assert torch.equal(fast.covar_module.prior_precision.detach(), chosen)


def test_routes_outside_the_scaled_one_are_left_to_the_direct_route(monkeypatch):
    """Several prior-precision groups (a direction of δ that is not one scale): no scaled route; duplicate inducing
    inputs (a singular K_ZZ, directions dropped): the direct route at every value, and the same search result."""
    assert ScaledEvidence.at(model("softmax", 3, "zero", "joint", structure="layer")) is None
    net, x, y, lik, _ = problem("softmax", 3, n=24)
    z = torch.cat([x[:4], x[:2]])  # two inducing inputs twice
    sfr = SFR(net, x, y, lik, inducing_points=z, prior_precision=0.7, output_coupling="independent",
              prior_structure="network")
    scaled = ScaledEvidence.at(sfr)
    assert scaled is None or not any(scaled.covers(torch.tensor(0.7 * s)) for s in SCALES)
    grid = torch.logspace(-2, 3, 11, dtype=torch.float64)
    values = [direct(sfr, float(d)) for d in grid]
    sfr.covar_module.prior_precision = 0.7
    chosen = sfr.optimize_prior_precision("evidence", optimizer="grid", grid=grid)
    # the grid's argmax, through the kernel's log parameterization (exp(log δ): rounding)
    assert chosen.item() == pytest.approx(float(grid[max(range(len(grid)), key=values.__getitem__)]), rel=1e-14)


def test_scaled_evidence_of_a_float32_network_against_its_float64_copy():
    sfr64 = model("softmax", 3, "zero", "independent")
    sfr32 = model("softmax", 3, "zero", "independent", dtype=torch.float32)
    s64, s32 = ScaledEvidence.at(sfr64), ScaledEvidence.at(sfr32)
    for s in SCALES:
        delta = torch.tensor(0.7 * s, dtype=torch.float64)
        a, b = s32(delta.float()), s64(delta)
        assert a.dtype == torch.float32 and b.dtype == torch.float64
        # float32 weights and inputs: features rounded by ε32 = 6e-8, amplified by κ(K_ZZ + B) ≤ 1e3 here (as
        # test_sfr_prior_grid.py's float32 check); 1e-3 relative
        assert a.double().item() == pytest.approx(b.item(), rel=1e-3)
        assert a.double().item() == pytest.approx(direct(sfr32, float(delta)), rel=1e-5)
