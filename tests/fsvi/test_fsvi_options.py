"""FSVI's option attributes (ntkgp.options.OptionAttribute): an assigned value gives the model built with it (its
KL and predictions equal those of a freshly built model with the same state), an invalid one is refused naming the
attribute and changes nothing, and ``prior.prior_linearization`` cannot change (the error says to rebuild)."""

from __future__ import annotations

import math

import pytest
import torch
from gpytorch.likelihoods import MultitaskGaussianLikelihood

from ntkgp.fsvi import FSVI, GaussianParameterPrior
from ntkgp.options import KLCovariance, PriorLinearization, option_attributes

from . import reference as ref
from .test_model import _perturbed

F64 = torch.float64


def _build(**options):
    net = ref.mlp(d_in=2, width=5, d_out=3)
    return FSVI(net, MultitaskGaussianLikelihood(3, rank=0).double(), prior_structure="parameter", **options)


def _equal_to_fresh(model, **options):
    fresh = _build(**options)
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(6, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.function_space_kl(x), fresh.function_space_kl(x))
    with torch.no_grad():
        assert torch.equal(model(x).covariance_matrix, fresh(x).covariance_matrix)
    for name in option_attributes(FSVI):
        assert getattr(model, name) == getattr(fresh, name)


def test_the_declared_option_attributes():
    assert set(option_attributes(FSVI)) == {"context_jitter", "kl_covariance"}
    assert set(option_attributes(GaussianParameterPrior)) == {"prior_linearization"}


@pytest.mark.parametrize("value", ["block", KLCovariance.DIAGONAL, "full"])
def test_kl_covariance_can_be_assigned(value):
    model = _perturbed(_build(kl_covariance="full" if value != "full" else "block", context_jitter=1e-3))
    x = torch.randn(4, 2, dtype=F64)
    before = model.function_space_kl(x)  # computed once with the old value: nothing stale may remain
    model.kl_covariance = value
    assert model.kl_covariance is KLCovariance(value)
    assert not torch.equal(model.function_space_kl(x), before)
    _equal_to_fresh(model, kl_covariance=value, context_jitter=1e-3)


@pytest.mark.parametrize("value", [0.0, 0.5, 3])
def test_context_jitter_can_be_assigned(value):
    model = _perturbed(_build(context_jitter=1e-2))
    model.function_space_kl(torch.randn(4, 2, dtype=F64))
    model.context_jitter = value
    assert model.context_jitter == value and isinstance(model.context_jitter, float)
    _equal_to_fresh(model, context_jitter=value)


@pytest.mark.parametrize(("name", "bad"), [("kl_covariance", "blocks"), ("kl_covariance", 1),
                                           ("context_jitter", -1.0), ("context_jitter", math.nan),
                                           ("context_jitter", math.inf), ("context_jitter", True),
                                           ("context_jitter", "0.1")])
def test_invalid_assignments_are_refused_and_change_nothing(name, bad):
    model = _build()
    before = getattr(model, name)
    with pytest.raises(ValueError, match=name):
        setattr(model, name, bad)
    with pytest.raises(ValueError, match=name):  # the constructor refuses the same values
        _build(**{name: bad})
    assert getattr(model, name) == before


def test_prior_linearization_cannot_change():
    model = _build(prior_mean="initial")
    prior = model.prior
    prior.prior_linearization = "variational_mean"  # the same value: nothing to do
    prior.prior_linearization = PriorLinearization.VARIATIONAL_MEAN
    with pytest.raises(AttributeError, match="build a new GaussianParameterPrior"):
        prior.prior_linearization = "prior_mean"
    with pytest.raises(ValueError, match="prior_linearization"):
        prior.prior_linearization = "data"
    assert prior.prior_linearization is PriorLinearization.VARIATIONAL_MEAN
