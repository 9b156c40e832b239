"""Property-based tests of NTKGP (Gaussian, logistic, softmax), its posterior and condition_on, and SFR and
its update (see tests/fuzz/common.py for the property)."""

from __future__ import annotations

import gpytorch
import torch
from hypothesis import given
from hypothesis import strategies as st

import ntkgp
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from tests.fuzz.common import (
    ACCEPTED_INPUT_CORRUPTIONS,
    ACCEPTED_LABEL_CORRUPTIONS,
    INPUT_CORRUPTIONS,
    LABEL_CORRUPTIONS,
    check_call,
    corrupt_inputs,
    corrupt_labels,
    dtypes,
    fuzz_settings,
    inputs,
    labels,
    make_network,
    networks,
)

SETTINGS = fuzz_settings(20)


def likelihood(kind: str, outputs: int, dtype: torch.dtype):
    if kind == "gaussian":
        if outputs == 1:
            lik = gpytorch.likelihoods.GaussianLikelihood()
        else:
            lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=outputs, rank=0)
    elif kind == "logistic":
        lik = LogisticLikelihood()
    else:
        lik = SoftmaxLikelihood(num_classes=outputs)
    return lik.to(dtype)


@st.composite
def problems(draw):
    """A network, a likelihood, training data, and at most one corrupted argument of the constructor."""
    lik_kind = draw(st.sampled_from(["gaussian", "logistic", "softmax"]))
    outputs = {"gaussian": draw(st.integers(1, 2)), "logistic": 1, "softmax": draw(st.integers(2, 3))}[
        lik_kind
    ]
    dtype = draw(dtypes)
    network = make_network(draw(networks), outputs, dtype, seed=draw(st.integers(0, 3)))
    n = draw(st.integers(2, 6))
    x, y = inputs(network, n, dtype, 5), labels(lik_kind, n, outputs, dtype, 6)
    corruption = draw(
        st.sampled_from([None, None, "train_x", "train_y", "net_mode", "prior_precision", "outputs"])
    )
    detail, names, accepted = None, [], False
    lik = likelihood(lik_kind, outputs, dtype)
    kwargs = {}
    if corruption == "train_x":
        detail = draw(st.sampled_from(INPUT_CORRUPTIONS))
        x = corrupt_inputs(x, detail, draw(st.integers(0, 5)))
        names, accepted = ["train_x"], detail in ACCEPTED_INPUT_CORRUPTIONS
    elif corruption == "train_y":
        detail = draw(st.sampled_from(LABEL_CORRUPTIONS))
        y = corrupt_labels(y, detail, lik_kind, outputs, draw(st.integers(0, 5)))
        names, accepted = ["train_y"], detail in ACCEPTED_LABEL_CORRUPTIONS
    elif corruption == "net_mode":
        if network.kind == "batchnorm":
            network.net.train()
            names = ["net"]
        else:
            corruption = None
    elif corruption == "prior_precision":
        kwargs["prior_precision"] = draw(st.sampled_from([0.0, -2.0, float("nan"), float("inf"), "1"]))
        names = ["prior_precision"]
    elif corruption == "outputs":  # a likelihood that does not match the network's outputs
        lik = (
            likelihood("softmax", outputs + 1, dtype)
            if lik_kind != "logistic"
            else likelihood("softmax", 3, dtype)
        )
        names = ["outputs", "expects"]
    return {
        "network": network,
        "x": x,
        "y": y,
        "lik": lik,
        "lik_kind": lik_kind,
        "kwargs": kwargs,
        "corruption": corruption,
        "names": names,
        "accepted": accepted,
        "dtype": dtype,
    }


