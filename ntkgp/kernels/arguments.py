"""Validation of :class:`~ntkgp.kernels.NTKKernel`'s arguments, shared by its constructor and its setter.

Every check runs before anything is built or written, and every error names the argument.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gpytorch.constraints import Interval, Positive
from gpytorch.priors import Prior

from ..ntk import GroupSpec
from ..options import PriorStructure, Space, Strategy, choose, renamed_argument

_REPRESENTATION_TO_SPACE = {"auto": "auto", "dense": "function", "root": "weight"}
#: GPyTorch ``Kernel`` keywords the NTK kernel passes on (no lengthscale, ARD or ``eps``: it has none).
KERNEL_KEYWORDS = ("batch_shape", "active_dims")


@dataclass(frozen=True)
class KernelArguments:
    """The constructor's arguments after validation (deprecated names resolved)."""

    prior_structure: GroupSpec
    space: Space
    strategy: Strategy
    chunk_size: int
    cache_size: int
    progress: bool
    input_shape: tuple[int, ...] | None
    batch_shape: torch.Size
    prior_precision_prior: Prior | None
    constraint: Interval


def check_int(value: object, argument: str, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) ``>= minimum``; else ``ValueError`` naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{argument} must be an integer >= {minimum}, got {value!r}")
    return value


def kernel_arguments(
    prior_structure: object,
    input_shape: object,
    chunk_size: object,
    strategy: object,
    space: object,
    prior_precision_prior: object,
    prior_precision_constraint: object,
    cache_size: object,
    progress: object,
    kwargs: dict,
) -> KernelArguments:
    """Validate the constructor's arguments; pops deprecated names from ``kwargs``.

    Raises:
        TypeError: a wrongly typed argument, an unknown keyword, or a new and a deprecated name together.
        ValueError: an invalid value.
    """
    prior_structure = renamed_argument(kwargs, "groups", "prior_structure", prior_structure, "layer")
    if "representation" in kwargs:
        representation = kwargs.pop("representation")
        if space != "auto":
            raise TypeError("pass space= only; representation= is its deprecated name")
        if representation not in _REPRESENTATION_TO_SPACE:
            raise ValueError(f"representation must be one of 'auto', 'dense', 'root', got {representation!r}")
        space = _REPRESENTATION_TO_SPACE[representation]
        warnings.warn(
            f"representation= is deprecated; use space={space!r} ('dense' is 'function', 'root' is 'weight')",
            DeprecationWarning,
            stacklevel=3,
        )
    unknown = sorted(k for k in kwargs if k not in KERNEL_KEYWORDS)
    if unknown:
        raise TypeError(f"NTKKernel got unexpected keyword arguments {unknown}")
    if not isinstance(prior_structure, Mapping):
        prior_structure = choose(PriorStructure, prior_structure, "prior_structure").value
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {progress!r}")
    if input_shape is not None:
        if isinstance(input_shape, int) and not isinstance(input_shape, bool):
            input_shape = (input_shape,)
        if not isinstance(input_shape, (tuple, list, torch.Size)) or not input_shape:
            raise ValueError(
                f"input_shape must be a non-empty tuple of positive integers, got {input_shape!r}"
            )
        input_shape = tuple(check_int(s, "input_shape", 1) for s in input_shape)
    batch_shape = kwargs.get("batch_shape", torch.Size([]))
    if not isinstance(batch_shape, (tuple, list, torch.Size)) or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in batch_shape
    ):
        raise ValueError(f"batch_shape must be a tuple of positive integers, got {batch_shape!r}")
    if prior_precision_prior is not None and not isinstance(prior_precision_prior, Prior):
        raise TypeError(
            f"prior_precision_prior must be a gpytorch Prior, got {type(prior_precision_prior).__name__}"
        )
    if prior_precision_constraint is not None and not isinstance(prior_precision_constraint, Interval):
        raise TypeError(
            "prior_precision_constraint must be a gpytorch constraint, got "
            f"{type(prior_precision_constraint).__name__}"
        )
    return KernelArguments(
        prior_structure=prior_structure,
        space=choose(Space, space, "space"),
        strategy=choose(Strategy, strategy, "strategy"),
        chunk_size=check_int(chunk_size, "chunk_size", 1),
        cache_size=check_int(cache_size, "cache_size", 0),
        progress=progress,
        input_shape=input_shape,
        batch_shape=torch.Size(batch_shape),
        prior_precision_prior=prior_precision_prior,
        constraint=prior_precision_constraint or Positive(transform=torch.exp, inv_transform=torch.log),
    )


def prior_precision_tensor(
    value: object,
    group_names: tuple[str, ...],
    batch_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    constraint: Interval,
    argument: str = "prior_precision",
) -> torch.Tensor:
    """``value`` as a ``(*batch_shape, G)`` tensor of prior precisions (what constructor and setter accept).

    Accepts a positive finite float, one value per group ``(G,)``, or ``(*batch_shape, G)``, inside
    ``constraint``.

    Raises:
        TypeError: not a real number or tensor.
        ValueError: wrong shape, not positive and finite, or outside the constraint; naming ``argument``.
    """
    groups = len(group_names)
    if isinstance(value, bool) or (
        isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.is_complex())
    ):
        raise TypeError(f"{argument} must be a float or a real tensor, got {value!r}")
    try:
        tensor = torch.as_tensor(
            value.detach() if isinstance(value, torch.Tensor) else value, dtype=dtype, device=device
        )
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{argument} must be a float or a real tensor, got {value!r}") from error
    expected = torch.Size([*batch_shape, groups])
    if tensor.dim() == 0 or tensor.shape == (groups,):
        tensor = tensor.expand(expected)
    elif tensor.shape != expected:
        batched = f", or shape {tuple(expected)}" if batch_shape else ""
        raise ValueError(
            f"{argument} must be a float or have one value per group ({groups}: {list(group_names)})"
            f"{batched}, "
            f"got shape {tuple(tensor.shape)}"
        )
    if not (torch.isfinite(tensor).all() and (tensor > 0).all()):
        raise ValueError(f"{argument} must be positive and finite, got {tensor.tolist()}")
    if not constraint.check(tensor) or not torch.isfinite(constraint.inverse_transform(tensor)).all():
        raise ValueError(f"{argument} must lie inside its constraint {constraint}, got {tensor.tolist()}")
    return tensor.clone()
