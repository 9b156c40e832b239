"""Audit cases of ``ntkgp.datasets`` and ``ntkgp.metrics``: argument checks, and every metric value against a
brute-force computation (loops, ``torch.distributions``, scikit-learn where it is the definition)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from ntkgp import metrics
from ntkgp.datasets import gap_regression, load_csv, two_moons

from .framework import CLEAR, HELD, Refused, SilentWrong, attempt, case, close, refusal, untouched

AREA = "data"
F64 = torch.float64


def _accepted(fn, what: str):
    """A valid call: any exception (a refusal included) is a RAW-ERROR naming ``what``."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001
        raise RuntimeError(f"{what} refused: {type(error).__name__}: {str(error)[:150]}") from error


@case("data-01", AREA, "gap_regression(noise_std='0.1') (a string)")
def string_noise_std():
    return refusal(lambda: gap_regression(noise_std="0.1"), names=("noise_std",))


@case("data-02", AREA, "gap_regression(seed=1.5)")
def fractional_seed_gap():
    return refusal(lambda: gap_regression(seed=1.5), names=("seed",))


@case("data-03", AREA, "two_moons(seed=-1)")
def negative_seed_moons():
    return refusal(lambda: two_moons(seed=-1), names=("seed",))


@case("data-04", AREA, "two_moons(noise=None)")
def none_noise():
    return refusal(lambda: two_moons(noise=None), names=("noise",))


@case("data-05", AREA, "two_moons(n=np.int64(10)) (a numpy integer) against n=10")
def numpy_integer_n():
    x, y = _accepted(lambda: two_moons(n=np.int64(10), seed=3), "a numpy integer n")
    x_ref, y_ref = two_moons(n=10, seed=3)
    close(x, x_ref, 0.0, what="x")
    close(y, y_ref, 0.0, what="y")
    return HELD, "the same data"


@case("data-06", AREA, "gaussian_nlpd(y_scale='2') (a string)")
def string_y_scale():
    return refusal(lambda: metrics.gaussian_nlpd(torch.zeros(3), torch.ones(3), torch.zeros(3), y_scale="2"),
                   names=("y_scale",))


@case("data-07", AREA, "gaussian_nlpd with (C,) y_scale against torch.distributions in original units")
def nlpd_in_original_units():
    g = torch.Generator().manual_seed(0)
    mean, y = torch.randn(6, 2, generator=g, dtype=F64), torch.randn(6, 2, generator=g, dtype=F64)
    var = torch.rand(6, 2, generator=g, dtype=F64) + 0.1
    scale, shift = torch.tensor([3.0, 0.5], dtype=F64), torch.tensor([1.0, -2.0], dtype=F64)
    with untouched(mean=mean, var=var, y=y, y_scale=scale):
        value = metrics.gaussian_nlpd(mean, var, y, y_scale=scale)
    original = torch.distributions.Normal(mean * scale + shift, var.sqrt() * scale)
    close(value, -original.log_prob(y * scale + shift).sum(-1).mean(), 1e-12, what="NLPD")
    return HELD, "equals the NLPD of the de-normalized predictive"


@case("data-08", AREA, "categorical_nlpd(eps=nan)")
def nan_eps():
    probs, y = torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 1])
    outcome = attempt(lambda: metrics.categorical_nlpd(probs, y, eps=float("nan")), names=("eps",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    close(outcome, -(math.log(0.9) + math.log(0.8)) / 2, 1e-6, what="NLPD with eps=nan")
    return HELD, "eps ignored"


@case("data-09", AREA, "expected_calibration_error against a loop over equal-width bins (ties on edges)")
def ece_brute_force():
    top = torch.tensor([0.8, 0.3, 0.5, 0.9, 0.6, 0.2, 0.95], dtype=F64)
    probs = torch.stack([top, 1 - top], dim=1)
    y = torch.tensor([0, 0, 1, 0, 1, 1, 0])
    with untouched(probs=probs, y=y):
        value = metrics.expected_calibration_error(probs, y, num_bins=5)
    total = 0.0
    for b in range(5):
        members = [n for n in range(7) if b / 5 < probs[n].max().item() <= (b + 1) / 5]
        if members:
            acc = sum(int(probs[n].argmax().item() == y[n].item()) for n in members) / len(members)
            conf = sum(probs[n].max().item() for n in members) / len(members)
            total += len(members) / 7 * abs(acc - conf)
    close(value, total, 1e-12, what="ECE")
    return HELD, f"ECE = {value:.4f}"


@case("data-10", AREA, "ood_auroc with ties against the pairwise Mann-Whitney count")
def auroc_ties():
    scores_in = torch.tensor([0.1, 0.4, 0.4, 0.7, 0.2])
    scores_out = torch.tensor([0.4, 0.9, 0.1, 0.7])
    pairs = [1.0 if o > i else 0.5 if o == i else 0.0
             for o in scores_out.tolist() for i in scores_in.tolist()]
    close(metrics.ood_auroc(scores_in, scores_out), sum(pairs) / len(pairs), 1e-12, what="AUROC")
    return HELD, "equal"


@case("data-11", AREA, "brier_score and accuracy on an expanded (stride-0) probability tensor")
def expanded_probabilities():
    row = torch.tensor([[0.2, 0.5, 0.3]])
    probs = row.expand(4, 3)
    y = torch.tensor([1, 0, 2, 1])
    with untouched(row=row):
        brier, acc = metrics.brier_score(probs, y), metrics.accuracy(probs, y)
    brute = sum((row[0, c].item() - float(c == y[n].item())) ** 2 for c in range(3) for n in range(4)) / 4
    close(brier, brute, 1e-7, what="Brier score")
    close(acc, 0.5, 0.0, what="accuracy")
    return HELD, "equal to the loops"


@case("data-12", AREA, "predictive_entropy with exact zeros (0 log 0 = 0), binary and multi-class")
def entropy_zeros():
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=F64)
    brute = torch.tensor([-sum(p * math.log(p) for p in row if p > 0) for row in probs.tolist()], dtype=F64)
    close(metrics.predictive_entropy(probs), brute, 1e-12, what="entropy")
    binary = torch.tensor([0.0, 1.0, 0.25], dtype=F64)
    brute2 = torch.tensor([0.0, 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))], dtype=F64)
    close(metrics.predictive_entropy(binary), brute2, 1e-12, what="binary entropy")
    return HELD, "finite and equal"


@case("data-13", AREA, "rmse of (N, 1) predictions against (N,) targets, non-contiguous")
def rmse_column():
    pred = torch.arange(12, dtype=F64).reshape(6, 2)[:, :1]
    y = torch.linspace(0, 5, 6, dtype=F64)
    brute = math.sqrt(sum((pred[n, 0].item() - y[n].item()) ** 2 for n in range(6)) / 6)
    close(metrics.rmse(pred, y), brute, 1e-12, what="RMSE")
    return HELD, "equal"


@case("data-14", AREA, "accuracy with float labels 0./1. and bool labels (against long labels)")
def float_and_bool_labels():
    probs = torch.tensor([0.9, 0.2, 0.6, 0.4])
    labels = torch.tensor([1, 0, 0, 0])
    expected = metrics.accuracy(probs, labels)
    for y in (labels.double(), labels.bool()):
        got = _accepted(lambda: metrics.accuracy(probs, y), f"{y.dtype} labels")
        close(got, expected, 0.0, what=f"accuracy with {y.dtype} labels")
    return HELD, "the same"


@case("data-15", AREA, "load_csv(input_columns=np.int64(0)) and a negative index, against names")
def csv_numpy_index():
    path = Path(tempfile.mkdtemp()) / "data.csv"
    path.write_text("a,b,y\n1,2,3\n4,5,6\n7,8,9\n")
    by_index = _accepted(lambda: load_csv(path, [np.int64(0), -2], -1), "numpy/negative indices")
    by_name = load_csv(path, ["a", "b"], "y")
    close(by_index.x, by_name.x, 0.0, what="x")
    close(by_index.y, by_name.y, 0.0, what="y")
    return HELD, "the same columns"


@case("data-16", AREA, "gaussian_nlpd with float16 inputs against float64")
def float16_nlpd():
    g = torch.Generator().manual_seed(1)
    mean, y = torch.randn(5, generator=g), torch.randn(5, generator=g)
    var = torch.rand(5, generator=g) + 0.5
    value16 = _accepted(lambda: metrics.gaussian_nlpd(mean.half(), var.half(), y.half()), "float16 inputs")
    reference = metrics.gaussian_nlpd(mean.half().double(), var.half().double(), y.half().double())
    if not math.isfinite(value16):
        raise SilentWrong(f"float16 NLPD is {value16}")
    close(value16, reference, 5e-3, rtol=5e-3, what="float16 NLPD")
    return HELD, "within float16 rounding"
