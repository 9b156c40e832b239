import math

import numpy as np
import pytest
import torch
from scipy import stats
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

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


def random_probs(n: int, c: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(n, c, generator=generator, dtype=torch.float64), dim=-1)


def random_labels(n: int, c: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(c, (n,), generator=torch.Generator().manual_seed(seed))


# Gaussian NLPD


def test_gaussian_nlpd_matches_scipy_single_output():
    generator = torch.Generator().manual_seed(0)
    mean, y = torch.randn(2, 50, generator=generator, dtype=torch.float64)
    var = torch.rand(50, generator=generator, dtype=torch.float64) + 0.1
    expected = -stats.norm.logpdf(y.numpy(), mean.numpy(), np.sqrt(var.numpy())).mean()
    assert gaussian_nlpd(mean, var, y) == pytest.approx(expected, rel=1e-12)


def test_gaussian_nlpd_sums_outputs_and_averages_examples():
    generator = torch.Generator().manual_seed(1)
    mean, y = torch.randn(2, 20, 3, generator=generator, dtype=torch.float64)
    var = torch.rand(20, 3, generator=generator, dtype=torch.float64) + 0.1
    log_pdf = stats.norm.logpdf(y.numpy(), mean.numpy(), np.sqrt(var.numpy()))
    assert gaussian_nlpd(mean, var, y) == pytest.approx(-log_pdf.sum(axis=1).mean(), rel=1e-12)


def test_gaussian_nlpd_accepts_column_targets_without_broadcasting():
    mean = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    var = torch.ones(3, dtype=torch.float64)
    y = torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64)
    assert gaussian_nlpd(mean, var, y) == pytest.approx(0.5 * math.log(2 * math.pi))
    with pytest.raises(ValueError):
        gaussian_nlpd(mean, var, torch.zeros(4))


def test_gaussian_nlpd_y_scale_gives_original_units():
    generator = torch.Generator().manual_seed(2)
    mean, y = torch.randn(2, 30, generator=generator, dtype=torch.float64)
    var = torch.rand(30, generator=generator, dtype=torch.float64) + 0.1
    shift, scale = 5.0, 3.0
    original = -stats.norm.logpdf(
        (y * scale + shift).numpy(), (mean * scale + shift).numpy(), scale * np.sqrt(var.numpy())
    ).mean()
    assert gaussian_nlpd(mean, var, y, y_scale=scale) == pytest.approx(original, rel=1e-12)


def test_gaussian_nlpd_rejects_nonpositive_variance():
    with pytest.raises(ValueError):
        gaussian_nlpd(torch.zeros(2), torch.tensor([1.0, 0.0]), torch.zeros(2))


# Categorical NLPD


def test_categorical_nlpd_matches_sklearn_log_loss():
    probs, y = random_probs(40, 4), random_labels(40, 4)
    expected = log_loss(y.numpy(), probs.numpy(), labels=[0, 1, 2, 3])
    assert categorical_nlpd(probs, y) == pytest.approx(expected, rel=1e-10)


def test_categorical_nlpd_hand_example():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.5, 0.4]])
    y = torch.tensor([0, 2])
    assert categorical_nlpd(probs, y) == pytest.approx(-(math.log(0.7) + math.log(0.4)) / 2, rel=1e-6)


@pytest.mark.parametrize("shape", [(6,), (6, 1)])
def test_categorical_nlpd_binary_forms(shape):
    p1 = torch.tensor([0.9, 0.2, 0.6, 0.5, 0.01, 0.99], dtype=torch.float64)
    y = torch.tensor([1, 0, 0, 1, 1, 0])
    expected = -np.mean(np.where(y.numpy() == 1, np.log(p1.numpy()), np.log(1 - p1.numpy())))
    assert categorical_nlpd(p1.reshape(shape), y) == pytest.approx(expected, rel=1e-12)


def test_categorical_nlpd_clamps_zero_probability():
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    y = torch.tensor([1, 0])
    value = categorical_nlpd(probs, y, eps=1e-12)
    assert value == pytest.approx((-math.log(1e-12) - math.log(0.5)) / 2)


# Accuracy


def test_accuracy_hand_example():
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1], [0.5, 0.4, 0.1]])
    y = torch.tensor([0, 2, 0, 1])
    assert accuracy(probs, y) == pytest.approx(0.5)


def test_accuracy_binary_threshold_at_one_half():
    p1 = torch.tensor([0.51, 0.49, 0.5, 0.9])
    y = torch.tensor([1, 0, 0, 0])
    assert accuracy(p1, y) == pytest.approx(0.75)
    assert accuracy(p1[:, None], y[:, None]) == pytest.approx(0.75)


# Expected calibration error


def brute_force_ece(probs: np.ndarray, y: np.ndarray, num_bins: int) -> float:
    total = 0.0
    n = len(y)
    for b in range(num_bins):
        lo, hi = b / num_bins, (b + 1) / num_bins
        members = [i for i in range(n) if lo < probs[i].max() <= hi]
        if not members:
            continue
        acc = sum(int(probs[i].argmax() == y[i]) for i in members) / len(members)
        conf = sum(probs[i].max() for i in members) / len(members)
        total += len(members) / n * abs(acc - conf)
    return total


@pytest.mark.parametrize("num_bins", [1, 5, 10, 15])
def test_ece_matches_brute_force(num_bins):
    probs, y = random_probs(200, 5, seed=3), random_labels(200, 5, seed=4)
    expected = brute_force_ece(probs.numpy(), y.numpy(), num_bins)
    assert expected > 0
    assert expected_calibration_error(probs, y, num_bins) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_ece_bin_edges_are_upper_inclusive():
    # Confidences that sit exactly on bin edges (0.6, 0.7, 0.8, 1.0 with 10 bins).
    probs = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.2, 0.8], [0.0, 1.0], [0.4, 0.6]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 1])
    expected = brute_force_ece(probs.numpy(), y.numpy(), 10)
    assert expected_calibration_error(probs, y, 10) == pytest.approx(expected, abs=1e-15)


def test_ece_hand_example_binary():
    # Confidences 0.8, 0.8 (bin (0.7, 0.8], one correct) and 0.7 (bin (0.6, 0.7], correct).
    p1 = torch.tensor([0.8, 0.8, 0.3], dtype=torch.float64)
    y = torch.tensor([1, 0, 0])
    expected = 2 / 3 * abs(0.5 - 0.8) + 1 / 3 * abs(1.0 - 0.7)
    assert expected_calibration_error(p1, y, num_bins=10) == pytest.approx(expected)


# Brier score


def test_brier_score_multiclass_brute_force():
    probs, y = random_probs(30, 3, seed=5), random_labels(30, 3, seed=6)
    p = probs.numpy()
    expected = np.mean([sum((p[n, c] - (c == y[n].item())) ** 2 for c in range(3)) for n in range(30)])
    assert brier_score(probs, y) == pytest.approx(expected, rel=1e-12)


def test_brier_score_binary_is_twice_sklearn():
    p1 = torch.tensor([0.9, 0.2, 0.6, 0.5, 0.01], dtype=torch.float64)
    y = torch.tensor([1, 0, 0, 1, 1])
    expected = 2 * brier_score_loss(y.numpy(), p1.numpy())
    assert brier_score(p1, y) == pytest.approx(expected, rel=1e-12)
    assert brier_score(torch.stack([1 - p1, p1], dim=1), y) == pytest.approx(expected, rel=1e-12)


# RMSE


def test_rmse_hand_example():
    pred = torch.tensor([1.0, 2.0, 3.0, 4.0])
    y = torch.tensor([[1.0], [0.0], [3.0], [6.0]])
    assert rmse(pred, y) == pytest.approx(math.sqrt(8 / 4))


