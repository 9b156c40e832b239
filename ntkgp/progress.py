r"""Progress of the long passes over the data: a bar on a terminal, a one-line estimate otherwise.

Every pass over the training data (the curvature passes of KFAC, the diagonal and the full GGN, the last-layer
feature pass) takes a ``progress`` argument:

- ``None`` (the default, "auto"): a tqdm bar when standard error is a terminal; otherwise, once the first batches
  have run, one line with the estimated time of the whole pass — only for a pass estimated to take longer than
  :data:`LOG_AFTER_SECONDS` — sent to the ``"ntkgp"`` logger at level INFO when that logger is enabled for it,
  else written to standard error (as a bar would be);
- ``True``: always a tqdm bar (and no line);
- ``False``: silent.

The estimate is :math:`t_k \cdot B / k` after :math:`k` batches of :math:`B` taking :math:`t_k` seconds (the first
batch, which checks the network and fills caches, is excluded when more than one has run).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

#: An auto pass estimated to take longer than this (seconds) prints its one line.
LOG_AFTER_SECONDS = 30.0
#: The estimate is formed after this many batches, or after :data:`ESTIMATE_AFTER_SECONDS`, whichever comes first.
ESTIMATE_AFTER_BATCHES = 3
ESTIMATE_AFTER_SECONDS = 5.0

logger = logging.getLogger("ntkgp")


def check_progress(value: object, argument: str = "progress") -> bool | None:
    """``value`` after checking that it is ``True``, ``False`` or ``None`` (auto).

    Raises:
        TypeError: naming ``argument``.
    """
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{argument} must be True, False or None (auto), got {value!r}")
    return value


def _terminal() -> bool:
    stream = sys.stderr
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def format_seconds(seconds: float) -> str:
    """``seconds`` as a short human duration: ``"42 s"``, ``"3.5 min"``, ``"1.2 h"``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _announce(message: str) -> None:
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info(message)
    else:
        print(message, file=sys.stderr, flush=True)


def progress_bar(
    iterable: Iterable[T], total: int | None, desc: str, progress: bool | None, unit: str = "batch"
) -> Iterator[T]:
    """Iterate over ``iterable`` showing the pass's progress as ``progress`` asks (module docstring).

    Args:
        iterable: the batches.
        total: their number, when known (``len`` is tried otherwise); without it no estimate is formed.
        desc: the pass's name, e.g. ``"KFAC"``.
        progress: ``True`` (bar), ``False`` (silent) or ``None`` (auto).
        unit: what one item is, for the bar and the line.
    """
    check_progress(progress)
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if progress is False:
        yield from iterable
        return
    if progress is True or _terminal():
        yield from tqdm(iterable, total=total, desc=desc, unit=unit, leave=False)
        return
    yield from _estimating(iterable, total, desc, unit)


def _estimating(iterable: Iterable[T], total: int | None, desc: str, unit: str) -> Iterator[T]:
    """Yield the items; after the first ones, announce the estimated time of the pass once if it is long."""
    start = time.monotonic()
    after_first = None  # the time when the first item was done
    done = 0
    announced = total is None or total < 2
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if after_first is None:
            after_first = now
        if announced:
            continue
        elapsed = now - start
        if done >= ESTIMATE_AFTER_BATCHES or elapsed >= ESTIMATE_AFTER_SECONDS:
            announced = True
            per_item = (now - after_first) / (done - 1) if done > 1 else elapsed
            estimate = elapsed + per_item * (total - done)
            if estimate > LOG_AFTER_SECONDS:
                _announce(
                    f"ntkgp {desc}: {done} of {total} {_plural(unit)} in {format_seconds(elapsed)}; the pass will "
                    f"take about {format_seconds(estimate)} in all ({format_seconds(estimate - elapsed)} left). "
                    "progress=False silences this, progress=True shows a bar."
                )


def _plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("ch", "sh", "s", "x")) else "s")


__all__ = ["LOG_AFTER_SECONDS", "check_progress", "format_seconds", "progress_bar"]
