"""SFR.select_inducing: the SFR on a subset of the inducing inputs from sub-blocks of the kept statistics, against
an SFR built on that subset from the same data (an independent computation: a fresh pass over the data)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from ntkgp.models import SFRMemoryOptions
from ntkgp.models.sfr import SFR
from tests.helpers import mlp, rel_err
from tests.models.sfr.problems import DELTA, dense_moments, predictions, problem

CASES = [("gaussian", 1, "joint"), ("gaussian", 2, "independent"), ("logistic", 1, "joint"),
         ("softmax", 3, "joint"), ("softmax", 3, "independent")]
M = 10
SUBSET = torch.tensor([7, 2, 5, 0, 9])  # any order: the new Z takes it


def index_forms(kind: str) -> tuple[object, torch.Tensor]:
    """The index in one of its forms and the positions it selects."""
    if kind == "int":
        return 4, torch.arange(4)
    if kind == "mask":
        mask = torch.zeros(M, dtype=torch.bool)
        mask[SUBSET] = True
        return mask, SUBSET.sort().values
    return SUBSET, SUBSET


def built(kind, c, coupling, n=30, **kw):
    net, x, y, lik, xs = problem(kind, c, n=n)
    z = x[:M].clone()
    sfr = SFR(net, x, y, lik, inducing_points=z, output_coupling=coupling, prior_precision=DELTA, **kw)
    return sfr, (net, x, y, lik, xs, z)


def snapshot(sfr) -> dict:
    """Copies of every tensor of the model (its state_dict) and the inducing inputs' count."""
    return {k: v.detach().clone() for k, v in sfr.state_dict().items()}


def assert_unchanged(sfr, before: dict, expected, xs) -> None:
    """The original model: the same stored tensors (never written to) and the same predictive (recomputed by the
    same code on the same model: rounding-level agreement)."""
    after = sfr.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    for u, v in zip(predictions(sfr, xs), expected):
        assert rel_err(u, v) < 1e-12


@pytest.mark.parametrize("form", ["int", "tensor", "mask"])
@pytest.mark.parametrize("kind,c,coupling", CASES)
def test_subset_equals_an_sfr_built_on_the_subset(kind, c, coupling, form):
    sfr, (net, x, y, lik, xs, z) = built(kind, c, coupling)
    expected, before = predictions(sfr, xs), snapshot(sfr)
    index, positions = index_forms(form)
    small = sfr.select_inducing(index)
    fresh = SFR(net, x, y, copy.deepcopy(lik), inducing_points=z[positions], output_coupling=coupling,
                prior_precision=DELTA)
    assert torch.equal(small.inducing_points, z[positions]) and small.num_inducing == positions.numel()
    assert small.num_data == fresh.num_data == 30
    # float64 throughout; both solve well-conditioned systems (full inducing rank, checked): rounding-level agreement
    assert small.inducing_rank.tolist() == fresh.inducing_rank.tolist()
    (m1, c1), (m2, c2) = dense_moments(small(xs)), dense_moments(fresh(xs))
    assert rel_err(m1, m2) < 1e-10 and rel_err(c1, c2) < 1e-10
    assert rel_err(c1.diagonal(), c2.diagonal()) < 1e-10
    assert rel_err(small.log_marginal_likelihood(), fresh.log_marginal_likelihood()) < 1e-10
    assert small.engine.net is net and small.likelihood is not sfr.likelihood  # the network shared, the rest its own
    assert_unchanged(sfr, before, expected, xs)


@pytest.mark.parametrize("kind,c,coupling", [("gaussian", 1, "joint"), ("softmax", 3, "joint"),
                                             ("softmax", 3, "independent")])
