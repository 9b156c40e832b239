"""Checking and normalising training targets ``y`` against a likelihood, before anything is computed."""

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

from ..linalg import all_finite
from ..ntk.checks import check_has_values
from .logistic_likelihood import LogisticLikelihood
from .properties import num_outputs as likelihood_num_outputs
from .properties import unsupported_likelihood


def validate_targets(
    likelihood: Likelihood,
    y: Tensor,
    num_outputs: int | None = None,
    *,
    num_data: int | None = None,
    name: str = "y",
) -> Tensor:
    """Check ``y`` against ``likelihood`` and return it in the normalised form; ``y`` itself is not modified.

    Normalised forms (``C`` = number of outputs of the likelihood):

    - Gaussian likelihoods: floating point, shape ``(N, C)``; ``(N,)`` is accepted when ``C == 1``.
    - :class:`~ntkgp.likelihoods.LogisticLikelihood`: floating point values in {0, 1}, shape ``(N, 1)``;
      ``(N,)`` and boolean or integer tensors are accepted.
    - Softmax likelihoods: ``torch.long`` labels in ``0..C-1``, shape ``(N,)``; ``(N, 1)`` and floating point
      tensors holding whole numbers are accepted (one-hot targets are not).

    Args:
        likelihood: a supported likelihood.
        y: the targets.
        num_outputs: the number of network outputs, checked against the likelihood's ``C`` when given.
        num_data: the number of data points ``N``, checked when given.
        name: the argument's name in error messages (e.g. ``"train_y"``).

    Returns:
        ``y`` in the normalized form (a new tensor where a conversion was needed).

    Raises:
        TypeError: if ``y`` is not a tensor.
        ValueError: naming ``name``, for non-finite values, labels out of range or not whole numbers, a wrong
            shape, or a number of outputs that does not match the likelihood.
        NotImplementedError: for an unsupported likelihood.

    Example:
        >>> from ntkgp.likelihoods import SoftmaxLikelihood
        >>> validate_targets(SoftmaxLikelihood(3), torch.tensor([[0.0], [2.0]]), name="train_y")
        tensor([0, 2])
    """
    if not torch.is_tensor(y):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(y).__name__}")
    check_has_values(y, name)
    expected = likelihood_num_outputs(likelihood)
    if num_outputs is not None and num_outputs != expected:
        raise ValueError(
            f"the network has {num_outputs} outputs but {type(likelihood).__name__} expects {expected} "
            f"(checking {name})"
        )
    if y.dim() == 0 or y.dim() > 2:
        raise ValueError(f"{name} must have shape (N,) or (N, C), got shape {tuple(y.shape)}")
    if num_data is not None and y.shape[0] != num_data:
        raise ValueError(f"{name} has {y.shape[0]} rows but there are {num_data} data points")
    if y.is_floating_point() and not all_finite(y):
        count = int((~torch.isfinite(y)).sum())
        raise ValueError(f"{name} contains {count} NaN or infinite value(s)")
    return _normalise_targets(likelihood, y, expected, name)


def _floating(y: Tensor) -> Tensor:
    return y if y.is_floating_point() else y.to(torch.get_default_dtype())


@singledispatch
def _normalise_targets(likelihood: Likelihood, y: Tensor, num_outputs: int, name: str) -> Tensor:
    raise unsupported_likelihood(likelihood)


@_normalise_targets.register(GaussianLikelihood)
@_normalise_targets.register(MultitaskGaussianLikelihood)
def _(likelihood: Likelihood, y: Tensor, num_outputs: int, name: str) -> Tensor:
    if y.dim() == 1 and num_outputs == 1:
        y = y.unsqueeze(-1)
    if y.dim() != 2 or y.shape[-1] != num_outputs:
        single = "(N,) or (N, 1)" if num_outputs == 1 else f"(N, {num_outputs})"
        raise ValueError(
            f"{name} must have shape {single} for {type(likelihood).__name__} with {num_outputs} output(s), "
            f"got shape {tuple(y.shape)}"
        )
    return _floating(y)


@_normalise_targets.register
def _(likelihood: LogisticLikelihood, y: Tensor, num_outputs: int, name: str) -> Tensor:
    if y.dim() == 2 and y.shape[-1] != 1:
        raise ValueError(
            f"{name} must have shape (N,) or (N, 1) for LogisticLikelihood (binary labels), "
            f"got shape {tuple(y.shape)}"
        )
    y = y.reshape(-1, 1)
    invalid = (y != 0) & (y != 1)
    if bool(invalid.any()):
        examples = torch.unique(y[invalid])[:5].tolist()
        raise ValueError(f"{name} must hold binary labels 0 or 1 for LogisticLikelihood, found {examples}")
    return _floating(y)


@_normalise_targets.register
def _(likelihood: SoftmaxLikelihood, y: Tensor, num_outputs: int, name: str) -> Tensor:
    if y.dim() == 2 and y.shape[-1] != 1:
        raise ValueError(
            f"{name} must hold integer class labels of shape (N,) for {type(likelihood).__name__}, got shape "
            f"{tuple(y.shape)} (for one-hot targets pass {name}.argmax(-1))"
        )
    y = y.reshape(-1)
    if y.is_complex() or (y.is_floating_point() and not bool((y == torch.round(y)).all())):
        raise ValueError(f"{name} must hold integer class labels for {type(likelihood).__name__}")
    invalid = (y < 0) | (y >= num_outputs)
    if bool(invalid.any()):
        examples = torch.unique(y[invalid])[:5].tolist()
        raise ValueError(
            f"{name} must hold class labels in 0..{num_outputs - 1} for {type(likelihood).__name__}, "
            f"found {examples}"
        )
    return y.long()
