"""validate_targets, num_outputs, is_gaussian, noise_variance, and the errors for unsupported likelihoods."""

from __future__ import annotations

import gpytorch
import pytest
import torch

from ntkgp.likelihoods import (
    LogisticLikelihood,
    SoftmaxLikelihood,
    gradient,
    hessian,
    hessian_sqrt,
    is_gaussian,
    log_likelihood,
    noise_variance,
    num_outputs,
    validate_targets,
)

TERMS = (log_likelihood, gradient, hessian, hessian_sqrt)


def test_num_outputs_and_is_gaussian():
    multitask = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3, rank=0)
    plain_softmax = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=5, mixing_weights=False)
    cases = [
        (gpytorch.likelihoods.GaussianLikelihood(), 1, True),
        (multitask, 3, True),
        (LogisticLikelihood(), 1, False),
        (SoftmaxLikelihood(4), 4, False),
        (plain_softmax, 5, False),
    ]
    for likelihood, expected_outputs, gaussian in cases:
        assert num_outputs(likelihood) == expected_outputs
        assert is_gaussian(likelihood) is gaussian
    assert is_gaussian(gpytorch.likelihoods.BernoulliLikelihood()) is False


def test_noise_variance():
    gaussian = gpytorch.likelihoods.GaussianLikelihood()
    gaussian.noise = 0.2
    torch.testing.assert_close(noise_variance(gaussian), torch.tensor([0.2]))
    both = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0)
    both.task_noises = torch.tensor([0.1, 0.3])
    both.noise = 0.05
    torch.testing.assert_close(noise_variance(both), torch.tensor([0.15, 0.35]))
    single = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3, rank=0, has_task_noise=False)
    single.noise = 0.4
    torch.testing.assert_close(noise_variance(single), torch.full((3,), 0.4))


@pytest.mark.parametrize(
    "likelihood",
    [
        gpytorch.likelihoods.BernoulliLikelihood(),
        gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=torch.ones(4)),
        gpytorch.likelihoods.StudentTLikelihood(),
    ],
)
def test_unsupported_likelihood_raises(likelihood):
    f, y = torch.zeros(4, 1), torch.zeros(4)
    with pytest.raises(NotImplementedError, match="does not support the likelihood"):
        num_outputs(likelihood)
    with pytest.raises(NotImplementedError, match="supported:"):
        validate_targets(likelihood, y)
    for term in TERMS:
        with pytest.raises(NotImplementedError, match=type(likelihood).__name__):
            term(likelihood, f, y)


def test_multitask_with_task_covariance_raises():
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3, rank=1)
    f, y = torch.zeros(4, 3), torch.zeros(4, 3)
    with pytest.raises(NotImplementedError, match="rank=1"):
        num_outputs(likelihood)
    for term in TERMS:
        with pytest.raises(NotImplementedError, match="rank=1"):
            term(likelihood, f, y)


def test_batched_gaussian_likelihood_raises():
    likelihood = gpytorch.likelihoods.GaussianLikelihood(batch_shape=torch.Size([2]))
    with pytest.raises(NotImplementedError, match="batch_shape"):
        hessian(likelihood, torch.zeros(4, 1), torch.zeros(4))


def test_softmax_with_mixing_weights_raises():
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_features=3, num_classes=3, mixing_weights=True)
    f, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="mixing_weights"):
        num_outputs(likelihood)
    for term in TERMS:
        with pytest.raises(ValueError, match="mixing_weights"):
            term(likelihood, f, y)


def test_gaussian_targets_are_normalised():
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    y = torch.arange(5.0)
    normalised = validate_targets(likelihood, y, 1)
    assert normalised.shape == (5, 1)
    assert validate_targets(likelihood, y.unsqueeze(-1)).shape == (5, 1)
    assert validate_targets(likelihood, torch.arange(5)).dtype == torch.get_default_dtype()
    multitask = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3, rank=0)
    assert validate_targets(multitask, torch.zeros(5, 3, dtype=torch.float64)).dtype == torch.float64


