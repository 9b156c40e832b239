"""``SFR(..., statistics="combined")``: dual statistics for the combined kernel at a fixed δ.

Against the default per-group statistics at the same δ and against dense sums written out from brute-force
per-group Jacobians: the same predictions, evidence, updates and all-reduce (1e-10, float64), ``G²`` times
smaller statistics, and a clear error (never silent mixing) once δ changes or a gradient in δ is asked for.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR
from ntkgp.options import StatisticsMode
from tests.helpers import brute_jacobian, column_groups, rel_err
from tests.models.sfr.problems import (  # change_delta: the four routes of changing δ
    DELTA,
    NEW_DELTA,
    Dense,
    change_delta,
    dense_moments,
    layer_labels,
    problem,
    sfr_formula,
    site_terms,
)
from ntkgp.models import SFRMemoryOptions

Z_IDX = torch.tensor([0, 3, 5, 8, 13, 17])
COMBINED = 'statistics="combined"'


def pair(kind, c, coupling, n=30, mean="zero", **kw):
    """The same problem built per group and combined (G = 3 layers, δ = DELTA)."""
    net, x, y, lik, xs = problem(kind, c, n=n)
    kw = {"inducing_points": x[Z_IDX], "prior_precision": DELTA, "output_coupling": coupling, "prior_mean": mean, **kw}
    return (SFR(net, x, y, lik, memory=SFRMemoryOptions(batch_size=7), **kw),
            SFR(net, x, y, lik, memory=SFRMemoryOptions(batch_size=7, statistics="combined"), **kw),
            (net, x, y, lik, xs))


def results(model, xs):
    with torch.no_grad():
        dist = model(xs)
        mean, cov = dense_moments(dist)
        return mean, cov, dist.variance.reshape(-1), model.log_marginal_likelihood().reshape(1)


def assert_close(got, ref, tol=1e-10):
    for a, b in zip(got, ref):
        assert rel_err(a, b) < tol, rel_err(a, b)


CASES = [("gaussian", 2), ("softmax", 3), ("logistic", 1)]


# ---------------------------------------------------------------------- the same numbers as per group
@pytest.mark.parametrize("coupling", ["joint", "independent"])
@pytest.mark.parametrize("kind,c", CASES)
def test_combined_predictions_and_evidence_equal_per_group_and_the_dense_formula(kind, c, coupling):
    mean = "linearized" if kind == "gaussian" else "zero"
    per_group, combined, (net, x, y, _, xs) = pair(kind, c, coupling, mean=mean)
    assert combined.engine.num_groups == 3
    got = results(combined, xs)
    assert_close(got, results(per_group, xs))
    ref_mean, ref_cov = sfr_formula(Dense(net, x, y, kind), Z_IDX, xs, mean, independent=coupling == "independent")
    assert rel_err(got[0], ref_mean) < 1e-8 and rel_err(got[1], ref_cov) < 1e-7


@pytest.mark.parametrize("kind,c,coupling", [("softmax", 3, "joint"), ("gaussian", 2, "independent")])
def test_combined_statistics_are_the_weighted_sums_of_brute_force_group_grams(kind, c, coupling):
    per_group, combined, (net, x, y, lik, _) = pair(kind, c, coupling)
    stats, w = combined.dual_statistics, DELTA.reciprocal()
    # per-group Jacobians written out by autograd, grouped by layer without ntkgp's grouping code
    cols = column_groups(net, layer_labels(net))
    jx, _ = brute_jacobian(net, x)
    jz, _ = brute_jacobian(net, x[Z_IDX])
    k_zx = (jz * w[cols]) @ jx.T  # (M·C, N·C): Σ_g w_g J_g(Z) J_g(X)ᵀ
    k_zz = (jz * w[cols]) @ jz.T
    jn = jx.view(len(x), c, -1)
    k_xx = torch.einsum("ncp,ndp->ncd", jn * w[cols], jn)  # the blocks K(x_n, x_n)
    with torch.no_grad():
        f = net(x)
    g, lam, _ = site_terms(kind, f, y)
    if kind == "gaussian":  # the noise is divided out: Λ = 1, r = y − m (zero mean)
        lam, r = torch.eye(c, dtype=f.dtype).expand(len(x), c, c), y.reshape(f.shape)
    else:
        r = torch.einsum("nij,nj->ni", lam, f) + g  # Λ (f − m) + g with m = 0
    if coupling == "joint":
        precision = (k_zx @ torch.block_diag(*lam) @ k_zx.T)[None]
        residual = (k_zx @ r.reshape(-1))[None]
        trace = torch.einsum("ncd,ndc->", k_xx, lam).reshape(1, 1)
        zz = k_zz[None]
    else:  # one system per output with the output-diagonal blocks; slot c = output c
        lam_d = lam.diagonal(dim1=-2, dim2=-1)
        precision = torch.stack([(k_zx[o::c, o::c] * lam_d[:, o]) @ k_zx[o::c, o::c].T for o in range(c)])
        residual = torch.stack([k_zx[o::c, o::c] @ r[:, o] for o in range(c)])
        trace = (k_xx.diagonal(dim1=-2, dim2=-1) * lam_d).sum(0)[:, None]
        zz = torch.stack([k_zz[o::c, o::c] for o in range(c)])
    assert rel_err(stats.precision, precision) < 1e-10
    assert rel_err(stats.residual[:, 0], residual) < 1e-10
    assert rel_err(stats.trace, trace) < 1e-10
    assert rel_err(combined._zz_grams[0], zz) < 1e-10
    assert torch.equal(stats.prior_precision, DELTA)
    # and from the per-group statistics, Σ_gh w_g w_h A_gh block by block
    a = per_group.dual_statistics.precision
    s, k = a.shape[0], stats.size
    blocks = a.view(s, 3, k, 3, k)
    reweighted = torch.einsum("g,h,sgihj->sij", w, w, blocks)
    assert rel_err(stats.precision, reweighted) < 1e-10


def test_the_statistics_are_g_squared_times_smaller():
    per_group, combined, _ = pair("softmax", 3, "joint")
    g, k = 3, len(Z_IDX) * 3
    assert per_group.dual_statistics.precision.shape == (1, g * k, g * k)
    assert combined.dual_statistics.precision.shape == (1, k, k)
    assert per_group.dual_statistics.precision.numel() == g**2 * combined.dual_statistics.precision.numel()
    assert combined.dual_statistics.residual.shape == (1, 1, k) and combined.dual_statistics.trace.shape == (1, 1)
    assert per_group._zz_grams.shape == (g, 1, k, k) and combined._zz_grams.shape == (1, 1, k, k)
    # per group the state_dict is unchanged (no recorded δ); combined records δ
    assert "dual_statistics.prior_precision" not in per_group.state_dict()
    assert torch.equal(combined.state_dict()["dual_statistics.prior_precision"], DELTA)
    # Gaussian, C slots: (C, K, K) against (C, G·K, G·K)
    per_group, combined, _ = pair("gaussian", 2, "joint")
    assert combined.dual_statistics.precision.shape == (2, 12, 12)
    assert per_group.dual_statistics.precision.numel() == 9 * combined.dual_statistics.precision.numel()


# ---------------------------------------------------------------------- conditioning on new data
@pytest.mark.parametrize("kind,c,coupling", [("softmax", 3, "joint"), ("gaussian", 2, "independent")])
def test_update_equals_a_combined_build_on_all_the_data_and_the_per_group_update(kind, c, coupling):
    net, x, y, lik, xs = problem(kind, c, n=30)
    kw = {"inducing_points": x[:8], "prior_precision": DELTA, "output_coupling": coupling,
          "memory": SFRMemoryOptions(statistics="combined")}
    union = SFR(net, x, y, lik, **kw)
    loader = DataLoader(TensorDataset(x[:18], y[:18]), batch_size=5)
    model = SFR(net, loader, None, lik, **kw)
    model(xs)  # cached factors must be refreshed by the update
    model.update(x[18:24], y[18:24], iterate=False).update(x[24:], y[24:], iterate=False)
    for name in ("precision", "residual", "trace", "fit", "log_lik", "num_data"):
        got, ref = getattr(model.dual_statistics, name).double(), getattr(union.dual_statistics, name).double()
        assert (got - ref).norm() <= 1e-10 * ref.norm(), name  # log_lik is 0 for a Gaussian likelihood
    assert_close(results(model, xs), results(union, xs))
    per_group = SFR(net, x[:18], y[:18], lik, **{**kw, "memory": SFRMemoryOptions(statistics="per_group")})
    per_group.update(x[18:], y[18:], iterate=False)
    assert_close(results(model, xs), results(per_group, xs))


def test_iterated_update_equals_the_per_group_iterated_update():
    per_group, combined, (net, x, y, lik, xs) = pair("softmax", 3, "joint", n=20)
    x_new, y_new = torch.randn(6, x.shape[1], dtype=x.dtype), torch.randint(0, 3, (6,))
    per_group.update(x_new, y_new, iterate=True)
    combined.update(x_new, y_new, iterate=True)
    assert_close(results(combined, xs), results(per_group, xs), tol=1e-9)


# ---------------------------------------------------------------------- δ is fixed: errors, never mixing
@pytest.mark.parametrize("route", ["setter", "data", "load_state_dict", "optimizer"])
def test_changing_delta_after_the_build_raises_until_it_is_restored(route):
    _, combined, (net, x, y, lik, xs) = pair("softmax", 3, "joint")
    before = results(combined, xs)  # caches filled
    change_delta(combined, route)
    for call in (lambda: combined(xs), combined.log_marginal_likelihood, lambda: combined.inducing_rank,
                 lambda: combined.update(x[:4], y[:4], iterate=False), lambda: combined.update(x[:4], y[:4])):
        with pytest.raises(RuntimeError, match=COMBINED) as error:
            call()
        assert "per_group" in str(error.value) and "build a new SFR" in str(error.value)
    assert combined.num_data == 30  # the failed updates changed nothing
    combined.covar_module.prior_precision = combined.dual_statistics.prior_precision  # as the message says
    assert_close(results(combined, xs), before)


def test_statistics_combined_at_another_delta_cannot_be_used_or_added():
    _, combined, (net, x, y, lik, xs) = pair("softmax", 3, "joint")
    weights = NEW_DELTA.reciprocal()
    slots = combined.dual_statistics.slot_weights(lik)
    with pytest.raises(RuntimeError, match=COMBINED):
        combined.dual_statistics.projected(weights, slots)
    with pytest.raises(RuntimeError, match=COMBINED):
        combined.dual_statistics.trace_term(weights, slots)
    other = SFR(net, x, y, lik, inducing_points=x[Z_IDX], prior_precision=NEW_DELTA,
                memory=SFRMemoryOptions(statistics="combined"))
    per_group = SFR(net, x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA)
    for stats in (other.dual_statistics, per_group.dual_statistics):
        with pytest.raises(ValueError, match="kept differently"):
            combined.dual_statistics.add_(stats)


# ---------------------------------------------------------------------- gradients
def test_differentiating_the_evidence_in_delta_raises_and_in_the_noise_matches_per_group():
    per_group, combined, _ = pair("gaussian", 2, "joint")
    per_group.train(), combined.train()
    assert not combined.covar_module.raw_prior_precision.requires_grad  # frozen by the constructor
    assert per_group.covar_module.raw_prior_precision.requires_grad
    combined.covar_module.raw_prior_precision.requires_grad_(True)  # switched on again by hand
    with pytest.raises(RuntimeError, match="no gradient in δ"):
        combined.log_marginal_likelihood()
    with torch.no_grad():  # no gradient asked for: the value
        value = combined.log_marginal_likelihood()
    combined.covar_module.raw_prior_precision.requires_grad_(False)  # δ frozen: the noise is differentiable
    grads = []
    for model in (per_group, combined):
        evidence = model.log_marginal_likelihood()
        grads.append((evidence.detach(), *torch.autograd.grad(evidence, [model.likelihood.raw_task_noises])))
    assert_close(grads[1], grads[0])
    assert rel_err(value, grads[0][0]) < 1e-10


def test_temperature_gradient_matches_per_group():
    net, x, y, _, _ = problem("softmax", 3, n=20)
    grads = []
    for mode in ("per_group", "combined"):
        lik = SoftmaxLikelihood(3, temperature=0.7, learn_temperature=True).double()
        sfr = SFR(net, x, y, lik, inducing_points=x[:6], prior_precision=DELTA,
                  memory=SFRMemoryOptions(statistics=mode)).train()
        sfr.covar_module.raw_prior_precision.requires_grad_(False)
        evidence = sfr.log_marginal_likelihood()
        grads.append((evidence.detach(), *torch.autograd.grad(evidence, [lik.raw_temperature])))
    assert_close(grads[1], grads[0])


# ---------------------------------------------------------------------- the option, state, several processes
def test_the_option_is_validated_before_any_side_effect():
    net, x, y, lik, _ = problem("softmax", 3, n=12)
    for bad in ("joint", "per-group", 3, None):
        batches = iter([(x, y)])  # a one-shot iterator: must not be read
        with pytest.raises(ValueError, match="statistics must be one of 'per_group', 'combined'"):
            SFR(net, batches, None, lik, inducing_points=x[:4], memory=SFRMemoryOptions(statistics=bad))
        assert next(batches, None) is not None
    sfr = SFR(net, x, y, lik, inducing_points=x[:4],
              memory=SFRMemoryOptions(statistics=StatisticsMode.COMBINED))
    assert sfr.statistics is StatisticsMode.COMBINED and sfr.dual_statistics.combined
    assert SFR(net, x, y, lik, inducing_points=x[:4]).statistics == "per_group"


def test_state_dict_round_trip_and_no_loading_across_modes():
    per_group, combined, (net, x, y, lik, xs) = pair("softmax", 3, "joint")
    target = SFR(net, x[:10], y[:10], lik, inducing_points=x[Z_IDX], prior_precision=NEW_DELTA, prior_mean="zero",
                 memory=SFRMemoryOptions(statistics="combined"))
    target.load_state_dict(combined.state_dict())  # statistics, K_ZZ and δ (recorded and current) together
    assert_close(results(target, xs), results(combined, xs))
    with pytest.raises(RuntimeError):
        per_group.load_state_dict(combined.state_dict())


def distributed_case(rank, world):
    """Combined statistics on each rank's shard (a DataLoader), all-reduced, then updated with shards."""
    from ntkgp.distributed import shard

    torch.set_num_threads(1)
    net, x, y, lik, xs = problem("softmax", 3, n=30)
    parts = (x[:20], y[:20]) if rank is None else shard(x[:20], y[:20], rank_=rank, world=world)
    new = (x[20:], y[20:]) if rank is None else shard(x[20:], y[20:], rank_=rank, world=world)
    kw = {"num_inducing": 6, "prior_precision": DELTA, "memory": SFRMemoryOptions(statistics="combined"),
          "distributed": rank is not None}
    sfr = SFR(net, DataLoader(TensorDataset(*parts), batch_size=4), None, lik, **kw)
    out = {"built": results(sfr, xs), "Z": sfr.inducing_points.clone()}
    sfr.update(*new, iterate=False)
    out["updated"] = results(sfr, xs)
    out["precision"] = sfr.dual_statistics.precision.clone()
    if rank is not None:  # ranks that combined at different δ are refused on every rank
        try:
            SFR(net, *parts, lik, **{**kw, "prior_precision": DELTA * (1 + rank)})
            out["mismatch"] = None
        except ValueError as error:
            out["mismatch"] = str(error)
    return out


def test_distributed_combined_statistics_equal_one_process():
    from tests.distributed.launch import run

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as in the ranks (launch.py): the network's initialization follows it
    try:
        single = distributed_case(None, 2)
        net, x, y, lik, xs = problem("softmax", 3, n=30)
        per_group = SFR(net, x[:20], y[:20], lik, inducing_points=single["Z"], prior_precision=DELTA)
        ranks = run("tests.models.sfr.test_sfr_combined_statistics:distributed_case", 2, timeout=300)
    finally:
        torch.set_default_dtype(default)
    assert_close(single["built"], results(per_group, xs))
    for out in ranks:
        assert torch.equal(out["Z"], single["Z"])
        assert_close(out["built"], single["built"])
        assert_close(out["updated"], single["updated"])
        assert rel_err(out["precision"], single["precision"]) < 1e-10
        assert out["mismatch"] is not None and 'statistics="combined"' in out["mismatch"]