# Predictive entropy


def test_predictive_entropy_matches_scipy_and_handles_zeros():
    probs = torch.cat(
        [random_probs(10, 4, seed=7), torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)]
    )
    entropy = predictive_entropy(probs)
    assert entropy.shape == (11,)
    np.testing.assert_allclose(entropy.numpy(), stats.entropy(probs.numpy(), axis=1), rtol=1e-12, atol=1e-15)
    assert entropy[-1] == 0


def test_predictive_entropy_binary():
    p1 = torch.tensor([0.5, 0.1], dtype=torch.float64)
    expected = [math.log(2), -(0.1 * math.log(0.1) + 0.9 * math.log(0.9))]
    np.testing.assert_allclose(predictive_entropy(p1).numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(predictive_entropy(p1[:, None]).numpy(), expected, rtol=1e-12)


# OOD AUROC


def test_ood_auroc_matches_sklearn_with_ties():
    generator = torch.Generator().manual_seed(8)
    # Rounded scores produce many ties, exercising the average-rank rule.
    scores_in = torch.round(2 * torch.randn(137, generator=generator))
    scores_out = torch.round(2 * torch.randn(91, generator=generator) + 1)
    labels = np.r_[np.zeros(137), np.ones(91)]
    expected = roc_auc_score(labels, np.r_[scores_in.numpy(), scores_out.numpy()])
    assert ood_auroc(scores_in, scores_out) == pytest.approx(expected, rel=1e-12)


def test_ood_auroc_extremes():
    low, high = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5, 0.9])
    assert ood_auroc(low, high) == 1.0
    assert ood_auroc(high, low) == 0.0
    assert ood_auroc(torch.ones(4), torch.ones(3)) == 0.5


def test_ood_auroc_hand_example():
    # Pairs (out > in): 2 -> beats 1 (1 pair, ties with 2 count 1/2); 3 -> beats 1, 2 (2 pairs).
    scores_in, scores_out = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 3.0])
    assert ood_auroc(scores_in, scores_out) == pytest.approx((1 + 0.5 + 2) / 4)


def test_ood_auroc_rejects_empty():
    with pytest.raises(ValueError):
        ood_auroc(torch.tensor([]), torch.tensor([1.0]))


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


# y_scale: a scalar or (C,)


def test_gaussian_nlpd_per_output_y_scale_matches_torch_distributions():
    generator = torch.Generator().manual_seed(11)
    mean, y = torch.randn(2, 25, 2, generator=generator, dtype=torch.float64)
    var = torch.rand(25, 2, generator=generator, dtype=torch.float64) + 0.1
    scale = torch.tensor([2.0, 0.5], dtype=torch.float64)
    original = torch.distributions.Normal(mean * scale, var.sqrt() * scale).log_prob(y * scale)
    expected = -original.sum(dim=1).mean().item()
    assert gaussian_nlpd(mean, var, y, y_scale=scale) == pytest.approx(expected, rel=1e-12)
    single = -torch.distributions.Normal(mean[:, 0] * 3, var[:, 0].sqrt() * 3).log_prob(y[:, 0] * 3).mean().item()
    assert gaussian_nlpd(mean[:, 0], var[:, 0], y[:, 0], y_scale=torch.tensor([3.0])) == pytest.approx(single)
    assert gaussian_nlpd(mean[:, :1], var[:, :1], y[:, :1], y_scale=np.float32(3.0)) == pytest.approx(single)


@pytest.mark.parametrize(
    ("shape", "y_scale"),
    [
        ((4, 1), torch.tensor([2.0, 3.0, 4.0])),
        ((4,), torch.arange(1.0, 5.0)),
        ((4, 2), torch.ones(4, 2)),
        ((4, 2), torch.ones(1, 2)),
        ((4, 2), torch.ones(3)),
    ],
)
def test_gaussian_nlpd_rejects_y_scale_of_the_wrong_shape(shape, y_scale):
    mean, var = torch.zeros(shape), torch.ones(shape)
    with pytest.raises(ValueError, match=r"^y_scale must be a scalar or have shape"):
        gaussian_nlpd(mean, var, mean, y_scale=y_scale)


