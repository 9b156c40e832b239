"""2-D classification maps: class probabilities, predictive entropy and the change made by an update, with
the data drawn as white-edged class markers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..metrics import predictive_entropy
from .figures import to_numpy as _np

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Grid2D", "class_legend_handles", "grid_2d", "plot_change_map", "plot_probability_map",
           "plot_uncertainty_map"]


class Grid2D(NamedTuple):
    """A regular grid over a 2-D input region: ``points`` ``(R*R, 2)``, meshgrids ``x1``, ``x2`` ``(R, R)``."""

    points: Tensor
    x1: Tensor
    x2: Tensor


def grid_2d(x: Tensor, resolution: int = 60, margin: float = 0.2) -> Grid2D:
    """A ``resolution x resolution`` grid covering the points ``x``.

    Args:
        x: ``(N, 2)`` inputs.
        resolution: grid points per axis.
        margin: how far the grid extends beyond the points, as a fraction of their range per axis.

    Returns:
        The :class:`Grid2D`.

    Raises:
        ValueError: if ``x`` is not ``(N, 2)``.

    Example:
        >>> grid_2d(torch.tensor([[0.0, 0.0], [1.0, 2.0]]), resolution=5).points.shape
        torch.Size([25, 2])
    """
    if x.dim() != 2 or x.shape[1] != 2:
        raise ValueError(f"x must have shape (N, 2), got {tuple(x.shape)}")
    low, high = x.min(0).values, x.max(0).values
    pad = margin * (high - low)
    axes = [torch.linspace(lo - p, hi + p, resolution, dtype=x.dtype) for lo, hi, p in zip(low, high, pad)]
    x1, x2 = torch.meshgrid(*axes, indexing="xy")
    return Grid2D(torch.stack([x1.reshape(-1), x2.reshape(-1)], dim=-1), x1, x2)


#: Marker and colour of each class in the 2-D maps: white-edged, so that a point stands out from a background
#: of its own colour. The two binary classes take the ends of the probability map's colours.
CLASS_MARKERS = ("o", "^", "s", "D", "v", "P", "X", "p", "h", "*")
BINARY_COLORS = ("#2166ac", "#b2182b")


def _class_colors(num_classes: int) -> list:
    if num_classes == 2:
        return list(BINARY_COLORS)
    from matplotlib import colormaps

    return [colormaps["tab10"](c % 10) for c in range(num_classes)]


def _num_classes(probs: Tensor) -> int:
    return probs.shape[1] if probs.dim() == 2 and probs.shape[1] > 1 else 2


def class_legend_handles(num_classes: int, *, new_batch: bool = False) -> list:
    """Legend entries of the classes' markers (and of the new-batch ring) as the 2-D maps draw them."""
    from matplotlib.lines import Line2D

    colors = _class_colors(num_classes)
    handles = [Line2D([], [], ls="none", marker=CLASS_MARKERS[c % len(CLASS_MARKERS)], ms=6, mfc=colors[c],
                      mec="white", mew=0.8, label=f"class {c}") for c in range(num_classes)]
    if new_batch:
        handles.append(Line2D([], [], ls="none", marker="o", ms=10, mfc="none", mec="lime", mew=1.4,
                              label="new batch (added by the update)"))
    return handles


def _scatter(ax: Axes, x: Tensor | None, y: Tensor | None, num_classes: int, marked: Tensor | None) -> None:
    """The points, one marker and colour per class, and rings (black under lime) around ``marked``."""
    if x is not None and y is not None:
        colors, labels = _class_colors(num_classes), y.reshape(-1)
        for c in range(num_classes):
            members = labels == c
            if members.any():
                ax.scatter(_np(x[members, 0]), _np(x[members, 1]), s=18, marker=CLASS_MARKERS[c % len(CLASS_MARKERS)],
                           color=colors[c], edgecolors="white", linewidths=0.6, zorder=3)
    if marked is not None:
        for color, width in (("black", 2.4), ("lime", 1.1)):
            ax.scatter(_np(marked[:, 0]), _np(marked[:, 1]), s=70, marker="o", facecolors="none", edgecolors=color,
                       linewidths=width, zorder=4)


