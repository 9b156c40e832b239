r"""Progress of the long passes over the data: a bar on a terminal, a one-line estimate otherwise.

Every long pass takes a ``progress`` argument or option — the curvature passes of KFAC, the diagonal and the full GGN
and the last-layer feature pass; the function-space curvature's Gram; the NTK's chunk passes (Grams, diagonals,
features: ``NTKKernel``, ``NTKGP``, ``NTKEngine``); SFR's passes (its inducing inputs' features, :math:`K_{ZZ}` and
:math:`J(Z)`, the training data, the test points); the epochs of ``train_fsvi`` and ``train_marglik``
(docs/networks.md, "Long passes", lists them with their names):

- ``None`` (the default of the user-facing classes and functions, "auto"): a tqdm bar when standard error is a
  terminal, shown once the pass has run :data:`BAR_DELAY_SECONDS` (a short pass leaves no trace); otherwise, once the
  first batches have run, one line with the estimated time of the whole pass — only for a pass estimated to take
  longer than :data:`LOG_AFTER_SECONDS` — sent to the ``"ntkgp"`` logger at level INFO when that logger is enabled
  for it, else written to standard error (as a bar would be);
- ``True``: always a tqdm bar (and no line);
- ``False``: silent.

The estimate is :math:`t_k \cdot B / k` after :math:`k` of :math:`B` units (batches, chunks, points, epochs) taking
:math:`t_k` seconds (the first update, which checks the network and fills caches, is excluded when more than one has
run). :class:`Progress` is the one implementation: :func:`progress_bar` wraps an iterable in it, and a pass that
advances by uneven steps (SFR's points) updates it by hand. The chunk passes of a
:class:`~ntkgp.ntk.NetworkCore` follow its own ``progress``; a model or function that runs a pass on an engine whose
passes are otherwise silent (SFR's inducing inputs' features and :math:`K_{ZZ}`, the function-space curvature's
Gram) names it and gives it its own option for the duration of the pass (:func:`reporting`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

#: An auto pass estimated to take longer than this (seconds) prints its one line.
LOG_AFTER_SECONDS = 30.0
#: The estimate is formed after this many updates, or after :data:`ESTIMATE_AFTER_SECONDS`, whichever comes first.
ESTIMATE_AFTER_BATCHES = 3
ESTIMATE_AFTER_SECONDS = 5.0
#: An auto bar on a terminal appears once its pass has run this long (seconds).
BAR_DELAY_SECONDS = 1.0

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


class Progress:
    """The progress of one pass of ``total`` units, advanced by :meth:`update` (module docstring).

    Args:
        total: the number of units of the pass, when known; without it no estimate is formed.
        desc: the pass's name, e.g. ``"KFAC"``.
        progress: ``True`` (bar), ``False`` (silent) or ``None`` (auto).
        unit: what one unit is, for the bar and the line.

    Raises:
        TypeError: ``progress`` is not ``True``, ``False`` or ``None``.

    Example:
        >>> from ntkgp.progress import Progress
        >>> with Progress(total=10, desc="points", progress=False, unit="point") as bar:
        ...     for _ in range(5):
        ...         bar.update(2)
    """

    def __init__(self, total: int | None, desc: str, progress: bool | None, unit: str = "batch") -> None:
        check_progress(progress)
        self.total, self.desc, self.unit = total, desc, unit
        self._bar = None
        if progress is True or (progress is None and _terminal()):
            delay = 0.0 if progress else BAR_DELAY_SECONDS
            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, delay=delay)
        self._estimating = progress is None and self._bar is None and total is not None and total >= 2
        self._start = time.monotonic()
        self._first: tuple[float, int] | None = None  # the time and units when the first update was done
        self._updates = 0
        self._done = 0

    def update(self, n: int = 1) -> None:
        """``n`` more units are done."""
        self._done += n
        self._updates += 1
        if self._bar is not None:
            self._bar.update(n)
        if not self._estimating:
            return
        now = time.monotonic()
        if self._first is None:
            self._first = (now, self._done)
        elapsed = now - self._start
        if self._updates >= ESTIMATE_AFTER_BATCHES or elapsed >= ESTIMATE_AFTER_SECONDS:
            self._estimating = False
            since, units = self._first
            per_unit = (now - since) / (self._done - units) if self._done > units else elapsed / max(self._done, 1)
            estimate = elapsed + per_unit * max(self.total - self._done, 0)
            if estimate > LOG_AFTER_SECONDS:
                _announce(
                    f"ntkgp {self.desc}: {self._done} of {self.total} {_plural(self.unit)} in "
                    f"{format_seconds(elapsed)}; the pass will take about {format_seconds(estimate)} in all "
                    f"({format_seconds(estimate - elapsed)} left). progress=False silences this, progress=True "
                    "shows a bar."
                )

    def set_postfix(self, **values) -> None:
        """Show ``values`` beside the bar (nothing without a bar)."""
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def close(self) -> None:
        """End the pass (removes the bar)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._estimating = False

    def __enter__(self) -> Progress:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(
    iterable: Iterable[T], total: int | None, desc: str, progress: bool | None, unit: str = "batch"
) -> Iterator[T]:
    """Iterate over ``iterable`` showing the pass's progress as ``progress`` asks (module docstring), one unit per
    item (:class:`Progress`).

    Args:
        iterable: the batches.
        total: their number, when known (``len`` is tried otherwise); without it no estimate is formed.
        desc: the pass's name, e.g. ``"KFAC"``.
        progress: ``True`` (bar), ``False`` (silent) or ``None`` (auto).
        unit: what one item is, for the bar and the line.
    """
    check_progress(progress)
    if progress is False:
        yield from iterable
        return
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with Progress(total, desc, progress, unit) as bar:
        for item in iterable:
            yield item
            bar.update(1)


@contextmanager
def reporting(core, progress: bool | None, name: str) -> Iterator[None]:
    """Within the block, the chunk passes of ``core`` (a :class:`~ntkgp.ntk.NetworkCore`, e.g. ``engine.core``)
    show their progress as ``progress`` asks, whatever the core's own ``progress``, and are called
    ``"name (pass)"`` (e.g. ``"SFR K_ZZ (Gram)"``); the core's own setting is restored after. For a model's or a
    function's pass run on an engine whose other passes stay silent (the engine is used by one call at a time).

    Raises:
        TypeError: ``progress`` is not ``True``, ``False`` or ``None``.

    Example:
        >>> import torch
        >>> from ntkgp.ntk import NTKEngine
        >>> from ntkgp.progress import reporting
        >>> engine = NTKEngine(torch.nn.Linear(3, 2), chunk_size=2)
        >>> with reporting(engine.core, False, "example"):
        ...     grams = engine.group_grams(torch.randn(5, 3))
        >>> engine.core.progress
        False
    """
    check_progress(progress)
    saved = core.progress, getattr(core, "pass_name", None)
    core.progress, core.pass_name = progress, name
    try:
        yield
    finally:
        core.progress, core.pass_name = saved


def _plural(unit: str) -> str:
    if unit == "batch":
        return "batches"
    return unit + ("es" if unit.endswith(("sh", "s", "x")) else "s")


__all__ = [
    "BAR_DELAY_SECONDS", "LOG_AFTER_SECONDS", "Progress", "check_progress", "format_seconds", "progress_bar",
    "reporting",
]
