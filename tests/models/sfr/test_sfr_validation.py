"""Every public entry of SFR validates its inputs before any side effect, with errors naming the argument."""

from __future__ import annotations

import dataclasses

import gpytorch
import pytest
import torch

from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR, SFRInducingOptions, SFRMemoryOptions
from tests.helpers import assert_unchanged, rel_err, snapshot
from tests.models.sfr.problems import DELTA, dense_moments, problem


@pytest.fixture(scope="module")
def gaussian():
    return problem("gaussian", 1, n=12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_inducing": 2.7}, "num_inducing must be a positive integer, got 2.7"),
        ({"num_inducing": 0}, "num_inducing must be a positive integer"),
        ({"num_inducing": True}, "num_inducing must be a positive integer"),
        ({"num_inducing": 3, "batch_size": 0}, "batch_size must be a positive integer"),
        ({"num_inducing": 3, "batch_size": 2.5}, "batch_size must be a positive integer"),
        ({"num_inducing": 3, "chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"num_inducing": 3, "pool_size": -1}, "pool_size must be a positive integer"),
        ({"num_inducing": 3, "seed": 1.5}, "seed must be an integer"),
        ({"num_inducing": 3, "prior_mean": "linear"}, "prior_mean must be one of"),
        ({"num_inducing": 3, "predictive_mean": "mc"}, "predictive_mean must be one of"),
        ({"num_inducing": 3, "inducing_method": "kmeans"}, "inducing_method must be one of"),
        ({"num_inducing": 3, "prior_structure": "block"}, "prior_structure must be one of"),
    ],
)
def test_constructor_arguments_are_validated(gaussian, kwargs, match):
    net, x, y, lik, _ = gaussian
    kwargs = dict(kwargs)
    for key, group in {"inducing": SFRInducingOptions, "memory": SFRMemoryOptions}.items():  # grouped options
        moved = {f.name: kwargs.pop(f.name) for f in dataclasses.fields(group) if f.name in kwargs}
        if moved:
            kwargs[key] = group(**moved)
    with pytest.raises(ValueError, match=match):
        SFR(net, x, y, lik, **kwargs)


@pytest.mark.parametrize(
    "bad,error,match",
    [
        (lambda x: x.to(torch.complex128), TypeError, "train_x must be a real tensor"),
        # integer inputs are passed as they are (token ids): a float network does not take them, named
        (lambda x: x.long(), ValueError, r"train_x of .*int64 does not fit the network.*\.to\("),
        (lambda x: x[:, 0], ValueError, r"train_x must have shape \(N, ...\)"),
        (lambda x: torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1), ValueError, "train_x .* does not fit the network"),
        (lambda x: x.index_put((torch.tensor([5]), torch.tensor([1])), torch.tensor(float("inf"), dtype=x.dtype)), ValueError, "row 5"),
    ],
)
def test_bad_training_inputs_name_the_argument(gaussian, bad, error, match):
    net, x, y, lik, _ = gaussian
    with pytest.raises(error, match=match):
        SFR(net, bad(x), y, lik, num_inducing=3)


def test_inducing_points_are_checked_like_inputs(gaussian):
    net, x, y, lik, _ = gaussian
    with pytest.raises(TypeError, match="inducing_points must be a real tensor"):
        SFR(net, x, y, lik, inducing_points=x[:3].to(torch.complex128))
    with pytest.raises(ValueError, match="inducing_points of .*int32 does not fit the network"):
        SFR(net, x, y, lik, inducing_points=x[:3].int())
    bad = x[:3].clone()
    bad[2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"inducing_points contains NaN or Inf values \(first in row 2\)"):
        SFR(net, x, y, lik, inducing_points=bad)


@pytest.mark.parametrize(
    "bad,error,match",
    [
        (lambda x: x.to(torch.complex128), TypeError, "x must be a real tensor"),
        (lambda x: x.long(), ValueError, "x of .*int64 does not fit the network"),
        (lambda x: x[:, :2], ValueError, r"x must have shape \(..., n, 3\)"),
        (lambda x: x[0], ValueError, r"x must have shape \(..., n, 3\)"),
        (lambda x: torch.where(torch.arange(len(x))[:, None] == 4, float("nan"), x), ValueError, "row 4"),
    ],
)
def test_prediction_inputs_are_validated(gaussian, bad, error, match):
    net, x, y, lik, xs = gaussian
    sfr = SFR(net, x, y, lik, num_inducing=3)
    with pytest.raises(error, match=match):
        sfr(bad(xs))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        sfr(xs, chunk_size=0)


