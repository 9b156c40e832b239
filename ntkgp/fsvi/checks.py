"""The argument checks FSVI shares: positive integers and bounded real numbers, each error naming its argument."""

from __future__ import annotations

import math
import numbers

from ..kernels.arguments import positive_int


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
