import math

import numpy as np
import pytest
import torch
from scipy import stats

from ntkgp.metrics import gaussian_nlpd, rmse

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


# RMSE


def test_rmse_hand_example():
    pred = torch.tensor([1.0, 2.0, 3.0, 4.0])
    y = torch.tensor([[1.0], [0.0], [3.0], [6.0]])
    assert rmse(pred, y) == pytest.approx(math.sqrt(8 / 4))


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


@pytest.mark.parametrize("y_scale", ["2", None, [2.0], torch.tensor(2 + 0j)])
def test_gaussian_nlpd_refuses_a_y_scale_that_is_no_number_naming_it(y_scale):
    """A string reached torch's ``new(): invalid data type 'str'``, a list was read as a tensor."""
    mean = torch.zeros(3)
    with pytest.raises((TypeError, ValueError), match="y_scale"):
        gaussian_nlpd(mean, torch.ones(3), mean, y_scale=y_scale)