def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= ``value`` (> 0)."""
    power = 10.0 ** math.floor(math.log10(value))
    return next(m * power for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * power >= value * (1 - 1e-9))


def _finish(ax: Axes, grid: Grid2D, title: str, legend: bool, num_classes: int, marked: Tensor | None) -> None:
    if legend:
        ax.legend(handles=class_legend_handles(num_classes, new_batch=marked is not None), loc="lower left",
                  fontsize="x-small", framealpha=0.8)
    ax.set_title(title)
    ax.set_xlim(float(grid.x1.min()), float(grid.x1.max()))
    ax.set_ylim(float(grid.x2.min()), float(grid.x2.max()))


def _class_map(ax: Axes, grid: Grid2D, values: Tensor, x: Tensor | None, y: Tensor | None, cmap: str,
               limits: tuple[float, float], ticks: Sequence[float] | None, label: str, title: str,
               marked: Tensor | None, num_classes: int, legend: bool) -> None:
    """Filled contours of ``values`` on ``grid`` (a fixed colour scale over ``limits``), points on top."""
    from matplotlib.ticker import MaxNLocator

    low, high = limits
    levels = torch.linspace(low, high, 21).tolist()
    image = ax.contourf(_np(grid.x1), _np(grid.x2), _np(values).reshape(grid.x1.shape).clip(low, high),
                        levels=levels, cmap=cmap)
    if ticks is None:
        ticks = MaxNLocator(nbins=5, steps=[1, 2, 5, 10])
    ax.figure.colorbar(image, ax=ax, label=label, ticks=ticks)
    _scatter(ax, x, y, num_classes, marked)
    _finish(ax, grid, title, legend, num_classes, marked)


def plot_probability_map(ax: Axes, grid: Grid2D, probs: Tensor, *, x: Tensor, y: Tensor, title: str = "",
                         marked: Tensor | None = None, legend: bool = True) -> None:
    """Class probabilities on a 2-D grid: :math:`P(y=1)` with the 0.5 contour (binary), else the top-class one.

    Args:
        ax: the axes to draw on.
        grid: from :func:`grid_2d`.
        probs: ``(R*R,)`` or ``(R*R, 1)`` with :math:`P(y=1)`, or ``(R*R, C)`` class probabilities.
        x, y: the data ``(N, 2)`` and labels ``(N,)`` drawn on top (a white-edged marker per class).
        title: the panel title.
        marked: ``(B, 2)`` inputs to ring (e.g. a new batch).
        legend: a legend of the classes' markers in the panel.
    """
    num_classes = _num_classes(probs)
    if num_classes > 2:
        _class_map(ax, grid, probs.max(dim=1).values, x, y, "viridis", (0.0, 1.0), [0.0, 0.25, 0.5, 0.75, 1.0],
                   "top-class probability", title, marked, num_classes, legend)
        return
    values = probs.reshape(-1)
    _class_map(ax, grid, values, x, y, "RdBu_r", (0.0, 1.0), [0.0, 0.25, 0.5, 0.75, 1.0], "P(y = 1)", title,
               marked, num_classes, legend)
    ax.contour(_np(grid.x1), _np(grid.x2), _np(values).reshape(grid.x1.shape), levels=[0.5], colors="k",
               linewidths=1.0)


def plot_uncertainty_map(ax: Axes, grid: Grid2D, probs: Tensor, *, x: Tensor, y: Tensor, title: str = "",
                         marked: Tensor | None = None, legend: bool = True) -> None:
    r"""The predictive entropy :math:`H = -\sum_c p_c \log p_c` (nats) on a 2-D grid.

    The colour scale ends at :math:`\log C`, the entropy of a uniform guess.

    Args:
        ax: the axes to draw on.
        grid: from :func:`grid_2d`.
        probs: ``(R*R,)`` or ``(R*R, 1)`` with :math:`P(y=1)`, or ``(R*R, C)`` class probabilities.
        x, y: the data ``(N, 2)`` and labels ``(N,)`` drawn on top (a white-edged marker per class).
        title: the panel title.
        marked: ``(B, 2)`` inputs to ring (e.g. a new batch).
        legend: a legend of the classes' markers in the panel.
    """
    num_classes = _num_classes(probs)
    top = math.log(num_classes)
    _class_map(ax, grid, predictive_entropy(probs), x, y, "magma", (0.0, top), None,
               f"predictive entropy (nats; uniform: {top:.2f})", title, marked, num_classes, legend)


def plot_change_map(ax: Axes, grid: Grid2D, before: Tensor, after: Tensor, *, label: str, title: str = "",
                    marked: Tensor | None = None, y_marked: Tensor | None = None, num_classes: int = 2,
                    legend: bool = True) -> None:
    """``after - before`` of a quantity on a 2-D grid (e.g. :math:`P(y=1)` or the entropy around an update),
    on a diverging colour scale symmetric about 0 that ends at a round number.

    Args:
        ax: the axes to draw on.
        grid: from :func:`grid_2d`.
        before, after: ``(R*R,)`` values on the grid.
        label: the colour bar's label.
        title: the panel title.
        marked: ``(B, 2)`` inputs to ring (e.g. the new batch that caused the change).
        y_marked: ``(B,)`` their labels (their class markers are drawn inside the rings).
        num_classes: the number of classes (for the markers and the legend).
        legend: a legend of the markers in the panel.
    """
    change = (after - before).reshape(-1)
    top = _nice_ceiling(max(float(change.abs().max()), 1e-3))
    _class_map(ax, grid, change, marked, y_marked, "PuOr_r", (-top, top), [-top, -top / 2, 0.0, top / 2, top],
               label, title, marked, num_classes, legend)
