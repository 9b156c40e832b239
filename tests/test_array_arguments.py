"""An array or a list where a tensor is expected is a ``TypeError`` naming the argument, at every entry point
(issue 38, item 5; docs/guarantees.md, "Errors"), before any side effect. Before, a numpy ``train_x`` given to
``SFR``, ``laplace_posterior``, ``compute_curvature``, ``sfr.update`` or ``train_marglik`` was taken for an iterable
of ``(x, y)`` batches and refused for the wrong reason ("train_y must be None when train_x is a DataLoader", "a
batch of ndarray was found").
"""

from __future__ import annotations

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.fsvi import FSVI, train_fsvi
from ntkgp.laplace import compute_curvature, laplace_posterior, predict
from ntkgp.training import compare_models, train_marglik
from tests.helpers import assert_unchanged, mlp, snapshot

F64 = torch.float64


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    x = torch.randn(10, 3, dtype=F64)
    y = torch.sin(x.sum(-1))
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    net = mlp(d_in=3, width=4)
    models = {
        "ntkgp": ntkgp.NTKGP(net, x, y, likelihood).eval(),
        "sfr": ntkgp.SFR(net, x, y, likelihood, num_inducing=4),
        "fsvi": FSVI(net, likelihood).eval(),
        "kernel": ntkgp.NTKKernel(net),
        "posterior": laplace_posterior(net, x, y, likelihood, structure="diag_ggn"),
    }
    return net, x, y, likelihood, models


def _as(kind, t):
    return t.numpy() if kind == "numpy" else t.tolist()


# (entry point, the argument given as an array, the name the error must carry, the call)
CALLS = {
    "NTKGP train_x": ("train_x", lambda s, a: ntkgp.NTKGP(s[0], a(s[1]), s[2], s[3])),
    "NTKGP train_y": ("train_y", lambda s, a: ntkgp.NTKGP(s[0], s[1], a(s[2]), s[3])),
    "NTKGP both": ("train_x", lambda s, a: ntkgp.NTKGP(s[0], a(s[1]), a(s[2]), s[3])),
    "model(X)": ("X", lambda s, a: s[4]["ntkgp"](a(s[1][:3]))),
    "model.posterior(X)": ("X", lambda s, a: s[4]["ntkgp"].posterior(a(s[1][:3]))),
    "condition_on x_new": ("x_new", lambda s, a: s[4]["ntkgp"].condition_on(a(s[1][:2]), s[2][:2])),
    "condition_on y_new": ("y_new", lambda s, a: s[4]["ntkgp"].condition_on(s[1][:2], a(s[2][:2]))),
    "kernel x1": ("x1", lambda s, a: s[4]["kernel"](a(s[1][:3]), s[1]).to_dense()),
    "kernel x2": ("x2", lambda s, a: s[4]["kernel"](s[1][:3], a(s[1])).to_dense()),
    "SFR train_x": ("train_x", lambda s, a: ntkgp.SFR(s[0], a(s[1]), s[2], s[3], num_inducing=3)),
    "SFR train_y": ("train_y", lambda s, a: ntkgp.SFR(s[0], s[1], a(s[2]), s[3], num_inducing=3)),
    "SFR both": ("train_x", lambda s, a: ntkgp.SFR(s[0], a(s[1]), a(s[2]), s[3], num_inducing=3)),
    "SFR train_x alone": ("train_x", lambda s, a: ntkgp.SFR(s[0], a(s[1]), None, s[3], num_inducing=3)),
    "SFR inducing_points": ("inducing_points", lambda s, a: ntkgp.SFR(s[0], s[1], s[2], s[3],
                                                                      inducing_points=a(s[1][:3]))),
    "sfr(x)": ("x", lambda s, a: s[4]["sfr"](a(s[1][:3]))),
    "sfr.update x_new": ("x_new", lambda s, a: s[4]["sfr"].update(a(s[1][:2]), s[2][:2])),
    "sfr.update y_new": ("y_new", lambda s, a: s[4]["sfr"].update(s[1][:2], a(s[2][:2]))),
    "sfr.update x_new alone": ("x_new", lambda s, a: s[4]["sfr"].update(a(s[1][:2]), None)),
    "train_fsvi train_x": ("train_x", lambda s, a: train_fsvi(mlp(d_in=3, width=4), a(s[1]), s[2], s[3], epochs=1,
                                                              progress=False)),
    "train_fsvi train_y": ("train_y", lambda s, a: train_fsvi(mlp(d_in=3, width=4), s[1], a(s[2]), s[3], epochs=1,
                                                              progress=False)),
    "train_fsvi train_x alone": ("train_x", lambda s, a: train_fsvi(mlp(d_in=3, width=4), a(s[1]), None, s[3],
                                                                    epochs=1, progress=False)),
    "fsvi(x)": ("x", lambda s, a: s[4]["fsvi"](a(s[1][:3]))),
    "fsvi.condition_on x_new": ("x_new", lambda s, a: s[4]["fsvi"].condition_on(a(s[1][:2]), s[2][:2])),
    "fsvi.condition_on y_new": ("y_new", lambda s, a: s[4]["fsvi"].condition_on(s[1][:2], a(s[2][:2]))),
    "laplace_posterior x": ("x", lambda s, a: laplace_posterior(s[0], a(s[1]), s[2], s[3])),
    "laplace_posterior y": ("y", lambda s, a: laplace_posterior(s[0], s[1], a(s[2]), s[3])),
    "laplace_posterior x alone": ("x", lambda s, a: laplace_posterior(s[0], a(s[1]), None, s[3])),
    "laplace_posterior full x": ("x", lambda s, a: laplace_posterior(s[0], a(s[1]), s[2], s[3], structure="full_ggn")),
    "compute_curvature x": ("x", lambda s, a: compute_curvature(s[0], a(s[1]), s[2], s[3])),
    "compute_curvature full x": ("x", lambda s, a: compute_curvature(s[0], a(s[1]), s[2], s[3], structure="full_ggn")),
    "predict x": ("x", lambda s, a: predict(s[4]["posterior"], a(s[1][:3]))),
    "train_marglik train_x": ("train_x", lambda s, a: train_marglik(s[0], a(s[1]), s[2], s[3], epochs=1,
                                                                    progress=False)),
    "train_marglik train_y": ("train_y", lambda s, a: train_marglik(s[0], s[1], a(s[2]), s[3], epochs=1,
                                                                    progress=False)),
    "train_marglik train_x alone": ("train_x", lambda s, a: train_marglik(s[0], a(s[1]), None, s[3], epochs=1,
                                                                          progress=False)),
    "compare_models": ("models", lambda s, a: compare_models(a(torch.zeros(2)))),
}


