"""Checks of the arguments every loader and generator shares, done before anything is read or drawn."""

from __future__ import annotations

import math
import numbers

import torch


def _float_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """Return ``dtype`` if it is a floating-point ``torch.dtype``, else raise ``ValueError`` naming ``name``.

    An integer, bool or complex dtype would silently truncate (``gap_regression`` in ``int64`` is all zeros) or
    change the meaning of the values, so it is refused.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"{name} must be a floating-point torch.dtype (torch.float32, torch.float64, ...); got {dtype!r}"
        )
    return dtype


def _integer(value: object, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as an ``int`` if it is an integer (any ``numbers.Integral``, numpy's included, but not
    ``bool``) in ``minimum..maximum``, else raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "" if minimum is None else f" >= {minimum}"
        high = "" if maximum is None else f" and <= {maximum}" if minimum is not None else f" <= {maximum}"
        raise ValueError(f"{name} must be an integer{low}{high}; got {value!r}")
    return value


def _non_negative(value: object, name: str) -> float:
    """Return ``value`` as a ``float`` if it is a finite real number ``>= 0`` (any ``numbers.Real`` or a one-element
    real tensor, not ``bool`` or a string), else raise ``ValueError`` naming ``name``."""
    if torch.is_tensor(value) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
    return float(value)