def test_classification_targets_are_normalised():
    logistic = validate_targets(LogisticLikelihood(), torch.tensor([True, False, True]))
    assert logistic.shape == (3, 1) and logistic.is_floating_point()
    torch.testing.assert_close(logistic.squeeze(-1), torch.tensor([1.0, 0.0, 1.0]))
    assert validate_targets(LogisticLikelihood(), torch.tensor([[0], [1]])).shape == (2, 1)
    labels = validate_targets(SoftmaxLikelihood(3), torch.tensor([[0.0], [2.0], [1.0]]))
    assert labels.dtype == torch.long and torch.equal(labels, torch.tensor([0, 2, 1]))


@pytest.mark.parametrize("name", ["y", "train_y"])
@pytest.mark.parametrize(
    ("likelihood", "y", "message"),
    [
        (gpytorch.likelihoods.GaussianLikelihood(), torch.tensor([0.0, float("nan")]), "NaN or infinite"),
        (gpytorch.likelihoods.GaussianLikelihood(), torch.tensor([0.0, float("inf")]), "NaN or infinite"),
        (gpytorch.likelihoods.GaussianLikelihood(), torch.zeros(4, 2), r"shape \(N,\) or \(N, 1\)"),
        (gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3, rank=0), torch.zeros(4), r"\(N, 3\)"),
        (gpytorch.likelihoods.GaussianLikelihood(), torch.zeros(2, 2, 1), "shape"),
        (gpytorch.likelihoods.GaussianLikelihood(), torch.tensor(1.0), "shape"),
        (LogisticLikelihood(), torch.tensor([0.0, 2.0]), "binary labels 0 or 1"),
        (LogisticLikelihood(), torch.tensor([0.0, 0.5]), "binary labels 0 or 1"),
        (LogisticLikelihood(), torch.tensor([0, -1]), "binary labels 0 or 1"),
        (LogisticLikelihood(), torch.tensor([0.0, float("nan")]), "NaN or infinite"),
        (LogisticLikelihood(), torch.zeros(3, 2), "binary labels"),
        (SoftmaxLikelihood(3), torch.tensor([0, 3]), r"class labels in 0..2"),
        (SoftmaxLikelihood(3), torch.tensor([-1, 0]), r"class labels in 0..2"),
        (SoftmaxLikelihood(3), torch.tensor([0.0, 1.5]), "integer class labels"),
        (SoftmaxLikelihood(3), torch.tensor([0.0, float("inf")]), "NaN or infinite"),
        (SoftmaxLikelihood(3), torch.eye(3), "one-hot"),
    ],
)
def test_invalid_targets_raise_naming_the_argument(likelihood, y, message, name):
    y_before = y.clone()
    with pytest.raises(ValueError, match=rf"{name}\b.*{message}|{message}.*\b{name}\b|^{name} "):
        validate_targets(likelihood, y, name=name)
    with pytest.raises(ValueError, match=message):
        validate_targets(likelihood, y, name=name)
    assert torch.equal(y, y_before) or (y.isnan().any() and torch.equal(y.isnan(), y_before.isnan()))


def test_mismatched_number_of_outputs_or_points_raises():
    with pytest.raises(ValueError, match=r"network has 4 outputs.*expects 3.*train_y"):
        validate_targets(SoftmaxLikelihood(3), torch.tensor([0, 1]), 4, name="train_y")
    with pytest.raises(ValueError, match=r"train_y has 2 rows.*5 data points"):
        validate_targets(SoftmaxLikelihood(3), torch.tensor([0, 1]), 3, num_data=5, name="train_y")
    with pytest.raises(TypeError, match="y must be a torch.Tensor"):
        validate_targets(SoftmaxLikelihood(3), [0, 1])


def test_terms_check_f_and_y():
    likelihood = SoftmaxLikelihood(3)
    for term in TERMS:
        with pytest.raises(ValueError, match=r"f must have shape \(N, 3\)"):
            term(likelihood, torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
        with pytest.raises(ValueError, match=r"f must have shape"):
            term(likelihood, torch.zeros(4), torch.zeros(4, dtype=torch.long))
        with pytest.raises(ValueError, match=r"y has 3 rows"):
            term(likelihood, torch.zeros(4, 3), torch.zeros(3, dtype=torch.long))
        with pytest.raises(ValueError, match=r"^y must hold class labels"):
            term(likelihood, torch.zeros(2, 3), torch.tensor([0, 5]))
