"""The argument checks FSVI shares: positive integers and bounded real numbers, each error naming its argument."""

from __future__ import annotations

import math
import numbers


def positive_int(value: object, argument: str, allow_none: bool = False) -> int | None:
    """``value`` as an ``int >= 1`` (any ``numbers.Integral`` but ``bool``; ``None`` too with ``allow_none``).

    Raises:
        ValueError: naming ``argument``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{argument} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


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