def test_update_validates_everything_before_changing_the_model(gaussian):
    net, x, y, lik, xs = gaussian
    sfr = SFR(net, x, y, lik, num_inducing=3)
    before = dense_moments(sfr(xs))
    precision = sfr.dual_statistics.precision.clone()
    batches = [(x[:4], y[:4]), (x[4:8].long(), y[4:8])]  # the second batch is bad
    for args, error, match in [
        ((x[:4], y[:3]), ValueError, "same number of rows"),
        ((x[:4, :2], y[:4]), ValueError, "x_new must have shape"),
        ((x[:4].long(), y[:4]), ValueError, "x_new of .*int64 does not fit the network"),
        ((x[:4], None), ValueError, "y_new is required"),
        ((batches, None), ValueError, "x_new of .*int64 does not fit the network"),
    ]:
        with pytest.raises(error, match=match):
            sfr.update(*args)
    assert torch.equal(sfr.dual_statistics.precision, precision) and sfr.num_data == 12
    after = dense_moments(sfr(xs))
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_failed_calls_leave_network_and_tensors_untouched(gaussian):
    net, x, y, lik, xs = gaussian
    before, copies = snapshot(net), [t.clone() for t in (x, y, xs)]
    with pytest.raises(ValueError):
        SFR(net, x, y, lik, num_inducing=2.7)
    sfr = SFR(net, x, y, lik, num_inducing=3)
    with pytest.raises(ValueError):
        sfr(xs[:, :1])
    assert_unchanged(net, before)
    assert all(torch.equal(a, b) for a, b in zip((x, y, xs), copies))


def test_unknown_keywords_are_refused(gaussian):
    net, x, y, lik, _ = gaussian
    for name in ("groups", "inducing"):  # groups= was prior_structure's old name: no aliases in 0.1.0
        # inducing= is now the group of the inducing-input options: a string there is refused, naming it
        with pytest.raises(TypeError, match="unexpected keyword" if name == "groups" else "inducing must be a"):
            SFR(net, x, y, lik, num_inducing=3, **{name: "layer"})
    assert not hasattr(SFR, "sparse_evidence")


def test_network_and_inputs_are_never_modified():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    before, copies = snapshot(net), [t.clone() for t in (x, y, xs)]
    z = x[:5].clone()
    z_copy = z.clone()
    sfr = SFR(net, x, y, lik, inducing_points=z)
    sfr.update(x[:4], y[:4])
    assert torch.isfinite(sfr(xs).covariance_matrix).all()
    sfr.train()
    sfr.log_marginal_likelihood().backward()
    assert_unchanged(net, before)
    assert all(torch.equal(a, b) for a, b in zip((x, y, xs), copies)) and torch.equal(z, z_copy)
    assert not any(p is q for p in sfr.parameters() for q in net.parameters())


def test_bad_inputs_raise_clear_errors():
    net, x, y, lik, _ = problem("gaussian", 1, n=12)
    with pytest.raises(ValueError, match="same number of rows"):
        SFR(net, x, y[:-1], lik, num_inducing=3)
    bad = x.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        SFR(net, bad, y, lik, num_inducing=3)
    bad_y = y.clone()
    bad_y[0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        SFR(net, x, bad_y, lik, num_inducing=3)
    with pytest.raises(ValueError, match="num_inducing > N"):
        SFR(net, x, y, lik, num_inducing=13)
    with pytest.raises(ValueError, match="inducing_points must have shape"):
        SFR(net, x, y, lik, inducing_points=torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="exactly one"):
        SFR(net, x, y, lik)
    with pytest.raises(NotImplementedError, match="does not support"):
        SFR(net, x, y, gpytorch.likelihoods.BernoulliLikelihood(), num_inducing=3)
    with pytest.raises(ValueError, match="outputs"):
        SFR(net, x, y, SoftmaxLikelihood(3), num_inducing=3)
    with pytest.raises(ValueError, match="output_coupling"):
        SFR(net, x, y, lik, num_inducing=3, output_coupling="diagonal")
    sfr = SFR(net, x, y, lik, num_inducing=3)
    with pytest.raises(ValueError, match="same number of rows"):
        sfr.update(x[:4], y[:3])
    before = sfr.dual_statistics.precision.clone()
    with pytest.raises(ValueError, match="NaN"):
        sfr.update(bad, y)
    assert torch.equal(sfr.dual_statistics.precision, before) and sfr.num_data == 12
