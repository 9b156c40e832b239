"""Option groups (ntkgp.option_groups): the grouped settings of train_marglik, train_fsvi, SFR and the weight-space
posteriors, and their old flat keywords, which still work for one release with a FutureWarning naming the group."""

import copy
import dataclasses
import warnings

import gpytorch
import pytest
import torch

from ntkgp.fsvi import FSVIOptimization, FSVIOptions, train_fsvi
from ntkgp.laplace import KFACLaplace, LastLayerLaplace, PassOptions
from ntkgp.models import SFR, SFRInducingOptions, SFRMemoryOptions
from ntkgp.option_groups import accepts_flat_keywords
from ntkgp.training import HyperparameterSchedule, MAPOptimization, train_marglik


def _regression(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(-1))
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    return x, y, net


def _same_weights(a, b):
    # the same call on the same inputs (the flat keywords are moved into the group before it runs): equal
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@dataclasses.dataclass(frozen=True)
class _Group:
    a: int = 1
    b: str = "x"


@accepts_flat_keywords(group=_Group)
def _target(value, *, group=None):
    return value, group


def test_a_flat_keyword_goes_into_the_group_with_a_future_warning_naming_it():
    with pytest.warns(FutureWarning, match=r"_target\(a=\.\.\.\) is deprecated: pass group=_Group\(a=\.\.\.\)"):
        assert _target(0, a=5) == (0, _Group(a=5))
    with pytest.warns(FutureWarning):  # merged into the group given
        assert _target(0, group=_Group(b="y"), a=5) == (0, _Group(a=5, b="y"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _target(0, group=_Group(a=2)) == (0, _Group(a=2))  # the new form: no warning


def test_a_field_given_both_ways_is_an_error_and_a_wrong_group_is_named():
    with pytest.raises(TypeError, match="a both as a keyword and in group="):
        _target(0, group=_Group(a=2), a=5)
    with pytest.raises(TypeError, match="group must be a _Group or None"):
        _target(0, group={"a": 2}, a=5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        _target(0, c=1)  # not a field: Python's own error


def test_train_marglik_flat_keywords_equal_the_groups():
    x, y, net = _regression()
    net_flat = copy.deepcopy(net)
    lik, lik_flat = gpytorch.likelihoods.GaussianLikelihood().double(), gpytorch.likelihoods.GaussianLikelihood().double()
    result = train_marglik(net, x, y, lik, epochs=2, lr=1e-2, progress=False,
                           schedule=HyperparameterSchedule(burn_in=1, frequency=1, hyper_steps=2),
                           optimization=MAPOptimization(optimizer=torch.optim.SGD, seed=3))
    with pytest.warns(FutureWarning) as record:
        flat = train_marglik(net_flat, x, y, lik_flat, epochs=2, lr=1e-2, progress=False, burn_in=1, frequency=1,
                             hyper_steps=2, optimizer=torch.optim.SGD, seed=3)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert messages[0].startswith("train_marglik(burn_in=..., frequency=..., hyper_steps=...) is deprecated: pass "
                                  "schedule=HyperparameterSchedule(burn_in=..., frequency=..., hyper_steps=...)")
    assert "pass optimization=MAPOptimization(optimizer=..., seed=...)" in messages[1]
    assert _same_weights(net, net_flat) and result.log_evidence == flat.log_evidence
    with pytest.raises(ValueError, match="burn_in"):  # the group's fields are checked, naming them
        train_marglik(net, x, y, lik, epochs=2, schedule=HyperparameterSchedule(burn_in=-1))
    with pytest.raises(TypeError, match="schedule must be a HyperparameterSchedule"):
        train_marglik(net, x, y, lik, epochs=2, schedule=MAPOptimization())


def test_train_fsvi_flat_keywords_equal_the_groups():
    x, y, net = _regression()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    settings = dict(epochs=2, batch_size=None, num_context=4, lr=1e-2, progress=False)
    grouped = train_fsvi(net, x, y, lik, options=FSVIOptions(init_std=0.05, kl_covariance="diagonal"),
                         optimization=FSVIOptimization(num_samples=2, seed=4), **settings)
    with pytest.warns(FutureWarning) as record:
        flat = train_fsvi(net, x, y, lik, init_std=0.05, kl_covariance="diagonal", num_samples=2, seed=4, **settings)
    assert sorted(str(w.message).split(" is deprecated: pass ")[1].split("(")[0] for w in record) == [
        "optimization=FSVIOptimization", "options=FSVIOptions"]
    assert flat.history[-1]["elbo"] == grouped.history[-1]["elbo"]
    assert flat.model.kl_covariance == grouped.model.kl_covariance == "diagonal"


def test_sfr_flat_keywords_equal_the_groups():
    x, y, net = _regression(n=30)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    grouped = SFR(net, x, y, lik, num_inducing=6, inducing=SFRInducingOptions(seed=2),
                  memory=SFRMemoryOptions(batch_size=7, chunk_size=5))
    with pytest.warns(FutureWarning) as record:
        flat = SFR(net, x, y, lik, num_inducing=6, seed=2, batch_size=7, chunk_size=5)
    assert sorted(str(w.message) for w in record)[1].startswith(
        "SFR(seed=...) is deprecated: pass inducing=SFRInducingOptions(seed=...)")
    assert torch.equal(flat.inducing_points, grouped.inducing_points)
    assert (flat.seed, flat.batch_size, flat.chunk_size) == (grouped.seed, grouped.batch_size, grouped.chunk_size) == (2, 7, 5)
    with pytest.raises(ValueError, match="seed"):  # validated as the attribute, naming the field
        SFR(net, x, y, lik, num_inducing=6, inducing=SFRInducingOptions(seed=1.5))


@pytest.mark.parametrize("cls", [KFACLaplace, LastLayerLaplace])
def test_posterior_flat_keywords_equal_pass_options(cls):
    x, y, net = _regression()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    grouped = cls(net, x, y, lik, options=PassOptions(batch_size=5, chunk_size=3, progress=False))
    with pytest.warns(FutureWarning, match="pass options=PassOptions"):
        flat = cls(net, x, y, lik, batch_size=5, chunk_size=3, progress=False)
    assert torch.equal(flat.log_marginal_likelihood(), grouped.log_marginal_likelihood())
    with pytest.raises(TypeError, match="options must be a PassOptions"):
        cls(net, x, y, lik, options={"batch_size": 5})