@pytest.mark.parametrize("kind", ["numpy", "list"])
@pytest.mark.parametrize("entry", list(CALLS))
def test_an_array_where_a_tensor_is_expected_is_a_type_error_naming_the_argument(setup, entry, kind):
    net, x, y, likelihood, models = setup
    name, call = CALLS[entry]
    before = snapshot(net)
    sfr_before = models["sfr"].state_dict()
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        call(setup, lambda t: _as(kind, t))
    assert_unchanged(net, before)
    for key, value in models["sfr"].state_dict().items():  # a refused update leaves the model as it was
        assert torch.equal(value, sfr_before[key]), key


def test_a_list_of_array_batches_is_refused_by_name():
    """An iterable of ``(x, y)`` pairs whose entries are arrays: a ``TypeError`` naming the data, not a shape
    error from inside the first batch."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, dtype=F64), torch.randn(6, dtype=F64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    batches = [(x.numpy(), y.numpy())]
    net = mlp(d_in=3, width=4)
    for call, name in [(lambda: ntkgp.SFR(net, batches, None, likelihood, num_inducing=3), "train_x"),
                       (lambda: laplace_posterior(net, batches, None, likelihood), "x"),
                       (lambda: train_marglik(net, batches, None, likelihood, epochs=1, progress=False), "train_x")]:
        with pytest.raises(TypeError, match=rf"\b{name}\b"):
            call()


def test_tensor_batches_in_a_list_still_work():
    """The check refuses arrays, not loaders: a list of ``(x, y)`` tensor pairs is still an iterable of batches
    (the same posterior as the tensors themselves, to float64 rounding)."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, dtype=F64), torch.randn(6, dtype=F64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    net = mlp(d_in=3, width=4)
    from_tensors = laplace_posterior(net, x, y, likelihood, structure="diag_ggn")
    from_batches = laplace_posterior(net, [(x[:3], y[:3]), (x[3:], y[3:])], None, likelihood, structure="diag_ggn")
    torch.testing.assert_close(from_batches.dense_precision(), from_tensors.dense_precision(), rtol=1e-12, atol=0)
