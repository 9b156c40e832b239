"""Validation of :class:`~ntkgp.kernels.NTKKernel`'s arguments, shared by its constructor, its option attributes
(``kernel.space = ...``, :class:`ntkgp.options.OptionAttribute`) and its prior-precision setter.

Every check runs before anything is built or written, and every error names the argument. The generic checks
(integers, counts, flags) are :mod:`ntkgp.validation`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gpytorch.constraints import Interval, Positive
from gpytorch.priors import Prior
from torch import nn

from ..linalg import all_finite
from ..ntk import GroupSpec
from ..ntk.checks import check_network_values
from ..ntk.inputs import check_tensor
from ..options import PriorStructure, Space, Strategy, choose
from ..progress import check_progress
from ..validation import SUPPORTED_DTYPES, check_int, count, positive_count

#: GPyTorch ``Kernel`` keywords the NTK kernel passes on (no lengthscale, ARD or ``eps``: it has none).
KERNEL_KEYWORDS = ("batch_shape", "active_dims")


@dataclass(frozen=True)
class KernelArguments:
    """The constructor's arguments after validation."""

    prior_structure: GroupSpec
    space: Space
    strategy: Strategy
    chunk_size: int
    cache_size: int
    progress: bool | None
    input_shape: tuple[int, ...] | None
    batch_shape: torch.Size
    prior_precision_prior: Prior | None
    constraint: Interval


def prior_structure_value(value: object, argument: str) -> GroupSpec:
    """A :class:`~ntkgp.options.PriorStructure` (its string) or a mapping of parameter names to groups."""
    if isinstance(value, Mapping):
        return value
    return choose(PriorStructure, value, argument).value


def input_shape_value(value: object, argument: str) -> tuple[int, ...] | None:
    """``None`` or a non-empty tuple of positive integers (an integer is a 1-tuple)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (tuple, list, torch.Size)) or not value:
        raise ValueError(f"{argument} must be a non-empty tuple of positive integers, got {value!r}")
    return tuple(check_int(s, argument, 1) for s in value)


def check_network_dtype(net: object, argument: str = "net") -> None:
    """Refuse a network whose floating parameters or buffers are not float32 or float64 (float16, bfloat16).

    Raises:
        TypeError: naming ``argument`` and the dtype, saying which dtypes work.
        ValueError: a parameter or buffer on the meta device.
    """
    if not isinstance(net, nn.Module):
        return  # the engine reports a non-module
    check_network_values(net, argument)
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        if t.is_floating_point() and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{argument} has {name!r} of dtype {t.dtype}; ntkgp computes in float32 or float64 (its "
                f"factorizations and solves have no {t.dtype} kernels and too few digits): pass a converted copy, "
                f"e.g. copy.deepcopy({argument}).float()"
            )


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
    """Validate the constructor's arguments (the same validators as the option attributes).

    Raises:
        TypeError: a wrongly typed argument or an unknown keyword.
        ValueError: an invalid value.
    """
    unknown = sorted(k for k in kwargs if k not in KERNEL_KEYWORDS)
    if unknown:
        raise TypeError(f"NTKKernel got unexpected keyword arguments {unknown}")
    prior_structure = prior_structure_value(prior_structure, "prior_structure")
    progress = check_progress(progress, "progress")
    input_shape = input_shape_value(input_shape, "input_shape")
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
        chunk_size=positive_count(chunk_size, "chunk_size"),
        cache_size=count(cache_size, "cache_size"),
        progress=progress,
        input_shape=input_shape,
        batch_shape=torch.Size(batch_shape),
        prior_precision_prior=prior_precision_prior,
        constraint=prior_precision_constraint or Positive(transform=torch.exp, inv_transform=torch.log),
    )


def kernel_input(x: object, argument: str, input_shape: tuple[int, ...] | None) -> torch.Tensor:
    """Check ``x`` and flatten trailing ``input_shape`` dimensions: ``(*batch, N, D)`` (or GPyTorch's ``(N,)``).

    Raises:
        TypeError: not a real tensor (floating point or integer).
        ValueError: a scalar, a feature count that does not fit ``input_shape``, NaN/Inf.
    """
    check_tensor(x, argument)  # floating point, or integer token ids (passed to the network as they are)
    shape = input_shape
    if shape is not None and len(shape) > 1 and x.dim() > len(shape) and tuple(x.shape[-len(shape) :]) == shape:
        x = x.flatten(-len(shape))
    if x.dim() == 0:
        raise ValueError(f"{argument} must have shape (*batch, N, D), got a scalar")
    if shape is not None and x.dim() >= 2 and x.shape[-1] != math.prod(shape):
        raise ValueError(
            f"{argument} must have shape (*batch, N, {math.prod(shape)}) or (*batch, N, "
            f"{', '.join(map(str, shape))}) for input_shape={shape}, got {tuple(x.shape)}"
        )
    if not all_finite(x):
        raise ValueError(f"{argument} contains NaN or Inf values")
    return x


def check_integer_input(engine, x: torch.Tensor, argument: str) -> None:
    """For integer inputs (token ids, passed to the network as they are), check that the network takes them
    (one forward pass of one row, once per input signature), so that a network that does not is reported naming
    ``argument`` before any pass (floating inputs are checked by the passes themselves)."""
    if not x.is_floating_point() and x.numel() > 0:
        engine.prepare(x.unsqueeze(-1)[:1] if x.dim() == 1 else x.reshape(-1, x.shape[-1])[:1], argument)


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
