"""What a likelihood is: its number of outputs :math:`C`, whether it is Gaussian, its noise variances.

Every function here dispatches on the likelihood's type; an unsupported likelihood raises
``NotImplementedError`` naming the supported ones.
"""

from __future__ import annotations

from functools import singledispatch

import torch
from gpytorch.likelihoods import (
    GaussianLikelihood,
    Likelihood,
    MultitaskGaussianLikelihood,
    SoftmaxLikelihood,
)
from torch import Tensor

from .logistic_likelihood import LogisticLikelihood

SUPPORTED_LIKELIHOODS = (
    "gpytorch GaussianLikelihood, gpytorch MultitaskGaussianLikelihood(rank=0), ntkgp LogisticLikelihood, "
    "ntkgp SoftmaxLikelihood or gpytorch SoftmaxLikelihood(mixing_weights=False)"
)


def unsupported_likelihood(likelihood: Likelihood) -> NotImplementedError:
    """The error raised for a likelihood that ntkgp cannot handle.

    Args:
        likelihood: the unsupported likelihood.

    Returns:
        A ``NotImplementedError`` naming its type and the supported likelihoods (to be raised).
    """
    return NotImplementedError(
        f"ntkgp does not support the likelihood {type(likelihood).__name__}; "
        f"supported: {SUPPORTED_LIKELIHOODS}"
    )


def check_unbatched(likelihood: Likelihood, hyperparameter: Tensor, name: str, size: int) -> None:
    """Check that a likelihood hyperparameter has shape ``(size,)`` (no batch shape).

    Args:
        likelihood: its likelihood (for the message).
        hyperparameter: the value.
        name: its name (for the message).
        size: the expected length.

    Raises:
        NotImplementedError: for any other shape.
    """
    if hyperparameter.shape != (size,):
        raise NotImplementedError(
            f"{type(likelihood).__name__} with batch_shape is not supported: {name} has shape "
            f"{tuple(hyperparameter.shape)}, expected ({size},)"
        )


def check_supported_multitask(likelihood: MultitaskGaussianLikelihood) -> None:
    """Check that a ``MultitaskGaussianLikelihood`` has independent noise per output.

    Args:
        likelihood: the likelihood.

    Raises:
        NotImplementedError: for ``rank > 0`` (a task noise covariance).
    """
    if likelihood.rank != 0:
        raise NotImplementedError(
            f"MultitaskGaussianLikelihood with rank={likelihood.rank} (a correlated task noise covariance) "
            "is not supported; use rank=0 (independent noise per output)"
        )


def check_supported_softmax(likelihood: SoftmaxLikelihood) -> None:
    """Check that a ``SoftmaxLikelihood`` has no mixing weights (the network's outputs must be the logits).

    Args:
        likelihood: the likelihood.

    Raises:
        ValueError: if it has mixing weights.
    """
    if likelihood.mixing_weights is not None:
        raise ValueError(
            "SoftmaxLikelihood with mixing_weights is not supported: the network's outputs must be the "
            "logits. Create it with mixing_weights=False, or use "
            "ntkgp.likelihoods.SoftmaxLikelihood(num_classes)"
        )


@singledispatch
def num_outputs(likelihood: Likelihood) -> int:
    """The number of network outputs :math:`C` the likelihood expects per data point.

    Args:
        likelihood: a supported likelihood.

    Returns:
        :math:`C`.

    Raises:
        NotImplementedError: for an unsupported likelihood or configuration.
        ValueError: for a GPyTorch ``SoftmaxLikelihood`` with mixing weights.

    Example:
        >>> from ntkgp.likelihoods import SoftmaxLikelihood
        >>> num_outputs(SoftmaxLikelihood(4))
        4
    """
    raise unsupported_likelihood(likelihood)


@num_outputs.register(GaussianLikelihood)
@num_outputs.register(LogisticLikelihood)
def _(likelihood: Likelihood) -> int:
    return 1


@num_outputs.register
def _(likelihood: MultitaskGaussianLikelihood) -> int:
    check_supported_multitask(likelihood)
    return likelihood.num_tasks


@num_outputs.register
def _(likelihood: SoftmaxLikelihood) -> int:
    check_supported_softmax(likelihood)
    return likelihood.num_classes


@singledispatch
def is_gaussian(likelihood: Likelihood) -> bool:
    """Whether ``likelihood`` is one of the supported Gaussian likelihoods (exact-GP algebra applies).

    Args:
        likelihood: any GPyTorch likelihood.

    Returns:
        ``True`` for ``GaussianLikelihood`` and ``MultitaskGaussianLikelihood``, else ``False``.

    Example:
        >>> from gpytorch.likelihoods import GaussianLikelihood
        >>> is_gaussian(GaussianLikelihood())
        True
    """
    return False


@is_gaussian.register(GaussianLikelihood)
@is_gaussian.register(MultitaskGaussianLikelihood)
def _(likelihood: Likelihood) -> bool:
    return True


@singledispatch
def noise_variance(likelihood: Likelihood) -> Tensor:
    r"""Noise variances :math:`\sigma_c^2` per output, shape ``(C,)``, differentiable in the noise.

    For ``MultitaskGaussianLikelihood`` :math:`\sigma_c^2` = task noise :math:`c` (if ``has_task_noise``)
    + global noise (if ``has_global_noise``), as in its ``marginal``.

    Args:
        likelihood: a supported Gaussian likelihood.

    Returns:
        Shape ``(C,)``.

    Raises:
        NotImplementedError: for a non-Gaussian or batched likelihood, or a task noise covariance.

    Example:
        >>> from gpytorch.likelihoods import GaussianLikelihood
        >>> likelihood = GaussianLikelihood()
        >>> likelihood.noise = 0.25
        >>> noise_variance(likelihood).detach()
        tensor([0.2500])
    """
    raise unsupported_likelihood(likelihood)


@noise_variance.register
def _(likelihood: GaussianLikelihood) -> Tensor:
    noise = likelihood.noise
    check_unbatched(likelihood, noise, "noise", 1)
    return noise


@noise_variance.register
def _(likelihood: MultitaskGaussianLikelihood) -> Tensor:
    check_supported_multitask(likelihood)
    variances = []
    if likelihood.has_task_noise:
        check_unbatched(likelihood, likelihood.task_noises, "task_noises", likelihood.num_tasks)
        variances.append(likelihood.task_noises)
    if likelihood.has_global_noise:
        check_unbatched(likelihood, likelihood.noise, "noise", 1)
        variances.append(likelihood.noise)
    return sum(variances).expand(likelihood.num_tasks)


def hyperparameter_values(likelihood: Likelihood) -> dict[str, list[float]]:
    """The likelihood's current noise, task noises and temperature (those it has), as plain lists for reports.

    Args:
        likelihood: any GPyTorch likelihood.

    Returns:
        ``{"noise": [...], "task_noises": [...], "temperature": [...]}``, only the keys it has.

    Example:
        >>> from ntkgp.likelihoods import LogisticLikelihood
        >>> hyperparameter_values(LogisticLikelihood(temperature=2.0))
        {'temperature': [2.0]}
    """
    values = {}
    for name in ("noise", "task_noises", "temperature"):
        value = getattr(likelihood, name, None)
        if isinstance(value, torch.Tensor):
            values[name] = value.detach().flatten().tolist()
    return values
