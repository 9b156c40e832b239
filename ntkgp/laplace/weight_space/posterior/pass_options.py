"""The option group every weight-space posterior's constructor shares: how its passes run (:mod:`ntkgp.option_groups`).

The curvature pass over the data goes ``batch_size`` examples at a time, the predictions ``chunk_size`` test points
at a time, and ``progress`` says whether the pass over the data shows its progress.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....option_groups import check_group

__all__ = ["PassOptions", "pass_settings"]


@dataclass(frozen=True)
class PassOptions:
    """How a weight-space posterior (:class:`~ntkgp.laplace.weight_space.KFACLaplace`, ``DiagLaplace``,
    ``FullLaplace``, ``LastLayerLaplace``, ``LastLayerKFACLaplace``, ``LastLayerDiagLaplace``, ``SubnetLaplace``)
    runs its passes: memory and progress, not what is computed.

    Attributes:
        batch_size: examples per batch of the curvature pass over the data (per Jacobian batch for the full
            posteriors); a loader's batches are its own.
        chunk_size: examples per Jacobian chunk at prediction time.
        progress: the pass over the data, and the posterior's ``predict`` over the test points (its
            ``progress``): ``None`` (auto: a bar on a terminal, else one line with a long pass's estimated time),
            ``True`` (a bar) or ``False`` (silent): :mod:`ntkgp.progress`.

    Example:
        >>> PassOptions(batch_size=256, progress=False).chunk_size
        256
    """

    batch_size: int = 64
    chunk_size: int = 256
    progress: bool | None = None


def pass_settings(options: PassOptions | None) -> tuple[int, int, bool | None]:
    """``(batch_size, chunk_size, progress)`` of ``options`` (``None``: the defaults).

    Raises:
        TypeError: ``options`` not a :class:`PassOptions` or ``None``.
    """
    options = check_group(options, PassOptions, "options")
    return options.batch_size, options.chunk_size, options.progress
