"""Saving and loading SFR (issue 25, items 2 and 6): the statistics' key travels with the ``state_dict``, so statistics
saved at other weights (or other inducing inputs) raise instead of predicting silently; a used model pickles whole."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from ntkgp.models.sfr import SFR
from tests.models.sfr.problems import DELTA, assert_same, predictions, problem


def moved(net) -> dict[str, torch.Tensor]:
    """Move the network's first weight; returns its state before, to restore it exactly."""
    original = copy.deepcopy(net.state_dict())
    with torch.no_grad():
        next(net.parameters()).mul_(1.3)
    return original


def test_issue_25_loading_a_state_back_after_the_weights_moved_raises():
    """Save the state_dict, move the network's weights, load the state_dict back: the statistics belong to the old
    weights, so the model must raise (it used to re-arm its guard at the new weights and predict from a mix)."""
    net, x, y, lik, xs = problem("gaussian", 1, n=15)
    sfr = SFR(net, x, y, lik, num_inducing=5, prior_precision=DELTA)
    before = predictions(sfr, xs)
    state = copy.deepcopy(sfr.state_dict())
    original = moved(net)
    sfr.load_state_dict(state)
    for call in (lambda: sfr(xs), sfr.log_marginal_likelihood, lambda: sfr.update(x[:3], y[:3])):
        with pytest.raises(RuntimeError, match="weights changed"):
            call()
    net.load_state_dict(original)  # the weights the statistics belong to: usable again
    assert_same(predictions(sfr, xs), before)


def test_statistics_saved_at_other_weights_raise_until_those_weights_are_back():
    """Model A at θ₁ saved; model B built at θ₂ loads A's state: it now holds θ₁'s statistics, so it raises at θ₂ and
    equals A (a freshly built model at θ₁) once the network is back at θ₁."""
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    z = x[:6]
    first = SFR(net, x, y, lik, inducing_points=z, prior_precision=DELTA)
    reference = predictions(first, xs)
    state = copy.deepcopy(first.state_dict())
    original = moved(net)
    second = SFR(net, x, y, type(lik)(3).double(), inducing_points=z, prior_precision=DELTA)
    predictions(second, xs)  # valid at θ₂ (fills its caches)
    second.load_state_dict(state)
    with pytest.raises(RuntimeError, match="weights changed"):
        second(xs)
    net.load_state_dict(original)
    assert_same(predictions(second, xs), reference)
    moved(net)  # the guard is armed again with copies: a later change raises too
    with pytest.raises(RuntimeError, match="weights changed"):
        second.log_marginal_likelihood()


def test_a_state_whose_inducing_points_differ_from_its_statistics_raises():
    net, x, y, lik, xs = problem("gaussian", 1, n=15)
    sfr = SFR(net, x, y, lik, num_inducing=5, prior_precision=DELTA)
    before = predictions(sfr, xs)
    state = copy.deepcopy(sfr.state_dict())
    z = state["inducing_points"].clone()
    state["inducing_points"] = z + 0.5  # not the inducing inputs of these statistics
    sfr.load_state_dict(state)
    with pytest.raises(RuntimeError, match="inducing_points"):
        sfr(xs)
    state["inducing_points"] = z
    sfr.load_state_dict(state)
    assert_same(predictions(sfr, xs), before)


def test_a_state_without_the_key_is_refused():
    net, x, y, lik, _ = problem("gaussian", 1, n=15)
    sfr = SFR(net, x, y, lik, num_inducing=5)
    state = sfr.state_dict()
    assert state["_state_key"].dtype == torch.int64
    del state["_state_key"]
    with pytest.raises(RuntimeError, match="_state_key"):
        sfr.load_state_dict(state)


def _used(kind, c):
    net, x, y, lik, xs = problem(kind, c, n=20)
    sfr = SFR(net, x[:14], y[:14], lik, num_inducing=6, prior_precision=DELTA)
    sfr(xs)  # cached factors
    sfr.update(x[14:], y[14:])
    sfr.log_marginal_likelihood()
    grad_x = xs.clone().requires_grad_(True)
    sfr(grad_x).mean.sum().backward()  # the route with a graph: J(Z) cached too
    return sfr, xs


@pytest.mark.parametrize("kind,c", [("gaussian", 1), ("softmax", 3)])
def test_a_used_model_pickles_and_torch_saves_whole(kind, c):
    sfr, xs = _used(kind, c)
    expected = predictions(sfr, xs)
    for load in (
        lambda: pickle.loads(pickle.dumps(sfr)),
        lambda: torch.load(_saved(sfr), weights_only=False),
        lambda: copy.deepcopy(sfr),
    ):
        other = load()
        assert_same(predictions(other, xs), expected, tol=1e-12)
        assert other.num_data == 20
        original = moved(other.engine.net)  # its network (a copy; shared by a deepcopy, as for BoTorch)
        with pytest.raises(RuntimeError, match="weights changed"):
            other(xs)
        other.engine.net.load_state_dict(original)
    assert_same(predictions(sfr, xs), expected, tol=1e-14)  # the original is unchanged


def _saved(model) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer
