"""The input checks every metric makes (ntkgp/metrics/checks.py): each bad input is refused naming the argument."""

import math

import pytest
import torch

from ntkgp.metrics import (
    accuracy,
    brier_score,
    categorical_nlpd,
    expected_calibration_error,
    gaussian_nlpd,
    ood_auroc,
    predictive_entropy,
    rmse,
)

from .reference import random_labels, random_probs

# Input checks: every metric names the bad argument


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: gaussian_nlpd(torch.tensor([0.0, math.nan]), torch.ones(2), torch.zeros(2)), ValueError, "mean contains 1 NaN"),
        (lambda: gaussian_nlpd(torch.zeros(2), torch.ones(2), torch.tensor([math.inf, 0.0])), ValueError, "y contains 1 NaN or infinite"),
        (lambda: gaussian_nlpd(torch.zeros(2), torch.ones(2), torch.zeros(2), y_scale=0.0), ValueError, "y_scale must be positive"),
        (lambda: gaussian_nlpd([0.0], torch.ones(1), torch.zeros(1)), TypeError, "mean must be a torch.Tensor"),
        (lambda: categorical_nlpd(torch.tensor([[2.0, -1.0]]), torch.tensor([0])), ValueError, "not logits"),
        (lambda: categorical_nlpd(torch.tensor([[0.5, 0.5]]), torch.tensor([2])), ValueError, r"labels in 0..1"),
        (lambda: accuracy(torch.tensor([[0.5, 0.5]]), torch.tensor([0.5])), ValueError, "integer class labels"),
        (lambda: accuracy(torch.tensor([[math.nan, 0.5]]), torch.tensor([0])), ValueError, "probs contains 1 NaN"),
        (lambda: expected_calibration_error(random_probs(4, 2), random_labels(4, 2), num_bins=2.5), ValueError, "num_bins"),
        (lambda: brier_score(torch.tensor([1, 0]), torch.tensor([1, 0])), TypeError, "probs must be floating point"),
        (lambda: rmse(torch.zeros(3), torch.zeros(2)), ValueError, "incompatible"),
        (lambda: rmse(torch.zeros(0), torch.zeros(0)), ValueError, "pred is empty"),
        (lambda: predictive_entropy(torch.tensor([1.5])), ValueError, r"\[0, 1\]"),
        (lambda: ood_auroc(torch.tensor([0.1, math.inf]), torch.tensor([0.3])), ValueError, "scores_in contains"),
        (lambda: ood_auroc(torch.tensor([0.1]), [0.3]), TypeError, "scores_out must be a torch.Tensor"),
    ],
)
def test_metrics_reject_bad_inputs_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_probabilities_within_rounding_of_the_unit_interval_are_accepted():
    probs = torch.tensor([[1.0 + 1e-9, -1e-9], [0.5, 0.5]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    assert math.isfinite(categorical_nlpd(probs, y))
    assert bool(torch.isfinite(predictive_entropy(probs)).all())


# Shapes: only (N,) and (N, 1) are interchangeable


@pytest.mark.parametrize(
    ("bad", "name"),
    [
        (lambda mean, var, y: gaussian_nlpd(mean, var, y.T), "y"),
        (lambda mean, var, y: gaussian_nlpd(mean, var.T.contiguous(), y), "var"),
        (lambda mean, var, y: gaussian_nlpd(mean, var, y.reshape(-1)), "y"),
        (lambda mean, var, y: gaussian_nlpd(mean, var.reshape(-1), y), "var"),
        (lambda mean, var, y: gaussian_nlpd(mean, var, y[:1]), "y"),
        (lambda mean, var, y: gaussian_nlpd(mean[:, :1], var[:, :1], y[:1].T), "y"),
        (lambda mean, var, y: gaussian_nlpd(mean[None], var[None], y[None]), "mean"),
        (lambda mean, var, y: rmse(mean, y.T), "y"),
        (lambda mean, var, y: rmse(mean, y.reshape(-1)), "y"),
        (lambda mean, var, y: rmse(mean.reshape(-1), y), "y"),
        (lambda mean, var, y: rmse(mean[None], y[None]), "pred"),
    ],
)
def test_regression_metrics_reject_transposed_or_flattened_targets(bad, name):
    generator = torch.Generator().manual_seed(9)
    mean, y = torch.randn(2, 20, 3, generator=generator, dtype=torch.float64)
    var = torch.rand(20, 3, generator=generator, dtype=torch.float64) + 0.1
    with pytest.raises(ValueError, match=rf"^{name} "):
        bad(mean, var, y)


def test_column_and_flat_single_output_remain_interchangeable():
    generator = torch.Generator().manual_seed(10)
    mean, y = torch.randn(2, 15, generator=generator, dtype=torch.float64)
    var = torch.rand(15, generator=generator, dtype=torch.float64) + 0.1
    expected = -torch.distributions.Normal(mean, var.sqrt()).log_prob(y).mean().item()
    for m, v, t in [(mean, var, y), (mean[:, None], var, y), (mean, var[:, None], y[:, None]),
                    (mean[:, None], var[:, None], y)]:
        assert gaussian_nlpd(m, v, t) == pytest.approx(expected, rel=1e-12)
    assert rmse(mean[:, None], y) == pytest.approx(torch.sqrt(((mean - y) ** 2).mean()).item(), rel=1e-12)


@pytest.mark.parametrize("labels", [lambda y: y[None], lambda y: y[None, :, None]])
def test_classification_labels_must_be_a_column(labels):
    probs, y = random_probs(6, 3), random_labels(6, 3)
    with pytest.raises(ValueError, match=r"^y must have shape"):
        categorical_nlpd(probs, labels(y))
    assert categorical_nlpd(probs, y[:, None]) == pytest.approx(categorical_nlpd(probs, y))


# Class probabilities: (N, C) rows sum to one


CLASSIFICATION_METRICS = {
    "categorical_nlpd": lambda p, y: categorical_nlpd(p, y),
    "accuracy": lambda p, y: accuracy(p, y),
    "expected_calibration_error": lambda p, y: expected_calibration_error(p, y),
    "brier_score": lambda p, y: brier_score(p, y),
    "predictive_entropy": lambda p, y: predictive_entropy(p),
}


@pytest.mark.parametrize("metric", sorted(CLASSIFICATION_METRICS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_rows_that_do_not_sum_to_one_are_refused(metric, dtype):
    probs = torch.tensor([[0.7, 0.3], [0.1, 0.2]], dtype=dtype)  # the second row sums to 0.3
    with pytest.raises(ValueError, match=r"^probs rows must sum to 1 .* row 1 sums to 0\.(3|29)"):
        CLASSIFICATION_METRICS[metric](probs, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"^probs rows must sum to 1"):
        CLASSIFICATION_METRICS[metric](torch.full((3, 4), 0.5, dtype=dtype), torch.tensor([0, 1, 2]))


def test_row_sum_tolerance_is_the_square_root_of_the_dtype_epsilon_at_least_float32s():
    y = torch.tensor([0])
    # float64 and float32: sqrt(eps32) = 3.45e-4
    # the probability rounded to float32 (ε32/2 relative: an absolute ε32/2 in its log) and the log's own rounding
    rel = torch.finfo(torch.float32).eps * (1 + 0.5 / abs(math.log(0.6002)))
    for dtype in (torch.float64, torch.float32):
        assert categorical_nlpd(torch.tensor([[0.6002, 0.4]], dtype=dtype), y) == pytest.approx(
            -math.log(0.6002), rel=rel)
        with pytest.raises(ValueError, match="probs rows must sum to 1"):
            categorical_nlpd(torch.tensor([[0.6005, 0.4]], dtype=dtype), y)
    # float16: sqrt(eps16) = 0.03125
    # 0.62 rounded to float16 (ε16/2 relative, an absolute ε16/2 in its log), the log in float32
    rel16 = torch.finfo(torch.float16).eps / 2 / abs(math.log(0.62)) + torch.finfo(torch.float32).eps
    assert categorical_nlpd(torch.tensor([[0.62, 0.4]], dtype=torch.float16), y) == pytest.approx(
        -math.log(0.62), rel=rel16)
    with pytest.raises(ValueError, match="probs rows must sum to 1"):
        categorical_nlpd(torch.tensor([[0.64, 0.4]], dtype=torch.float16), y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_softmax_rows_are_accepted_in_their_dtype(dtype):
    """Rows normalized in a low precision sum to one only within its rounding; in their dtype they pass."""
    logits = 4 * torch.randn(500, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = random_labels(500, 10)
    probs = torch.softmax(logits.to(dtype), dim=1)
    reference = -probs.double().gather(1, y[:, None]).clamp_min(1e-12).log().mean().item()
    # log and mean in float32 (the dtype's values are exact there): each −log p ≥ 0 within ε32 of itself, their
    # blocked sum over N = 500 within log2 N ε32 of Σ|−log p| (tests.helpers.float32_roundings' convention), the
    # division ε32/2: relative (log2 N + 2)ε32 ≈ 1.3e-6
    rel = (math.log2(len(y)) + 2) * torch.finfo(torch.float32).eps
    assert categorical_nlpd(probs, y) == pytest.approx(reference, rel=rel)
    wider = probs.double()
    if dtype == torch.float32:  # float32 probabilities cast to float64 keep float32's tolerance
        assert categorical_nlpd(wider, y) == pytest.approx(reference, rel=1e-12)
    else:  # half precision cast up: off by its own rounding, more than float32's tolerance
        assert float((wider.sum(1) - 1).abs().max()) > 3.5e-4
        with pytest.raises(ValueError, match=r"renormalize"):
            categorical_nlpd(wider, y)
    renormalized = wider / wider.sum(-1, keepdim=True)
    expected = -renormalized.gather(1, y[:, None]).clamp_min(1e-12).log().mean().item()
    assert categorical_nlpd(renormalized, y) == pytest.approx(expected, rel=1e-12)


def test_meta_tensors_are_refused_naming_the_argument():
    probs = torch.empty(3, 2, device="meta")
    with pytest.raises(ValueError, match="^probs is on the meta device"):
        categorical_nlpd(probs, torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="^mean is on the meta device"):
        gaussian_nlpd(torch.empty(3, device="meta"), torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="^scores_out is on the meta device"):
        ood_auroc(torch.zeros(2), torch.empty(2, device="meta"))
