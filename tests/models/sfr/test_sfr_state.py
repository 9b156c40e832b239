"""After any change of δ, the noise or the temperature (setter, ``.data``, ``load_state_dict``, optimizer step)
the next prediction and evidence equal those of a freshly built SFR; a change of the network's weights raises."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR
from tests.helpers import mlp, rel_err
from tests.models.sfr.problems import DELTA, NEW_DELTA, assert_same, change_delta, dense_moments, predictions, problem

ROUTES = ["setter", "data", "load_state_dict", "optimizer"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind,c,coupling", [("gaussian", 1, "joint"), ("softmax", 3, "independent")])
def test_prior_precision_change_by_any_route_equals_a_fresh_model(route, kind, c, coupling):
    net, x, y, lik, xs = problem(kind, c, n=20)
    kw = {"inducing_points": x[:6], "output_coupling": coupling}
    sfr = SFR(net, x, y, lik, prior_precision=DELTA, **kw)
    predictions(sfr, xs)  # fill every cache
    delta = change_delta(sfr, route)
    fresh = SFR(net, x, y, type(lik)(*([c] if kind == "softmax" else [])).double(), prior_precision=delta, **kw)
    if kind == "gaussian":
        fresh.likelihood.noise = lik.noise
    assert_same(predictions(sfr, xs), predictions(fresh, xs))


def change_noise(sfr, route: str) -> torch.Tensor:
    lik = sfr.likelihood
    constraint = lik.noise_covar.raw_noise_constraint
    new = torch.tensor([0.37], dtype=torch.float64)
    if route == "setter":
        lik.noise = new
    elif route == "data":
        lik.noise_covar.raw_noise.data.copy_(constraint.inverse_transform(new))
    elif route == "load_state_dict":
        state = sfr.state_dict()
        state["likelihood.noise_covar.raw_noise"] = constraint.inverse_transform(new)
        sfr.load_state_dict(state)
    else:
        optimizer = torch.optim.SGD([lik.noise_covar.raw_noise], lr=0.3)
        lik.noise_covar.raw_noise.grad = torch.ones_like(lik.noise_covar.raw_noise)
        optimizer.step()
    return lik.noise.detach().clone()


@pytest.mark.parametrize("route", ROUTES)
def test_noise_change_by_any_route_equals_a_fresh_model(route):
    net, x, y, lik, xs = problem("gaussian", 1, n=20)
    sfr = SFR(net, x, y, lik, inducing_points=x[:6], prior_precision=DELTA)
    predictions(sfr, xs)
    noise = change_noise(sfr, route)
    fresh_lik = type(lik)().double()
    fresh_lik.noise = noise
    fresh = SFR(net, x, y, fresh_lik, inducing_points=x[:6], prior_precision=DELTA)
    assert_same(predictions(sfr, xs), predictions(fresh, xs))


@pytest.mark.parametrize("route", ROUTES)
def test_temperature_change_by_any_route_equals_a_fresh_model(route):
    net, x, y, _, xs = problem("softmax", 3, n=20)
    lik = SoftmaxLikelihood(3, temperature=1.0, learn_temperature=True).double()
    sfr = SFR(net, x, y, lik, inducing_points=x[:6], prior_precision=DELTA)
    predictions(sfr, xs)
    constraint = lik.raw_temperature_constraint
    new = torch.tensor(0.4, dtype=torch.float64)
    if route == "setter":
        lik.temperature = new
    elif route == "data":
        lik.raw_temperature.data.copy_(constraint.inverse_transform(new))
    elif route == "load_state_dict":
        state = sfr.state_dict()
        state["likelihood.raw_temperature"] = constraint.inverse_transform(new)
        sfr.load_state_dict(state)
    else:
        optimizer = torch.optim.SGD([lik.raw_temperature], lr=0.3)
        lik.raw_temperature.grad = torch.ones_like(lik.raw_temperature)
        optimizer.step()
    fresh_lik = SoftmaxLikelihood(3).double()
    fresh_lik.temperature = lik.temperature.detach()
    fresh = SFR(net, x, y, fresh_lik, inducing_points=x[:6], prior_precision=DELTA)
    assert_same(predictions(sfr, xs), predictions(fresh, xs))


def test_loading_another_models_state_equals_that_model():
    net, x, y, lik, xs = problem("softmax", 3, n=30)
    kw = {"inducing_points": x[:6], "prior_precision": DELTA}
    small = SFR(net, x[:10], y[:10], lik, **kw)
    big = SFR(net, x, y, SoftmaxLikelihood(3).double(), **kw)
    predictions(small, xs)
    small.load_state_dict(big.state_dict())
    assert small.num_data == 30
    assert_same(predictions(small, xs), predictions(big, xs))


@pytest.mark.parametrize("route", ["data", "load_state_dict", "optimizer"])
def test_changing_the_network_weights_raises_a_clear_error(route):
    net, x, y, lik, xs = problem("gaussian", 1, n=15)
    sfr = SFR(net, x, y, lik, num_inducing=5)
    before = predictions(sfr, xs)
    original = {k: v.clone() for k, v in net.state_dict().items()}
    if route == "data":
        next(net.parameters()).data.mul_(1.5)
    elif route == "load_state_dict":
        other = mlp(3, 6, 1, depth=2, seed=7)
        net.load_state_dict(other.state_dict())
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        net(x).square().sum().backward()
        optimizer.step()
    for call in (lambda: sfr(xs), sfr.log_marginal_likelihood, lambda: sfr.update(x[:3], y[:3])):
        with pytest.raises(RuntimeError, match="weights changed"):
            call()
    net.load_state_dict(original)  # back at θ*: the model describes the network again
    assert_same(predictions(sfr, xs), before)


def test_changing_a_frozen_parameter_raises_too():
    """A frozen parameter (requires_grad=False) is not differentiated but changes J: the statistics no longer
    describe the network."""
    net, x, y, lik, xs = problem("gaussian", 1, n=15)
    net[0].weight.requires_grad_(False)
    sfr = SFR(net, x, y, lik, num_inducing=5)
    before = predictions(sfr, xs)
    with torch.no_grad():
        net[0].weight.add_(0.5)
    with pytest.raises(RuntimeError, match="weights changed"):
        sfr(xs)
    with torch.no_grad():
        net[0].weight.sub_(0.5)
    assert_same(predictions(sfr, xs), before)


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_freezing_or_unfreezing_a_parameter_after_construction_raises(change):
    """requires_grad_ after construction changes the Jacobian's columns and δ's groups of a freshly built SFR
    (here its variance differs by O(1)): every call refuses, naming the parameter, until the flag is restored."""
    net, x, y, lik, xs = problem("gaussian", 1, n=15)
    if change == "unfreeze":
        net[0].weight.requires_grad_(False)
    sfr = SFR(net, x, y, lik, inducing_points=x[:6])
    before = predictions(sfr, xs)
    net[0].weight.requires_grad_(change == "unfreeze")
    fresh = SFR(net, x, y, lik, inducing_points=x[:6])  # what a silent mix would have to equal
    assert rel_err(predictions(fresh, xs)[1], before[1]) > 1e-3
    for call in (lambda: sfr(xs), sfr.log_marginal_likelihood, lambda: sfr.update(x[:3], y[:3])):
        with pytest.raises(RuntimeError, match=r"trainable parameters of net changed.*'0.weight'.*build a new SFR"):
            call()
    net[0].weight.requires_grad_(change == "freeze")  # restored: usable again, as before
    assert_same(predictions(sfr, xs), before)


def test_inducing_points_modified_in_place_raise():
    net, x, y, lik, xs = problem("gaussian", 1, n=15)
    sfr = SFR(net, x, y, lik, num_inducing=5)
    sfr.inducing_points.data.add_(1.0)
    with pytest.raises(RuntimeError, match="inducing_points"):
        sfr(xs)


def test_eval_caches_are_reused_and_train_mode_recomputes_with_gradients():
    net, x, y, lik, xs = problem("gaussian", 1, n=15)
    sfr = SFR(net, x, y, lik, num_inducing=5)
    assert sfr._factors() is sfr._factors()  # eval: cached
    sfr.train()
    a, b = sfr._factors(), sfr._factors()
    assert a is not b and a.factors.alpha.requires_grad
    sfr.log_marginal_likelihood().backward()
    assert sfr.covar_module.raw_prior_precision.grad is not None


def _square_tensors(obj, size, seen=None):
    """The ``(..., size, size)`` tensors reachable from a cached value (dataclasses and plain attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return [obj] if obj.dim() >= 2 and obj.shape[-2:] == (size, size) else []
    found = []
    for value in vars(obj).values() if hasattr(obj, "__dict__") else []:
        found += _square_tensors(value, size, seen)
    return found


def test_cached_factors_keep_only_the_two_triangular_factors_and_never_touch_the_statistics():
    """Memory (docs/scaling.md): the caches hold L_Z and R only (no K_ZZ, B_u or A), stale factors are dropped
    on a change of δ, and the factorization that reuses B_u's storage never writes into the statistics."""
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    kw = {"inducing_points": x[:6], "output_coupling": "joint"}
    sfr = SFR(net, x, y, lik, prior_precision=DELTA, **kw)
    statistics = {name: buffer.clone() for name, buffer in sfr.dual_statistics.named_buffers()}
    first = predictions(sfr, xs)
    size = 6 * 3
    own = {id(b) for b in sfr.buffers()}  # the model's own per-group K_ZZ Grams are referenced, not copied
    squares = {id(t): t for value in sfr._cache.entries() for t in _square_tensors(value, size) if id(t) not in own}
    state = sfr._factors()
    assert set(squares) == {id(state.factors.chol), id(state.factors.whitening.chol)}
    delta = change_delta(sfr, "setter")
    second = predictions(sfr, xs)
    assert all(len(sfr._cache._caches[name]) == 1 for name in ("inducing", "posterior"))
    assert sfr._factors().factors.whitening.chol is not state.factors.whitening.chol
    for name, buffer in sfr.dual_statistics.named_buffers():
        assert torch.equal(buffer, statistics[name]), name
    fresh = SFR(net, x, y, SoftmaxLikelihood(3).double(), prior_precision=delta, **kw)
    assert_same(second, predictions(fresh, xs))
    sfr.covar_module.prior_precision = DELTA
    assert_same(predictions(sfr, xs), first, tol=1e-12)
