"""The generic argument checks every package of ntkgp shares: integers (optional ones too), counts, positive and
bounded real numbers, flags, dtypes and mappings keyed by parameter name.

Each returns the checked value in its plain Python type (``int``, ``float``, ``bool``, ``torch.dtype``) and raises,
naming the argument, before anything is built or written. Numbers of any ``numbers.Integral`` / ``numbers.Real``
type (numpy's included) are accepted, ``bool`` never (``True`` is not a count). Domain checks (a network's
parameters, inputs of the NTK engine, likelihoods, ...) stay with their domain; this module imports nothing else
of ntkgp, so that every package can use it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "check_int",
    "count",
    "exact_names",
    "flag",
    "float_dtype",
    "integer",
    "non_negative",
    "optional_positive_int",
    "positive_count",
    "positive_float",
    "positive_int",
    "real_number",
]

#: The dtypes ntkgp computes in (half precisions cannot be factorized or solved with).
SUPPORTED_DTYPES = (torch.float32, torch.float64)


def _is_integral(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value: object, argument: str, minimum: int) -> int:
    """``value`` as an ``int`` if it is an integer (any ``numbers.Integral`` such as ``numpy.int64``, not a bool)
    ``>= minimum``.

    Raises:
        ValueError: naming ``argument`` and ``minimum``.
    """
    return integer(value, argument, minimum)


def integer(
    value: object, argument: str, minimum: int | None = None, maximum: int | None = None, allow_none: bool = False,
) -> int | None:
    """``value`` as an ``int`` if it is an integer (any ``numbers.Integral``, not a bool) in ``minimum..maximum``
    (either end optional); ``None`` too with ``allow_none`` (an optional count or seed).

    Raises:
        ValueError: naming ``argument`` and the range.
    """
    if value is None and allow_none:
        return None
    low_ok = _is_integral(value) and (minimum is None or value >= minimum)
    if not low_ok or (maximum is not None and value > maximum):
        alternative = "None or " if allow_none else ""
        low = "" if minimum is None else f" >= {_bound(minimum)}"
        high = "" if maximum is None else f" and <= {_bound(maximum)}" if minimum is not None else f" <= {_bound(maximum)}"
        raise ValueError(f"{argument} must be {alternative}an integer{low}{high}; got {value!r}")
    return int(value)


def _bound(value: int) -> str:
    """A range's end as a reader takes it in: ``2**64 - 1`` rather than ``18446744073709551615``."""
    if abs(value) < 2**31:
        return str(value)
    k = round(math.log2(abs(value)))
    rest = abs(value) - 2**k
    text = f"2**{k}" + ("" if rest == 0 else f" + {rest}" if rest > 0 else f" - {-rest}")
    return text if value > 0 else f"-({text})" if rest else f"-{text}"


def positive_int(value: object, argument: str, allow_none: bool = False) -> int | None:
    """``value`` as an ``int >= 1`` (any ``numbers.Integral`` such as ``numpy.int64``, not a bool; ``None`` too with
    ``allow_none``): the one check of a positive count that the models, FSVI, training and the kernels share.

    Raises:
        ValueError: naming ``argument``.
    """
    if value is None and allow_none:
        return None
    if not _is_integral(value) or value < 1:
        raise ValueError(f"{argument} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def optional_positive_int(value: object, argument: str) -> int | None:
    """``None`` or a positive integer (:func:`positive_int`)."""
    return positive_int(value, argument, allow_none=True)


def positive_count(value: object, argument: str) -> int:
    """An integer ``>= 1`` (``chunk_size``)."""
    return check_int(value, argument, 1)


def count(value: object, argument: str) -> int:
    """An integer ``>= 0`` (``cache_size``; 0 disables the cache)."""
    return check_int(value, argument, 0)


def flag(value: object, argument: str, error: type[Exception] = TypeError) -> bool:
    """``value`` if it is ``True`` or ``False`` (``progress``, ``learn_likelihood``; ``1`` is not a flag).

    Raises:
        TypeError: (or ``error``) naming ``argument``.
    """
    if not isinstance(value, bool):
        raise error(f"{argument} must be a bool (True or False), got {value!r}")
    return value


def real_number(
    value: object, argument: str, low: float = 0.0, high: float = math.inf, low_open: bool = False,
    high_open: bool = True,
) -> float:
    """``value`` as a ``float`` in the interval from ``low`` to ``high`` (open at an end where ``*_open``; any
    ``numbers.Real`` but ``bool``; never NaN).

    Raises:
        ValueError: naming ``argument`` and the interval.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{argument} must be a number in {interval}, got {value!r}")
    return float(value)


def positive_float(value: object, argument: str) -> float:
    """``value`` as a positive finite ``float``: any ``numbers.Real`` (numpy's included) but ``bool``.

    Raises:
        ValueError: naming ``argument``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{argument} must be a positive finite number, got {value!r}")
    return float(value)


def non_negative(value: object, argument: str) -> float:
    """``value`` as a ``float`` if it is a finite real number ``>= 0`` (any ``numbers.Real`` or a one-element real
    tensor, not ``bool`` or a string).

    Raises:
        ValueError: naming ``argument``.
    """
    if torch.is_tensor(value) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{argument} must be a finite number >= 0; got {value!r}")
    return float(value)


def exact_names(
    mapping: Mapping, names: Iterable[str], argument: str, what: str = "every trainable parameter"
) -> None:
    """Raise unless the keys of ``mapping`` (a ``prior_mean`` or ``prior_structure`` by parameter name, tangents)
    are exactly ``names``.

    Raises:
        ValueError: naming ``argument``, the names missing from it and the keys that are not in ``names``.
    """
    names = list(names)
    known = set(names)
    missing = [n for n in names if n not in mapping]
    unknown = [n for n in mapping if n not in known]
    if missing or unknown:
        raise ValueError(f"{argument} must name {what} exactly: missing {missing}, unknown {unknown}")


def float_dtype(dtype: object, argument: str = "dtype") -> torch.dtype:
    """``dtype`` if it is a floating-point ``torch.dtype``.

    An integer, bool or complex dtype would silently truncate (a regression target in ``int64`` is all zeros) or
    change the meaning of the values, so it is refused.

    Raises:
        ValueError: naming ``argument``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"{argument} must be a floating-point torch.dtype (torch.float32, torch.float64, ...); got {dtype!r}"
        )
    return dtype
