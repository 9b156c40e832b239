"""SFR at several prior precisions from one pass (``predictive_grid``) against the dense SFR formula at each δ, and
``optimize_prior_precision`` against brute-force searches written out here (NLPD by ``torch.distributions``, the
evidence at each grid value)."""

from __future__ import annotations

import pytest
import torch

from ntkgp.models import SFRMemoryOptions
from ntkgp.models.sfr import SFR
from tests.helpers import rel_err
from tests.models.sfr.problems import DELTA, Dense, dense_moments, problem, sfr_formula

Z_IDX = torch.tensor([0, 3, 5, 8, 13, 17])
CANDIDATES = torch.stack([DELTA, 0.3 * DELTA, torch.tensor([5.0, 0.2, 1.0], dtype=torch.float64)])


@pytest.mark.parametrize("coupling", ["joint", "independent"])
@pytest.mark.parametrize("kind,c,mean", [("softmax", 3, "zero"), ("gaussian", 2, "linearized")])
def test_predictive_grid_matches_the_dense_formula_at_each_delta(kind, c, mean, coupling):
    net, x, y, lik, xs = problem(kind, c, n=20)
    sfr = SFR(net, x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA, prior_mean=mean,
              output_coupling=coupling)
    before = sfr.covar_module.prior_precision.detach().clone()
    dists = sfr.predictive_grid(xs, CANDIDATES, chunk_size=2)  # 3 chunks of the 5 test points
    assert len(dists) == 3
    for delta, dist in zip(CANDIDATES, dists):
        ref_mean, ref_cov = sfr_formula(Dense(net, x, y, kind, delta=delta), Z_IDX, xs, mean,
                                        independent=coupling == "independent")
        got_mean, got_cov = dense_moments(dist)
        # the tolerances of test_sfr_dense_reference.py (the dense formula's own solves with K_ZZ, κ ≈ 1e6)
        assert rel_err(got_mean, ref_mean) < 1e-8
        assert rel_err(got_cov, ref_cov) < 1e-7
    assert torch.equal(sfr.covar_module.prior_precision.detach(), before)  # the model is not changed


def test_predictive_grid_of_shared_values_and_of_one_value():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    sfr = SFR(net, x, y, lik, num_inducing=6, prior_precision=DELTA).eval()
    with torch.no_grad():
        shared = sfr.predictive_grid(xs, [0.3, 2.0])  # a list of Python numbers, each shared by the 3 groups
        for value, dist in zip([0.3, 2.0], shared):
            sfr.covar_module.prior_precision = value
            mean, cov = dense_moments(sfr(xs))
            # the same float64 algebra in another order (one pass, per-group Grams weighted afterwards)
            assert rel_err(dist.mean.reshape(-1), mean) < 1e-12
            assert rel_err(dist.covariance_matrix, cov) < 1e-12


def test_predictive_grid_of_a_float32_network_matches_its_float64_copy():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    net32 = net.float()
    sfr64 = SFR(problem("softmax", 3, n=20)[0], x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA)
    sfr32 = SFR(net32, x.float(), y, lik.float(), inducing_points=x[Z_IDX].float(), prior_precision=DELTA.float())
    for d32, d64 in zip(sfr32.predictive_grid(xs.float(), CANDIDATES), sfr64.predictive_grid(xs, CANDIDATES)):
        # float32 weights and inputs: rows rounded by ε32 = 6e-8 relative, amplified by κ(K_ZZ + B) ≤ 1e3 here at
        # most (test_sfr_float32.py bounds it entry by entry); 1e-3 relative leaves a margin of ten
        assert rel_err(d32.mean.double().reshape(-1), d64.mean.reshape(-1)) < 1e-3
        assert rel_err(d32.covariance_matrix.double(), d64.covariance_matrix) < 1e-3


def test_validation_search_picks_the_lowest_nlpd_of_a_brute_force_loop():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    sfr = SFR(net, x, y, lik, num_inducing=6, prior_precision=DELTA)
    g = torch.Generator().manual_seed(3)
    x_val = torch.randn(15, xs.shape[-1], dtype=torch.float64, generator=g)
    y_val = torch.randint(0, 3, (15,), generator=g)
    grid = [0.01, 0.1, 1.0, 10.0, 100.0]
    losses = []
    with torch.no_grad():
        for value in grid:
            sfr.covar_module.prior_precision = value
            probs = sfr.likelihood(sfr.eval()(x_val)).probs
            losses.append(-torch.distributions.Categorical(probs=probs).log_prob(y_val).mean().item())
    sfr.covar_module.prior_precision = DELTA
    chosen = sfr.optimize_prior_precision("validation", grid=grid, x_val=x_val, y_val=y_val)
    expected = grid[min(range(len(grid)), key=losses.__getitem__)]
    assert len(set(round(v, 6) for v in losses)) > 1  # the grid values differ: the choice can be wrong
    torch.testing.assert_close(chosen, torch.full((3,), expected, dtype=torch.float64), rtol=1e-15, atol=0)
    torch.testing.assert_close(sfr.covar_module.prior_precision.detach(), chosen, rtol=1e-15, atol=0)


