"""Refusals that must come before any side effect (issue 25, third round), each against a freshly built model.

* ``load_state_dict`` of a state that does not fit (another prior structure, another number of inducing points,
  a missing key, a value that is not a tensor): torch copies every tensor that fits and only then raises, which
  left ``NTKGP`` with the other model's noise (mean off by 0.7) and ``SFR`` with the other model's statistics.
  The refusal now comes first and the model predicts exactly as a fresh one;
* tensors and networks on the ``meta`` device reached torch's ``Tensor.item() cannot be called on meta tensors``;
* numpy integers as counts (``prediction_chunk_size=np.int64(3)``, ``chunk_size``, ``cache_size``) were refused.
"""

from __future__ import annotations

import copy

import gpytorch
import numpy as np
import pytest
import torch

import ntkgp
from tests.helpers import assert_unchanged, mlp, snapshot

D64 = torch.float64


def regression(n=20, d=3, seed=0, noise=0.01):
    torch.manual_seed(seed)
    x = torch.randn(n, d, dtype=D64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = noise
    return x, torch.sin(x.sum(-1)), likelihood


def moments(model, x):
    with torch.no_grad():
        pred = model(x)
        return pred.mean.clone(), pred.variance.clone()


def assert_equal_moments(a, b):
    for u, v in zip(a, b):
        assert torch.equal(u, v)


# ---------------------------------------------------------------------------------------------- load_state_dict
def _ntkgp_pair():
    x, y, likelihood = regression()
    net = mlp()
    other = ntkgp.NTKGP(net, x, y, regression(noise=0.5)[2], prior_structure="parameter", prior_precision=5.0)
    return net, x, y, ntkgp.NTKGP(net, x, y, likelihood).eval(), other


def _sfr_pair():
    x, y, likelihood = regression()
    net = mlp()
    other = ntkgp.SFR(net, x, y, regression(noise=0.5)[2], num_inducing=5, prior_precision=3.0)
    return net, x, y, ntkgp.SFR(net, x, y, likelihood, num_inducing=10).eval(), other


def _fresh(kind, net, x, y):
    likelihood = regression()[2]
    if kind == "NTKGP":
        return ntkgp.NTKGP(net, x, y, likelihood).eval()
    return ntkgp.SFR(net, x, y, likelihood, num_inducing=10).eval()


def _corrupt(model, other, how):
    if how == "other model":
        return other.state_dict()
    state = model.state_dict()
    if how == "missing key":
        key = next(k for k in state if "prior_precision" in k)
        state = {k: (v * 3.0 if "noise" in k else v) for k, v in state.items() if k != key}
    else:  # a value that is not a tensor, after one that would be copied
        state = {k: (v * 3.0 if "noise" in k else v) for k, v in state.items()}
        key = next(k for k in state if "prior_precision" in k and "constraint" not in k)
        state[key] = 2.0
    return state


@pytest.mark.parametrize("how", ["other model", "missing key", "not a tensor"])
@pytest.mark.parametrize("kind", ["NTKGP", "SFR"])
def test_a_refused_load_leaves_the_model_as_a_fresh_one(kind, how):
    net, x, y, model, other = _ntkgp_pair() if kind == "NTKGP" else _sfr_pair()
    x_test = torch.randn(6, 3, dtype=D64)
    moments(model, x_test)  # used before: caches filled
    state = _corrupt(model, other, how)
    before = {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}
    with pytest.raises(RuntimeError, match=r"nothing was loaded.*\n\t.*(prior_precision|inducing_points)"):
        model.load_state_dict(state)
    for k, v in before.items():  # the state given is not written either
        assert torch.equal(state[k], v)
    assert_equal_moments(moments(model, x_test), moments(_fresh(kind, net, x, y), x_test))


@pytest.mark.parametrize("kind", ["NTKGP", "SFR"])
def test_a_fitting_load_still_loads_and_strict_false_allows_missing_keys(kind):
    net, x, y, model, _ = _ntkgp_pair() if kind == "NTKGP" else _sfr_pair()
    x_test = torch.randn(6, 3, dtype=D64)
    likelihood = regression(noise=0.2)[2]
    if kind == "NTKGP":
        source = ntkgp.NTKGP(net, x, y, likelihood, prior_precision=4.0).eval()
    else:
        source = ntkgp.SFR(net, x, y, likelihood, num_inducing=10, prior_precision=4.0).eval()
    model.load_state_dict(source.state_dict())
    assert_equal_moments(moments(model, x_test), moments(source, x_test))
    state = {k: v for k, v in source.state_dict().items() if "noise" not in k}
    model.load_state_dict(state, strict=False)
    assert_equal_moments(moments(model, x_test), moments(source, x_test))


# ---------------------------------------------------------------------------------------------- the meta device
def _meta_calls():
    x, y, likelihood = regression()
    net = mlp()
    model = ntkgp.NTKGP(net, x, y, likelihood).eval()
    sfr = ntkgp.SFR(net, x, y, likelihood, num_inducing=5).eval()
    meta = x.to("meta")
    posterior = ntkgp.laplace.laplace_posterior(net, x, y, likelihood, structure="diag_ggn")
    return net, likelihood, {
        "X": lambda: model(meta),
        "train_x": lambda: ntkgp.NTKGP(net, meta, y, likelihood),
        "train_y": lambda: ntkgp.SFR(net, x, y.to("meta"), likelihood, num_inducing=5),
        "inducing_points": lambda: ntkgp.SFR(net, x, y, likelihood, inducing_points=meta[:3]),
        "x_new": lambda: sfr.update(meta[:2], y[:2]),
        "y_new": lambda: model.condition_on(x[:2], y[:2].to("meta")),
        "x1": lambda: ntkgp.NTKKernel(net)(meta, x).to_dense(),
        "x": lambda: ntkgp.laplace.predict(posterior, meta),
        "net": lambda: ntkgp.NTKGP(copy.deepcopy(net).to("meta"), x, y, likelihood),
    }


@pytest.mark.parametrize("argument", list(_meta_calls()[2]))
def test_meta_tensors_and_networks_are_refused_naming_the_argument(argument):
    net, likelihood, calls = _meta_calls()
    state = snapshot(net)
    with pytest.raises(ValueError, match=rf"^{argument} .*meta device"):
        calls[argument]()
    assert_unchanged(net, state)


# ---------------------------------------------------------------------------------------------- numpy integers
@pytest.mark.parametrize("option", ["prediction_chunk_size", "chunk_size", "cache_size"])
def test_numpy_integers_are_counts_and_numpy_bools_are_not(option):
    x, y, likelihood = regression()
    net = mlp()
    x_test = torch.randn(7, 3, dtype=D64)
    model = ntkgp.NTKGP(net, x, y, likelihood, **{option: np.int64(3)}).eval()
    assert type(getattr(model, option)) is int and getattr(model, option) == 3
    reference = ntkgp.NTKGP(net, x, y, likelihood, **{option: 3}).eval()
    m, v = moments(model, x_test)
    m_ref, v_ref = moments(reference, x_test)
    torch.testing.assert_close(m, m_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(v, v_ref, rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match=option):
        ntkgp.NTKGP(net, x, y, likelihood, **{option: np.bool_(True)})


# ---------------------------------------------------------------------------------------------- the likelihood's mode
@pytest.mark.parametrize("mode", [True, False])
def test_building_and_updating_an_sfr_keeps_the_likelihoods_mode(mode):
    """SFR starts in eval mode; its ``self.eval()`` switched the user's likelihood (a submodule) with it."""
    x, y, likelihood = regression()
    likelihood.train(mode)
    sfr = ntkgp.SFR(mlp(), x, y, likelihood, num_inducing=5)
    sfr.update(x[:3], y[:3])
    assert not sfr.training
    assert [m.training for m in likelihood.modules()] == [mode] * len(list(likelihood.modules()))