@SETTINGS
@given(problem=problems(), data=st.data())
def test_ntkgp(problem, data):
    network, dtype = problem["network"], problem["dtype"]
    model = check_call(
        lambda: ntkgp.NTKGP(network.net, problem["x"], problem["y"], problem["lik"], **problem["kwargs"]),
        network.net,
        [problem["x"], problem["y"]],
        problem["corruption"],
        problem["names"],
        problem["accepted"],
    )
    if model is None:
        return
    model.eval()
    # the posterior at test inputs, possibly corrupted
    x_test = inputs(network, data.draw(st.integers(1, 4)), dtype, 7)
    corruption = data.draw(st.sampled_from([None, *INPUT_CORRUPTIONS]))
    if corruption is not None:
        x_test = corrupt_inputs(x_test, corruption, data.draw(st.integers(0, 3)))
    accepted = (
        corruption in ACCEPTED_INPUT_CORRUPTIONS or corruption == "empty"
    )  # no test point: an empty posterior
    check_call(lambda: model(x_test), network.net, [x_test], corruption, ["X", "x"], accepted)
    # condition_on with new data, possibly corrupted
    m = data.draw(st.integers(1, 3))
    x_new = inputs(network, m, dtype, 8)
    y_new = labels(problem["lik_kind"], m, network.outputs, dtype, 9)
    target = data.draw(st.sampled_from([None, "x_new", "y_new", "iterate"]))
    iterate = data.draw(st.sampled_from([None, True, False]))
    detail, accepted = None, False
    if target == "x_new":
        detail = data.draw(st.sampled_from(INPUT_CORRUPTIONS))
        x_new, accepted = corrupt_inputs(x_new, detail, 0), detail in ACCEPTED_INPUT_CORRUPTIONS
    elif target == "y_new":
        detail = data.draw(st.sampled_from(LABEL_CORRUPTIONS))
        y_new = corrupt_labels(y_new, detail, problem["lik_kind"], network.outputs, 0)
        accepted = detail in ACCEPTED_LABEL_CORRUPTIONS
    elif target == "iterate":
        iterate = data.draw(st.sampled_from(["yes", 1, 0.5]))

    def condition():
        new = model.condition_on(x_new, y_new, iterate=iterate)
        return new(inputs(network, 2, dtype, 10))

    check_call(condition, network.net, [x_new, y_new], target, [target or ""], accepted)


@SETTINGS
@given(problem=problems(), data=st.data())
def test_sfr(problem, data):
    network, dtype = problem["network"], problem["dtype"]
    n = problem["x"].shape[0] if torch.is_tensor(problem["x"]) and problem["x"].dim() > 0 else 2
    choice = data.draw(
        st.sampled_from([None, "num_inducing", "inducing_points", "batch_size", "output_coupling"])
    )
    kwargs = {"num_inducing": max(1, min(n, 3))}
    corruption, names = problem["corruption"], problem["names"]
    if corruption == "outputs":
        names = ["outputs", "expects"]
    if corruption is None and choice is not None:
        corruption, names = choice, [choice]
        if choice == "num_inducing":
            kwargs["num_inducing"] = data.draw(st.sampled_from([0, 2.7, "3", -1]))
        elif choice == "inducing_points":
            z = corrupt_inputs(
                inputs(network, 2, dtype, 11), data.draw(st.sampled_from(["nan", "integer", "features"])), 0
            )
            kwargs = {"inducing_points": z}
        elif choice == "batch_size":
            kwargs["batch_size"] = data.draw(st.sampled_from([0, 1.5, -3]))
        else:
            kwargs["output_coupling"] = "diagonal"
    kwargs.update(problem["kwargs"])
    sfr = check_call(
        lambda: ntkgp.SFR(network.net, problem["x"], problem["y"], problem["lik"], **kwargs),
        network.net,
        [problem["x"], problem["y"], *kwargs.values()],
        corruption,
        names,
        problem["accepted"],
    )
    if sfr is None:
        return
    x_test = inputs(network, data.draw(st.integers(1, 3)), dtype, 12)
    check_call(lambda: sfr(x_test), network.net, [x_test], None)
    m = data.draw(st.integers(1, 3))
    x_new = inputs(network, m, dtype, 13)
    y_new = labels(problem["lik_kind"], m, network.outputs, dtype, 14)
    target = data.draw(st.sampled_from([None, "x_new", "y_new"]))
    detail, accepted = None, False
    if target == "x_new":
        detail = data.draw(st.sampled_from([k for k in INPUT_CORRUPTIONS if k != "list"]))
        x_new, accepted = corrupt_inputs(x_new, detail, 0), detail in ACCEPTED_INPUT_CORRUPTIONS
    elif target == "y_new":
        detail = data.draw(st.sampled_from(LABEL_CORRUPTIONS))
        y_new = corrupt_labels(y_new, detail, problem["lik_kind"], network.outputs, 0)
        accepted = detail in ACCEPTED_LABEL_CORRUPTIONS
    before = sfr.num_data

    def update():
        sfr.update(x_new, y_new, iterate=data.draw(st.sampled_from([None, True, False])))
        return sfr(x_test)

    result = check_call(update, network.net, [x_new, y_new], target, [target or ""], accepted)
    if result is None:
        assert sfr.num_data == before  # a rejected update leaves the model unchanged
