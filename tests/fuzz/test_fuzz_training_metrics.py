"""Property-based tests of train_marglik (2 epochs), compute_curvature and the metrics (see tests/fuzz/common.py).

Every network kind is drawn with every structure (BatchNorm in eval mode and KFAC on the CNN included). A call
that succeeds is checked against the brute-force Laplace evidence of tests/fuzz/reference.py at the weights and
hyperparameters it returns (full and diagonal GGN / empirical Fisher: equal; KFAC, whose factors the reference
does not rebuild: at most the brute-force log joint, as for any positive semi-definite curvature)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from ntkgp import metrics
from ntkgp.laplace.weight_space import compute_curvature
from ntkgp.training import train_marglik
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
from tests.fuzz import reference
from tests.fuzz.test_fuzz_models import likelihood

BAD_ARGUMENTS = {
    "epochs": [0, 1.5, -1],
    "batch_size": [0, 2.5, -2],
    "hyper_lr": [0.0, -1.0, float("nan"), float("inf")],
    "lr": [0.0, float("nan")],
    "structure": ["ggn", "kfc", 3],
    "prior_precision": [0.0, -1.0, float("nan")],
    "frequency": [0, 0.5],
    "hyper_steps": [-1, 1.5],
}


@st.composite
def training_problem(draw, structures):
    lik_kind = draw(st.sampled_from(["gaussian", "logistic", "softmax"]))
    outputs = {"gaussian": 1, "logistic": 1, "softmax": 2}[lik_kind]
    dtype = draw(dtypes)
    kind = draw(networks)
    network = make_network(kind, outputs, dtype, seed=draw(st.integers(0, 2)))
    n = draw(st.integers(3, 6))
    x, y = inputs(network, n, dtype, 20), labels(lik_kind, n, outputs, dtype, 21)
    structure = draw(st.sampled_from(structures))
    corruption = draw(st.sampled_from([None, None, "train_x", "train_y", *BAD_ARGUMENTS]))
    kwargs, names, accepted, detail = {}, [], False, None
    if corruption == "train_x":
        detail = draw(st.sampled_from([k for k in INPUT_CORRUPTIONS if k != "empty"]))
        x, accepted = corrupt_inputs(x, detail, draw(st.integers(0, 5))), detail in ACCEPTED_INPUT_CORRUPTIONS
        names = ["train_x", "x"]
    elif corruption == "train_y":
        detail = draw(st.sampled_from(LABEL_CORRUPTIONS))
        y = corrupt_labels(y, detail, lik_kind, outputs, draw(st.integers(0, 5)))
        accepted, names = detail in ACCEPTED_LABEL_CORRUPTIONS, ["train_y", "y"]
    elif corruption is not None:
        kwargs[corruption] = draw(st.sampled_from(BAD_ARGUMENTS[corruption]))
        names = [corruption]
    return network, x, y, likelihood(lik_kind, outputs, dtype), structure, kwargs, corruption, names, accepted


@fuzz_settings(12)
@given(problem=training_problem(["full_ggn", "full_ef", "kfac", "diag_ggn", "diag_ef"]))
def test_train_marglik(problem):
    network, x, y, lik, structure, kwargs, corruption, names, accepted = problem
    options = {
        "structure": structure,
        "epochs": 2,
        "burn_in": 0,
        "frequency": 1,
        "hyper_steps": 2,
        "progress": False,
    }
    if structure != "kfac":
        options["prior_structure"] = "network"
    options.update(kwargs)
    result = check_call(
        lambda: train_marglik(network.net, x, y, lik, **options),
        network.net,
        [x, y],
        corruption,
        names,
        accepted,
        trains=True,
    )
    if result is None:  # a corrupted call, refused as check_call requires
        return
    structure = options["structure"]
    prior_structure = options.get("prior_structure", "layer")
    for p in network.net.parameters():
        assert bool(torch.isfinite(p).all())
    delta = result.prior_precision
    assert bool(torch.isfinite(delta).all() and (delta > 0).all())
    assert math.isfinite(result.log_evidence) and result.best_epoch in (1, 2)
    _check_evidence(network, x, y, result.likelihood, structure, prior_structure, delta, result.log_evidence * len(y))


def _check_evidence(network, x, y, lik, structure, prior_structure, delta, value):
    """``value`` (a total log evidence at the network's weights) against the brute-force Laplace evidence of
    tests/fuzz/reference.py (full and diagonal structures), or below the brute-force log joint (KFAC: its
    curvature is positive semi-definite, so its Occam factor is at most 1)."""
    x = torch.as_tensor(x)
    tolerance = (1e-3 if next(network.net.parameters()).dtype == torch.float32 else 1e-7) * (1 + abs(value))
    if structure == "kfac":
        assert value <= reference.log_joint(network.net, x, y, lik, prior_structure, delta) + tolerance
    else:
        expected = reference.laplace_evidence(network.net, x, y, lik, structure, prior_structure, delta)
        assert abs(value - expected) <= tolerance, (value, expected)


@fuzz_settings(15)
@given(
    problem=training_problem(["kfac", "diag_ggn", "diag_ef"]),
    delta=st.sampled_from([1.0, 0.0, float("nan"), "2", True]),
)
def test_compute_curvature(problem, delta):
    network, x, y, lik, structure, kwargs, corruption, names, accepted = problem
    if corruption not in (None, "train_x", "train_y", "structure"):
        corruption, names = None, []
    if corruption == "structure":
        structure = kwargs.pop("structure")
        names = ["structure"]
    prior_structure = "layer"
    curvature = check_call(
        lambda: compute_curvature(
            network.net,
            x,
            y,
            lik,
            structure,
            prior_structure=prior_structure,
            batch_size=2,
            input_shape=network.input_shape,
        ),
        network.net,
        [x, y],
        corruption,
        [*names, "x", "y"],
        accepted,
    )
    if curvature is None:  # a corrupted call, refused as check_call requires
        return
    bad = None if delta == 1.0 and delta is not True else "prior_precision"
    check_call(lambda: curvature.log_marginal_likelihood(delta, lik), network.net, [], bad, ["prior_precision"])
    # whatever delta was drawn, the curvature's evidence at δ = 1 against the brute-force one
    value = check_call(lambda: curvature.log_marginal_likelihood(1.0, lik).detach(), network.net, [], None)
    groups = len(set(reference.group_labels(network.net, prior_structure)[1]))
    _check_evidence(network, x, y, lik, structure, prior_structure, torch.ones(groups), float(value))


METRIC_CORRUPTIONS = [
    None,
    "nan",
    "shape",
    "negative_var",
    "labels_out",
    "labels_fraction",
    "empty",
    "integer",
    "list",
]


@fuzz_settings(40)
@given(data=st.data())
def test_metrics(data):
    n, c = data.draw(st.integers(1, 5)), data.draw(st.integers(2, 4))
    dtype = data.draw(dtypes)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 9)))
    probs = torch.softmax(torch.randn(n, c, generator=g), -1).to(dtype)
    y_cls = torch.randint(0, c, (n,), generator=g)
    mean, var, y_reg = (
        torch.randn(n, generator=g).to(dtype),
        torch.rand(n, generator=g).to(dtype) + 0.1,
        torch.randn(n).to(dtype),
    )
    corruption = data.draw(st.sampled_from(METRIC_CORRUPTIONS))
    name = None
    if corruption == "nan":
        name = data.draw(st.sampled_from(["probs", "mean", "var", "y"]))
        target = {"probs": probs, "mean": mean, "var": var, "y": y_reg}[name].clone()
        target.reshape(-1)[0] = float("nan")
        probs, mean, var, y_reg = [
            target if k == name else v
            for k, v in (("probs", probs), ("mean", mean), ("var", var), ("y", y_reg))
        ]
    elif corruption == "shape":
        name, y_cls, y_reg = "y", torch.cat([y_cls, y_cls]), torch.cat([y_reg, y_reg])
    elif corruption == "negative_var":
        name, var = "var", -var
    elif corruption == "labels_out":
        name, y_cls = "y", y_cls.clone().fill_(c)
    elif corruption == "labels_fraction":
        name, y_cls = "y", y_cls.to(dtype) + 0.5
    elif corruption == "empty":
        name, probs, y_cls, mean, var, y_reg = "all", probs[:0], y_cls[:0], mean[:0], var[:0], y_reg[:0]
    metric = data.draw(
        st.sampled_from(
            [
                "gaussian_nlpd",
                "rmse",
                "categorical_nlpd",
                "accuracy",
                "expected_calibration_error",
                "brier_score",
                "predictive_entropy",
            ]
        )
    )
    regression = metric in ("gaussian_nlpd", "rmse")
    if corruption == "integer":
        name, probs, mean = ("mean" if regression else "probs"), (probs > 0.5).long(), mean.long()
    elif corruption == "list":
        name, probs, mean = ("mean" if regression else "probs"), probs.tolist(), mean.tolist()
    calls = {
        "gaussian_nlpd": lambda: metrics.gaussian_nlpd(mean, var, y_reg),
        "rmse": lambda: metrics.rmse(mean, y_reg),
        "categorical_nlpd": lambda: metrics.categorical_nlpd(probs, y_cls),
        "accuracy": lambda: metrics.accuracy(probs, y_cls),
        "expected_calibration_error": lambda: metrics.expected_calibration_error(probs, y_cls),
        "brier_score": lambda: metrics.brier_score(probs, y_cls),
        "predictive_entropy": lambda: metrics.predictive_entropy(probs),
    }
    uses = {
        "gaussian_nlpd": {"mean", "var", "y"},
        "rmse": {"mean", "y"},
        "predictive_entropy": {"probs"},
    }.get(metric, {"probs", "y"})
    if (
        name is not None
        and name != "all"
        and name not in uses
        or (corruption in ("labels_out", "labels_fraction") and regression)
        or (
            corruption == "nan" and name == "y" and not regression
        )  # the NaN went into the regression targets
    ):
        corruption = None  # the corrupted argument is not one this metric takes
    names = {"probs": ["probs"], "mean": ["mean", "pred"], "var": ["var"], "y": ["y"]}.get(name, [])
    if corruption == "empty":
        names = ["mean", "pred", "y", "var", "probs"]
    args = [probs, mean, var, y_reg, y_cls]
    accepted = corruption == "integer" and regression  # integer predictions are numbers too
    net = torch.nn.Linear(1, 1)
    check_call(calls[metric], net, args, corruption, names, accepted)
