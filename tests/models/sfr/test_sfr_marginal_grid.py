"""``SFR.predictive_grid(..., marginal=True)``: each point's marginal at each δ, against the dense SFR formula's
diagonal blocks; without any factorization kept by the results, and within the grid's memory budget during the pass
(one factorization at a time, formed again per chunk)."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch

from ntkgp.models.sfr import SFR
from tests.helpers import rel_err
from tests.models.sfr.problems import DELTA, Dense, problem, sfr_formula

prior_grid = importlib.import_module("ntkgp.models.sfr.prior_grid")
Z_IDX = torch.tensor([0, 3, 5, 8, 13, 17])
CANDIDATES = torch.stack([DELTA, 0.3 * DELTA, torch.tensor([5.0, 0.2, 1.0], dtype=torch.float64)])


def point_blocks(cov: torch.Tensor, c: int) -> torch.Tensor:
    """The ``C×C`` diagonal blocks of an interleaved ``(n·C, n·C)`` covariance, ``(n, C, C)``."""
    n = cov.shape[-1] // c
    return torch.stack([cov[i * c : (i + 1) * c, i * c : (i + 1) * c] for i in range(n)])


@pytest.mark.parametrize("budget", [None, 0])  # factorizations kept across chunks, or formed per chunk
@pytest.mark.parametrize("coupling", ["joint", "independent"])
@pytest.mark.parametrize("kind,c,mean", [("softmax", 3, "zero"), ("gaussian", 2, "linearized"),
                                         ("gaussian", 1, "zero")])
def test_marginals_match_the_dense_formula_at_each_delta(kind, c, mean, coupling, budget, monkeypatch):
    net, x, y, lik, xs = problem(kind, c, n=20)
    sfr = SFR(net, x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA, prior_mean=mean,
              output_coupling=coupling)
    if budget is not None:
        monkeypatch.setattr(prior_grid.memory, "SFR_GRID_BYTES", budget)
    made = []
    real = prior_grid.posterior_state_at

    def spy(model, value):
        state = real(model, value)
        made.append(weakref.ref(state))
        return state

    monkeypatch.setattr(prior_grid, "posterior_state_at", spy)
    candidates = CANDIDATES
    dists = sfr.predictive_grid(xs, candidates, chunk_size=2, marginal=True)  # 3 chunks of the 5 test points
    assert len(made) == 3 * (3 if budget == 0 else 1)  # per chunk when none may be kept
    gc.collect()
    assert all(ref() is None for ref in made)  # the marginals hold no factorization
    for delta, dist in zip(candidates, dists):
        ref_mean, ref_cov = sfr_formula(Dense(net, x, y, kind, delta=delta), Z_IDX, xs, mean,
                                        independent=coupling == "independent")
        blocks = point_blocks(ref_cov, c)
        got = dist.covariance_matrix
        # block-diagonal: each point's C×C block, nothing between points (the tolerances of test_sfr_prior_grid)
        assert rel_err(dist.mean.reshape(-1), ref_mean) < 1e-8
        assert rel_err(point_blocks(got, c), blocks) < 1e-7
        assert torch.count_nonzero(got - torch.block_diag(*point_blocks(got, c))) == 0


def test_a_float32_networks_marginals_match_its_float64_copy():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    sfr64 = SFR(problem("softmax", 3, n=20)[0], x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA)
    sfr32 = SFR(net.float(), x.float(), y, lik.float(), inducing_points=x[Z_IDX].float(), prior_precision=DELTA.float())
    for d32, d64 in zip(sfr32.predictive_grid(xs.float(), CANDIDATES, marginal=True),
                        sfr64.predictive_grid(xs, CANDIDATES, marginal=True)):
        assert d32.mean.dtype == torch.float32
        # as test_sfr_prior_grid's float32 check: rows rounded by ε32 = 6e-8, amplified by κ(K_ZZ + B) ≤ 1e3 here
        assert rel_err(d32.mean.double().reshape(-1), d64.mean.reshape(-1)) < 1e-3
        assert rel_err(d32.covariance_matrix.double(), d64.covariance_matrix) < 1e-3


def test_marginal_is_checked():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    sfr = SFR(net, x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA)
    with pytest.raises(TypeError, match="marginal"):
        sfr.predictive_grid(xs, CANDIDATES, marginal="yes")
