"""Figures without pyplot: :func:`new_figure`, :func:`save_figure` and the matplotlib check."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["new_figure", "require_matplotlib", "save_figure"]

_MISSING_MATPLOTLIB = "ntkgp.plotting needs matplotlib; install the examples extra: pip install 'ntkgp[examples]'"


def require_matplotlib() -> None:
    """Check that matplotlib is importable.

    Raises:
        ImportError: naming the ``examples`` extra when matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(_MISSING_MATPLOTLIB) from error


def new_figure(nrows: int, ncols: int, panel_size: tuple[float, float] = (4.6, 3.6)) -> tuple[Figure, list]:
    """A figure with an ``nrows x ncols`` grid of axes.

    Args:
        nrows: rows of panels.
        ncols: columns of panels.
        panel_size: width and height of one panel, in inches.

    Returns:
        The :class:`~matplotlib.figure.Figure` and the axes as a nested list ``axes[row][col]``.

    Raises:
        ImportError: naming the ``examples`` extra when matplotlib is not installed.
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [list(row) for row in axes]


def save_figure(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as an image, creating parent folders.

    Args:
        fig: the figure.
        path: the file; its suffix gives the format (e.g. ``.png``).
        dpi: resolution.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def to_numpy(t: Tensor):
    """``t`` as a float64 NumPy array (detached, on the CPU)."""
    return t.detach().cpu().double().numpy()
