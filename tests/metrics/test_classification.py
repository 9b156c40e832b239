import math

import numpy as np
import pytest
import torch
from scipy import stats
from sklearn.metrics import brier_score_loss, log_loss

from ntkgp.metrics import (
    accuracy,
    brier_score,
    categorical_nlpd,
    expected_calibration_error,
    predictive_entropy,
)

from .reference import brute_force_ece, random_labels, random_probs

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


# Low-precision inputs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_categorical_nlpd_clamp_survives_half_precision(dtype):
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    y = torch.tensor([1, 0])
    expected = (-math.log(1e-12) - math.log(0.5)) / 2  # about (27.6 + 0.69) / 2
    # 0, 0.5 and 1 are exact in every dtype; the clamp at 1e-12 (rounded to float32, ε32/2 relative: ε32/2 absolute
    # in its log), the logs and the mean in float32: a few ε32 of the result (a float16 clamp would give inf)
    rel = 4 * torch.finfo(torch.float32).eps
    assert categorical_nlpd(probs.to(dtype), y) == pytest.approx(expected, rel=rel)
    assert categorical_nlpd(torch.tensor([1.0, 0.0], dtype=dtype), torch.tensor([1, 1])) == pytest.approx(
        -math.log(1e-12) / 2, rel=rel)


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
    # the float32 confidences are the float64 ones rounded once (ε32/2 relative) and summed in float64: the ECE moves
    # by at most ε32/2 times the mean confidence (plus float64 rounding)
    tolerance = torch.finfo(torch.float32).eps / 2 * (0.8 + 0.75) / 2 + 1e-15
    assert expected_calibration_error(probs.float(), y) == pytest.approx(expected, abs=tolerance)


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


@pytest.mark.parametrize("eps", [float("nan"), -1e-3, 1.5, "1e-12", None, True, torch.tensor([1e-12, 1e-3])])
def test_categorical_nlpd_refuses_an_eps_outside_zero_one_naming_it(eps):
    """``eps=nan`` returned a NaN NLPD without an error; a string reached torch's ``clamp_min`` error."""
    probs, y = torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 1])
    with pytest.raises((TypeError, ValueError), match="eps"):
        categorical_nlpd(probs, y, eps=eps)


def test_categorical_nlpd_eps_zero_is_the_unclamped_value():
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]], dtype=torch.float64)
    assert categorical_nlpd(probs, torch.tensor([0, 1]), eps=0.0) == pytest.approx(-(math.log(0.9) + math.log(0.8)) / 2)
    assert categorical_nlpd(probs, torch.tensor([0, 1]), eps=np.float32(1e-3)) == pytest.approx(
        -(math.log(0.9) + math.log(0.8)) / 2)
    assert categorical_nlpd(probs, torch.tensor([1, 1]), eps=torch.tensor(0.05)) == pytest.approx(
        -(math.log(0.1) + math.log(0.8)) / 2)
