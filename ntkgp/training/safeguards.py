"""The sane ranges of the hyperparameters :func:`~ntkgp.training.train_marglik` learns, and its warning.

A hyperparameter round stops, restores the last sane values and warns (:class:`HyperparameterWarning`) when a
hyperparameter leaves its range; the MAP training warns the same way when it diverges.
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood

from ..kernels import NTKKernel
from ..likelihoods import is_gaussian, likelihood_temperature, noise_variance

#: The sane range of every prior precision δ_g; outside it training warns and keeps the last sane values.
PRIOR_PRECISION_RANGE = (1e-8, 1e8)
#: The sane range of a Gaussian noise variance σ², relative to the mean variance of the targets.
NOISE_VARIANCE_RANGE = (1e-12, 1e4)
#: The sane range of a learnable temperature T.
TEMPERATURE_RANGE = (1e-4, 1e4)

__all__ = [
    "NOISE_VARIANCE_RANGE",
    "PRIOR_PRECISION_RANGE",
    "TEMPERATURE_RANGE",
    "HyperparameterWarning",
    "out_of_range",
]


class HyperparameterWarning(RuntimeWarning):
    """A hyperparameter round of :func:`~ntkgp.training.train_marglik` left the sane range or met a non-finite
    evidence, or the MAP training diverged."""


def _outside(values: torch.Tensor, low: float, high: float) -> bool:
    return not (torch.isfinite(values).all() and (values >= low).all() and (values <= high).all())


def out_of_range(kernel: NTKKernel, likelihood: Likelihood, target_variance: float) -> list[str]:
    """Descriptions of the hyperparameters outside their sane ranges (empty when all are sane).

    Args:
        kernel: the kernel holding the prior precisions δ.
        likelihood: the likelihood (its noise variance σ² and temperature T, where it has them).
        target_variance: the mean variance of the targets; the noise range is relative to it.
    """
    problems = []
    delta = kernel.prior_precision.detach()
    low, high = PRIOR_PRECISION_RANGE
    if _outside(delta, low, high):
        problems.append(f"prior precision δ = {[float(f'{v:.3g}') for v in delta.tolist()]} left [{low:g}, {high:g}]")
    if is_gaussian(likelihood):
        var = noise_variance(likelihood).detach()
        low, high = (r * target_variance for r in NOISE_VARIANCE_RANGE)
        if _outside(var, low, high):
            values = [float(f"{v:.3g}") for v in var.tolist()]
            problems.append(f"noise variance σ² = {values} left [{low:.3g}, {high:.3g}]")
    temperature = likelihood_temperature(likelihood)
    if temperature is not None:
        t = temperature.detach()
        low, high = TEMPERATURE_RANGE
        if _outside(t, low, high):
            problems.append(f"temperature T = {t.tolist()} left [{low:g}, {high:g}]")
    return problems