def test_the_subset_model_updates_tunes_and_saves_as_a_fresh_one(kind, c, coupling):
    sfr, (net, x, y, lik, xs, z) = built(kind, c, coupling)
    idx = SUBSET
    small = sfr.select_inducing(idx)
    fresh = SFR(net, x, y, copy.deepcopy(lik), inducing_points=z[idx], output_coupling=coupling, prior_precision=DELTA)
    expected, before = predictions(sfr, xs), snapshot(sfr)
    # update with new data (one-step sites; for classification also iterated: at the mode on the subset's Z)
    x_new, y_new = problem(kind, c, n=40, seed=1)[1:3]
    iterate = kind != "gaussian"
    small.update(x_new[:6], y_new[:6], iterate=iterate)
    fresh.update(x_new[:6], y_new[:6], iterate=iterate)
    for u, v in zip(predictions(small, xs), predictions(fresh, xs)):
        assert rel_err(u, v) < 1e-10
    # δ: the predictive grid, the evidence's gradient, and tuning (which moves the new model's δ only)
    for d1, d2 in zip(small.predictive_grid(xs, [0.5, 3.0]), fresh.predictive_grid(xs, [0.5, 3.0])):
        assert rel_err(d1.mean, d2.mean) < 1e-10 and rel_err(d1.covariance_matrix, d2.covariance_matrix) < 1e-10
    grads = []
    for model in (small, fresh):
        model.train()
        model.covar_module.raw_prior_precision.grad = None
        model.log_marginal_likelihood().backward()
        grads.append(model.covar_module.raw_prior_precision.grad.clone())
        model.eval()
    assert rel_err(grads[0], grads[1]) < 1e-9
    found = small.optimize_prior_precision(optimizer="grid", grid=[0.3, 1.0, 3.0])
    assert torch.equal(found, fresh.optimize_prior_precision(optimizer="grid", grid=[0.3, 1.0, 3.0]))
    assert torch.allclose(sfr.covar_module.prior_precision, DELTA)
    # state_dict: loaded into a model built on the subset's Z from two points, it predicts as the subset model
    target = SFR(net, x[:2], y[:2], copy.deepcopy(lik), inducing_points=z[idx], output_coupling=coupling)
    target.load_state_dict(small.state_dict())
    for u, v in zip(predictions(target, xs), predictions(small, xs)):
        assert rel_err(u, v) < 1e-12
    for u, v in zip(predictions(pickle.loads(pickle.dumps(small)), xs), predictions(small, xs)):
        assert rel_err(u, v) < 1e-12
    assert_unchanged(sfr, before, expected, xs)


def test_nested_subsets_and_combined_statistics():
    """A subset of a subset is the subset of the whole; combined statistics (δ fixed) restrict the same way."""
    net, x, y, lik, xs = problem("softmax", 3, n=30)
    z = x[:M].clone()
    kw = {"prior_precision": DELTA, "memory": SFRMemoryOptions(statistics="combined")}
    sfr = SFR(net, x, y, lik, inducing_points=z, **kw)
    twice = sfr.select_inducing(8).select_inducing(torch.tensor([3, 0, 6]))
    fresh = SFR(net, x, y, copy.deepcopy(lik), inducing_points=z[[3, 0, 6]], **kw)
    assert twice.dual_statistics.combined
    for u, v in zip(predictions(twice, xs), predictions(fresh, xs)):
        assert rel_err(u, v) < 1e-10


def test_after_one_step_updates_a_subset_is_still_exact():
    """Updates with sites at the network's outputs are plain sums: the subset equals a build on the union."""
    net, x, y, lik, xs = problem("softmax", 3, n=30)
    z = x[:M].clone()
    sfr = SFR(net, x[:12], y[:12], lik, inducing_points=z, prior_precision=DELTA)
    sfr.update(x[12:], y[12:], iterate=False)
    fresh = SFR(net, x, y, copy.deepcopy(lik), inducing_points=z[:6], prior_precision=DELTA)
    for u, v in zip(predictions(sfr.select_inducing(6), xs), predictions(fresh, xs)):
        assert rel_err(u, v) < 1e-10


