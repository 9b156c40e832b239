"""Options assigned after construction (issue 29): an assignable option makes the model equal to a freshly built one
with that value (strings and enum members alike); a fixed one raises ``AttributeError`` saying to build a new SFR
and leaves the model as it was."""

from __future__ import annotations

import pytest
import torch

from ntkgp.likelihoods import LogisticLikelihood
from ntkgp.models.sfr import SFR
from ntkgp.options import (
    InducingMethod,
    OptionAttribute,
    OutputCoupling,
    PredictiveMean,
    PriorMean,
    StatisticsMode,
    option_attributes,
)
from tests.helpers import mlp
from tests.models.sfr.problems import DELTA, dense_moments, problem, sfr_factory, sfr_outputs

ASSIGNABLE = {
    "predictive_mean": ["gp", "nn", PredictiveMean.GP, PredictiveMean.NN],
    "batch_size": [None, 1, 7],
    "chunk_size": [1, 3, 1024],
    "progress": [True, False],
}
FIXED = {
    "prior_mean": (PriorMean.LINEARIZED, ["zero", PriorMean.ZERO]),
    "output_coupling": (OutputCoupling.JOINT, ["independent", OutputCoupling.INDEPENDENT]),
    "statistics": (StatisticsMode.PER_GROUP, ["combined", StatisticsMode.COMBINED]),
    "inducing_method": (InducingMethod.RANDOM, ["greedy_variance"]),
    "seed": (0, [1]),
    "pool_size": (4096, [16]),
    "distributed": (False, []),  # True needs a process group: refused by its validator (below)
    "inducing_feature_bytes": (None, [0, 2**30]),
}


def assert_equal_outputs(a, b, tol=1e-10):
    for name, (u, v) in zip(("mean", "covariance", "evidence"), zip(a, b)):
        assert (u - v).abs().max() <= tol * max(1.0, float(v.abs().max())), name


def test_every_option_attribute_is_declared_once_with_one_mechanism():
    declared = option_attributes(SFR)
    assert set(declared) == set(ASSIGNABLE) | set(FIXED)
    assert all(isinstance(a, OptionAttribute) for a in declared.values())
    assert {n for n, a in declared.items() if a.fixed is None} == set(ASSIGNABLE)


@pytest.mark.parametrize("name", sorted(ASSIGNABLE))
def test_assigning_an_option_equals_a_model_built_with_it(name):
    for value in ASSIGNABLE[name]:
        model = sfr_factory()
        sfr_outputs(model)  # fill every cache at the old value
        model.__setattr__(name, value)
        assert getattr(model, name) == value
        assert_equal_outputs(sfr_outputs(model), sfr_outputs(sfr_factory(**{name: value})))


def test_issue_29_reassigning_the_predictive_mean_keeps_the_class_scores():
    """The reported case: assigning predictive_mean="gp" (as the docs spell it) gave the prior mean alone, with the
    class scores of the opposite sign; now it equals the model built with it, from either previous value."""
    torch.manual_seed(1)
    x = torch.randn(60, 3, dtype=torch.float64)
    label = (x[:, 0] + 0.5 * x[:, 1] > 0).to(torch.float64)
    net = mlp(3, 16, 1, depth=2, seed=1)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(200):
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(net(x).squeeze(-1), label).backward()
        optimizer.step()
    xs = torch.randn(40, 3, dtype=torch.float64)
    fresh = SFR(net, x, label, LogisticLikelihood().double(), num_inducing=20, predictive_mean="gp")
    reassigned = SFR(net, x, label, LogisticLikelihood().double(), num_inducing=20, predictive_mean="nn")
    reassigned(xs)
    for value in ("gp", PredictiveMean.GP):
        reassigned.predictive_mean = value
        assert reassigned.predictive_mean is PredictiveMean.GP
        (m1, c1), (m2, c2) = dense_moments(reassigned(xs)), dense_moments(fresh(xs))
        assert torch.allclose(m1, m2, rtol=1e-10, atol=1e-12) and torch.allclose(c1, c2, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(FIXED))
def test_a_fixed_option_refuses_another_value_and_leaves_the_model_unchanged(name):
    built, others = FIXED[name]
    model = sfr_factory()
    before = sfr_outputs(model)
    model.__setattr__(name, built)  # the same value, as a member or its string: accepted (nothing changes)
    model.__setattr__(name, getattr(built, "value", built))
    for value in others:
        with pytest.raises(AttributeError, match=rf"SFR\.{name} cannot be changed after construction.*build a new SFR"):
            model.__setattr__(name, value)
        assert getattr(model, name) == built
    assert_equal_outputs(sfr_outputs(model), before, tol=0.0)


@pytest.mark.parametrize(
    "name,value,error,match",
    [
        ("predictive_mean", "mc", ValueError, "predictive_mean must be one of"),
        ("batch_size", 0, ValueError, "batch_size must be a positive integer"),
        ("chunk_size", 2.5, ValueError, "chunk_size must be a positive integer"),
        ("progress", 1, TypeError, "progress must be True, False or None"),
        ("prior_mean", "linear", ValueError, "prior_mean must be one of"),
        ("distributed", True, ValueError, "distributed=True needs an initialized torch.distributed process group"),
        ("output_coupling", "diagonal", ValueError, "output_coupling must be one of"),
        ("seed", 1.5, ValueError, "seed must be an integer"),
    ],
)
def test_invalid_values_are_refused_by_the_constructors_validator(name, value, error, match):
    model = sfr_factory()
    before = sfr_outputs(model)
    old = getattr(model, name)
    with pytest.raises(error, match=match):
        model.__setattr__(name, value)
    assert getattr(model, name) == old
    assert_equal_outputs(sfr_outputs(model), before, tol=0.0)
    with pytest.raises(error, match=match):  # the constructor says the same
        sfr_factory(**{name: value})


def test_num_inducing_is_read_only():
    model = sfr_factory()
    with pytest.raises(AttributeError, match="build a new SFR with num_inducing=3"):
        model.num_inducing = 3
    assert model.num_inducing == 6


def test_chunk_size_reaches_the_engine_and_batch_size_the_prediction_chunks():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    model = SFR(net, x, y, lik, inducing_points=x[:6], prior_precision=DELTA)
    model.chunk_size = 2
    assert model.engine.chunk_size == 2
    model.batch_size = 2
    dist = model(xs)
    assert dist.lazy_covariance_matrix.low_rank_z is None  # more than one chunk: factors recomputed on demand
    reference = SFR(net, x, y, lik, inducing_points=x[:6], prior_precision=DELTA)
    assert torch.allclose(dist.covariance_matrix, reference(xs).covariance_matrix, rtol=1e-10, atol=1e-12)