# Low-precision inputs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_categorical_nlpd_clamp_survives_half_precision(dtype):
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    y = torch.tensor([1, 0])
    expected = (-math.log(1e-12) - math.log(0.5)) / 2  # about (27.6 + 0.69) / 2
    assert categorical_nlpd(probs.to(dtype), y) == pytest.approx(expected, rel=1e-3)
    assert categorical_nlpd(torch.tensor([1.0, 0.0], dtype=dtype), torch.tensor([1, 1])) == pytest.approx(
        -math.log(1e-12) / 2, rel=1e-3)


@pytest.mark.parametrize("num_bins", [5, 10, 20])
def test_ece_bins_do_not_depend_on_the_dtype(num_bins):
    # Confidences on (or next to) the edges b/M, where a float32 value cast to float64 crosses the edge.
    conf = torch.tensor([0.8, 0.75, 0.6, 0.7, 0.9, 0.55, 0.65, 0.85], dtype=torch.float64)
    probs = torch.stack([conf, 1 - conf], dim=1)
    y = torch.tensor([0, 1, 0, 1, 0, 0, 1, 1])
    expected = brute_force_ece(probs.numpy(), y.numpy(), num_bins)
    assert expected_calibration_error(probs, y, num_bins) == pytest.approx(expected, abs=1e-15)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        low = probs.to(dtype)
        # Reference: the same binning rule evaluated on the rounded confidences, edges rounded to the dtype.
        c = low.max(dim=1).values
        edges = (torch.arange(num_bins + 1, dtype=torch.float64) / num_bins).to(dtype)
        total = 0.0
        for b in range(num_bins):
            members = (c > edges[b]) & (c <= edges[b + 1])
            if members.any():
                total += abs(float((y[members] == 0).double().sum()) - float(c[members].double().sum()))
        assert expected_calibration_error(low, y, num_bins) == pytest.approx(total / len(y), abs=1e-12)
        # Same bins as in float64: the ECE moves only by the rounding of the confidences.
        assert expected_calibration_error(low, y, num_bins) == pytest.approx(expected, abs=1e-2)


def test_ece_float32_issue_example():
    probs = torch.tensor([[0.8, 0.2], [0.75, 0.25]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    expected = abs((1 + 0) - (0.8 + 0.75)) / 2  # both in bin (0.7, 0.8]: 0.275 (0.8 in (0.8, 0.9] gives 0.475)
    assert expected_calibration_error(probs, y) == pytest.approx(expected)
    assert expected_calibration_error(probs.float(), y) == pytest.approx(expected, rel=1e-6)


# NumPy scalars for integer and real options


def test_numpy_scalars_are_accepted_as_options():
    from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood

    probs, y = random_probs(50, 3, seed=12), random_labels(50, 3, seed=13)
    assert expected_calibration_error(probs, y, num_bins=np.int64(7)) == pytest.approx(
        brute_force_ece(probs.numpy(), y.numpy(), 7), rel=1e-12)
    likelihood = SoftmaxLikelihood(np.int32(3), temperature=np.float32(0.5))
    assert likelihood.num_classes == 3 and likelihood.temperature.item() == pytest.approx(0.5)
    assert LogisticLikelihood(temperature=np.float64(2.0)).temperature.item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="num_bins"):
        expected_calibration_error(probs, y, num_bins=True)
    with pytest.raises(TypeError, match="temperature"):
        SoftmaxLikelihood(3, temperature=np.bool_(True))
    with pytest.raises(TypeError, match="temperature"):
        SoftmaxLikelihood(3, temperature=True)