def test_float32_subset_against_a_float64_copy_built_on_the_subset():
    """A float32 network's model restricted to 20 of its 40 inducing inputs, against a fresh SFR on those 20 of a
    float64 copy of the network, within the first-order error model of float32_bounds.py (float32 features of the
    data and test points rounded by rε, propagated through the float64 systems with their measured condition): the
    subset is the float32 model on those inducing inputs, whose error that model bounds."""
    from tests.models.sfr.test_sfr_float32 import error_model, likelihood, ratios, trained_classifier

    net, x, y, xs = trained_classifier()
    x, y, xs = x[:120], y[:120], xs[:30]
    sfr32 = SFR(net, x, y, likelihood("softmax", 3, torch.float32), num_inducing=40)
    small = sfr32.select_inducing(20)
    z64 = sfr32.inducing_points[:20].double()
    sfr64 = SFR(copy.deepcopy(net).double(), x.double(), y, likelihood("softmax", 3, torch.float64),
                inducing_points=z64)
    assert small.inducing_points.dtype == torch.float32 and small(xs).mean.dtype == torch.float32
    assert torch.equal(small.inducing_rank, sfr64.inducing_rank) and int(sfr64.inducing_rank.min()) == 60
    found = ratios(error_model(net, x, y, xs, small, sfr64))
    assert max(found[k] for k in ("mean", "variance", "probs", "evidence")) <= 1 and found["decisions"], found


def _bad_indices():
    mask = torch.zeros(M, dtype=torch.bool)
    return [
        (True, TypeError, "index"), (2.0, TypeError, "index"), ("3", TypeError, "index"),
        (torch.tensor(3), TypeError, "index"), (torch.tensor([1.0, 2.0]), TypeError, "dtype"),
        (0, ValueError, "between 1 and"), (M + 1, ValueError, "between 1 and"), ([], ValueError, "no inducing"),
        (mask, ValueError, "no inducing"), (torch.ones(M + 1, dtype=torch.bool), ValueError, "entries"),
        (torch.tensor([0, M]), ValueError, "outside"), (torch.tensor([-1, 2]), ValueError, "outside"),
        (torch.tensor([1, 3, 1]), ValueError, "twice"), (torch.tensor([[0, 1]]), ValueError, "1-D"),
        ([0, True], TypeError, "index"),
    ]


@pytest.mark.parametrize("bad,error,match", _bad_indices())
def test_invalid_index_is_refused_before_anything(bad, error, match):
    sfr, (*_, xs, _) = built("softmax", 3, "joint")
    expected, before = predictions(sfr, xs), snapshot(sfr)
    with pytest.raises(error, match=match):
        sfr.select_inducing(bad)
    assert_unchanged(sfr, before, expected, xs)


def test_refuses_iterated_sites_and_changed_weights():
    sfr, (_, x, y, lik, _, z) = built("softmax", 3, "joint")
    sfr.update(x[:4], y[:4])  # iterate=True (classification's default): sites at the mode on all of Z
    with pytest.raises(RuntimeError, match="iterated update"):
        sfr.select_inducing(5)
    # the record travels with the state dict: loaded into a fresh model (whose own statistics are plain sums) it
    # still refuses; a state dict saved without the record (older files) loads, and its unknown kind is refused
    fresh = SFR(mlp(3, 6, 3, depth=2, seed=0), x, y, copy.deepcopy(lik), inducing_points=z, prior_precision=DELTA)
    fresh.select_inducing(5)
    state = sfr.state_dict()
    fresh.load_state_dict(state)
    with pytest.raises(RuntimeError, match="iterated update"):
        fresh.select_inducing(5)
    older = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    assert len(older) == len(state) - 1
    fresh.load_state_dict(older)
    with pytest.raises(RuntimeError, match="unknown"):
        fresh.select_inducing(5)
    net2 = mlp(3, 6, 3, depth=2, seed=0)
    other = SFR(net2, x, y, copy.deepcopy(lik), inducing_points=z, prior_precision=DELTA)
    with torch.no_grad():
        next(net2.parameters()).add_(0.1)
    with pytest.raises(RuntimeError, match="weights changed"):
        other.select_inducing(5)
