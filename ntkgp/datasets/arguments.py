"""Checks of the arguments every loader and generator shares, done before anything is read or drawn."""

from __future__ import annotations

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
