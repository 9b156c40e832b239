"""The likelihoods' option attributes (ntkgp.options.OptionAttribute): ``link_approx``, ``num_samples`` and
``learn_temperature`` assigned after construction give the likelihood built with them (predictive probabilities
and parameters equal to a freshly built one's), invalid values are refused naming the attribute, and
``SoftmaxLikelihood.num_classes`` cannot change (the error says to rebuild)."""

from __future__ import annotations

import pytest
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal

from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood, sigmoid_monte_carlo, softmax_probit
from ntkgp.options import Link, option_attributes

C, N = 3, 4


def _make(kind, **options):
    return LogisticLikelihood(**options) if kind == "logistic" else SoftmaxLikelihood(C, **options)


def _dist(kind):
    g = torch.Generator().manual_seed(0)
    if kind == "logistic":
        return MultivariateNormal(torch.randn(N, generator=g), torch.diag(torch.rand(N, generator=g) + 0.5))
    root = torch.randn(N * C, N * C, generator=g)
    return MultitaskMultivariateNormal(torch.randn(N, C, generator=g), root @ root.T / (N * C) + torch.eye(N * C))


def _probs(likelihood, kind):
    return likelihood(_dist(kind), generator=torch.Generator().manual_seed(3)).probs


@pytest.mark.parametrize("kind", ["logistic", "softmax"])
def test_the_declared_option_attributes(kind):
    cls = LogisticLikelihood if kind == "logistic" else SoftmaxLikelihood
    expected = {"link_approx", "num_samples", "learn_temperature"} | ({"num_classes"} if kind == "softmax" else set())
    assert set(option_attributes(cls)) == expected


@pytest.mark.parametrize("kind", ["logistic", "softmax"])
@pytest.mark.parametrize(("name", "value", "built"), [("link_approx", "mc", "probit"), ("link_approx", Link.PROBIT, "mc"),
                                                      ("num_samples", 7, 100)])
def test_assigned_link_options_equal_a_fresh_likelihood(kind, name, value, built):
    options = {"link_approx": "mc"} if name == "num_samples" else {}
    likelihood = _make(kind, **{**options, name: built})
    before = _probs(likelihood, kind)
    setattr(likelihood, name, value)
    after = _probs(likelihood, kind)
    assert torch.equal(after, _probs(_make(kind, **{**options, name: value}), kind))
    assert not torch.equal(after, before)
    assert getattr(likelihood, name) == value


def test_the_assigned_values_are_the_ones_used():
    likelihood = LogisticLikelihood()
    likelihood.link_approx, likelihood.num_samples = "mc", 11
    dist = _dist("logistic")
    expected = sigmoid_monte_carlo(dist.mean, dist.variance, 11, torch.Generator().manual_seed(3))
    torch.testing.assert_close(_probs(likelihood, "logistic"), expected, rtol=0, atol=0)
    softmax = SoftmaxLikelihood(C, link_approx="mc")
    softmax.link_approx = "probit"
    dist = _dist("softmax")
    torch.testing.assert_close(_probs(softmax, "softmax"), softmax_probit(dist.mean, dist.variance))


@pytest.mark.parametrize("kind", ["logistic", "softmax"])
@pytest.mark.parametrize(("name", "bad"), [("link_approx", "bridge"), ("link_approx", Link.BRIDGE),
                                           ("link_approx", None), ("num_samples", 0), ("num_samples", 2.5),
                                           ("num_samples", True), ("learn_temperature", 1),
                                           ("learn_temperature", "yes")])
def test_invalid_assignments_are_refused_and_change_nothing(kind, name, bad):
    likelihood = _make(kind)
    before = getattr(likelihood, name)
    with pytest.raises(ValueError, match=name):
        setattr(likelihood, name, bad)
    with pytest.raises(ValueError, match=name):  # the constructor refuses the same values
        _make(kind, **{name: bad})
    assert getattr(likelihood, name) == before


@pytest.mark.parametrize("kind", ["logistic", "softmax"])
@pytest.mark.parametrize("value", [True, False])
def test_learn_temperature_sets_what_the_constructor_sets(kind, value):
    likelihood = _make(kind, learn_temperature=not value, temperature=0.7)
    likelihood.learn_temperature = value
    fresh = _make(kind, learn_temperature=value, temperature=0.7)
    assert likelihood.raw_temperature.requires_grad is fresh.raw_temperature.requires_grad is value
    assert [n for n, p in likelihood.named_parameters() if p.requires_grad] == [
        n for n, p in fresh.named_parameters() if p.requires_grad
    ]
    assert torch.equal(likelihood.temperature, fresh.temperature)


def test_num_classes_cannot_change():
    likelihood = SoftmaxLikelihood(C)
    likelihood.num_classes = C  # the same value: nothing to do
    with pytest.raises(AttributeError, match="build a new SoftmaxLikelihood"):
        likelihood.num_classes = C + 1
    with pytest.raises(ValueError, match="num_classes"):
        likelihood.num_classes = 1
    assert likelihood.num_classes == C
    assert likelihood(torch.zeros(2, C)).probs.shape == (2, C)