def test_validation_search_for_regression_uses_the_noisy_predictive():
    net, x, y, lik, xs = problem("gaussian", 1, n=20)
    sfr = SFR(net, x, y, lik, num_inducing=8, prior_precision=DELTA)
    g = torch.Generator().manual_seed(4)
    x_val = torch.randn(12, xs.shape[-1], dtype=torch.float64, generator=g)
    with torch.no_grad():
        y_val = net(x_val).squeeze(-1) + 0.3 * torch.randn(12, dtype=torch.float64, generator=g)
    grid = [0.003, 0.3, 30.0]
    losses = []
    with torch.no_grad():
        for value in grid:
            sfr.covar_module.prior_precision = value
            f = sfr.eval()(x_val)
            normal = torch.distributions.Normal(f.mean, (f.variance + 0.1).sqrt())
            losses.append(-normal.log_prob(y_val).mean().item())
    batches = [(x_val[:5], y_val[:5]), (x_val[5:], y_val[5:])]  # an iterable of batches
    chosen = sfr.optimize_prior_precision("validation", grid=grid, x_val=batches)
    assert float(chosen[0]) == pytest.approx(grid[min(range(3), key=losses.__getitem__)], rel=1e-15)


def test_evidence_grid_and_adam_find_the_evidence_maximum():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    sfr = SFR(net, x, y, lik, num_inducing=6, prior_precision=1.0)
    grid = torch.logspace(-2, 2, 9, dtype=torch.float64)
    values = []
    with torch.no_grad():
        for value in grid:
            sfr.covar_module.prior_precision = value
            values.append(sfr.log_marginal_likelihood().item())
    sfr.covar_module.prior_precision = 1.0
    chosen = sfr.optimize_prior_precision("evidence", optimizer="grid", grid=grid[:, None].expand(-1, 3))
    assert float(chosen[0]) == pytest.approx(float(grid[max(range(9), key=values.__getitem__)]), rel=1e-15)
    sfr.eval()
    best_grid = max(values)
    sfr.optimize_prior_precision("evidence", steps=60, lr=0.1)  # per-group Adam steps from the grid's best
    assert not sfr.training  # the mode is restored
    with torch.no_grad():
        assert sfr.log_marginal_likelihood().item() >= best_grid - 1e-9


def test_invalid_arguments_name_themselves_and_change_nothing():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    sfr = SFR(net, x, y, lik, num_inducing=6, prior_precision=DELTA)
    before = sfr.covar_module.prior_precision.detach().clone()
    with pytest.raises(ValueError, match="method"):
        sfr.optimize_prior_precision("marglik")
    with pytest.raises(ValueError, match="x_val"):
        sfr.optimize_prior_precision("validation", grid=[1.0])
    with pytest.raises(ValueError, match="grid"):
        sfr.optimize_prior_precision("validation", grid=[1.0, -2.0], x_val=xs, y_val=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="prior_precisions"):
        sfr.predictive_grid(xs, torch.ones(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="metric"):
        sfr.optimize_prior_precision("validation", grid=[1.0], x_val=xs, y_val=torch.zeros(5, dtype=torch.long),
                                     metric="auroc")
    assert torch.equal(sfr.covar_module.prior_precision.detach(), before)
    combined = SFR(net, x, y, lik, num_inducing=6, prior_precision=DELTA, memory=SFRMemoryOptions(statistics="combined"))
    with pytest.raises(RuntimeError, match="combined"):
        combined.optimize_prior_precision("evidence")
    with pytest.raises(RuntimeError):
        combined.predictive_grid(xs, [0.5])


def test_a_list_grid_keeps_its_float64_values():
    """A grid given as Python numbers reaches the posterior in its dtype (once through float32: 0.3 became
    0.30000001192…, moving the posterior by 4e-8 relative)."""
    net, x, y, lik, _ = problem("softmax", 3, n=20)
    sfr = SFR(net, x, y, lik, num_inducing=6, prior_precision=DELTA)
    chosen = sfr.optimize_prior_precision("evidence", optimizer="grid", grid=[0.3])
    assert torch.equal(chosen, torch.full((3,), 0.3, dtype=torch.float64))
