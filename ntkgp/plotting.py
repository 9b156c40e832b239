"""Figures of predictive distributions: 1-D regression bands, 2-D class-probability and uncertainty maps.

matplotlib is optional (the ``examples`` extra, ``pip install 'ntkgp[examples]'``); it is imported when a
figure is made, never at ``import ntkgp``. Figures are built with the object-oriented
:class:`matplotlib.figure.Figure` API, so no pyplot state or backend is touched and nothing is shown on
screen: every figure is written to a file by :func:`save_figure`.

All functions take torch tensors (any dtype, on the CPU) and draw onto a given ``Axes``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .metrics import predictive_entropy

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "Grid2D",
    "grid_2d",
    "new_figure",
    "plot_predicted_vs_observed",
    "plot_probability_map",
    "plot_regression",
    "plot_reliability",
    "plot_uncertainty_map",
    "require_matplotlib",
    "save_figure",
]

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


def _np(t: Tensor):
    return t.detach().cpu().double().numpy()


def plot_regression(
    ax: Axes,
    x_grid: Tensor,
    mean: Tensor,
    std: Tensor,
    *,
    x_train: Tensor,
    y_train: Tensor,
    x_new: Tensor | None = None,
    y_new: Tensor | None = None,
    inducing: Tensor | None = None,
    title: str = "",
) -> None:
    r"""A 1-D predictive: the mean and the band :math:`\mu \pm 2\sigma`, with the data.

    Args:
        ax: the axes to draw on.
        x_grid: ``(G,)`` or ``(G, 1)`` sorted inputs.
        mean, std: ``(G,)`` (or ``(G, 1)``) predictive mean and standard deviation at ``x_grid``.
        x_train, y_train: training data, ``(N, 1)``; drawn as dots.
        x_new, y_new: a second batch (e.g. data added by an update), drawn as crosses.
        inducing: ``(M, 1)`` inducing inputs, marked on the lower edge of the axes.
        title: the panel title.
    """
    x, mu, sd = _np(x_grid).ravel(), _np(mean).ravel(), _np(std).ravel()
    ax.fill_between(x, mu - 2 * sd, mu + 2 * sd, color="C0", alpha=0.25, lw=0, label=r"mean $\pm$ 2 std")
    ax.plot(x, mu, color="C0", lw=1.5, label="mean")
    ax.scatter(_np(x_train).ravel(), _np(y_train).ravel(), s=8, color="k", alpha=0.6, label="training data")
    if x_new is not None and y_new is not None:
        ax.scatter(_np(x_new).ravel(), _np(y_new).ravel(), s=22, marker="x", color="C3", label="new batch")
    if inducing is not None:
        ax.plot(_np(inducing).ravel(), [0.0] * inducing.shape[0], "|", color="C2", ms=10, mew=1.5,
                transform=ax.get_xaxis_transform(), label="inducing inputs")
    ax.set_xlim(x.min(), x.max())
    ax.set_title(title)
    ax.legend(loc="best", fontsize="x-small")


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


def _class_map(ax: Axes, grid: Grid2D, values: Tensor, x: Tensor, y: Tensor, cmap: str, vmax: float,
               label: str, title: str, marked: Tensor | None) -> None:
    """Filled contours of ``values`` on ``grid`` (a fixed colour scale from 0 to ``vmax``), points on top."""
    levels = torch.linspace(0.0, vmax, 21).tolist()
    image = ax.contourf(_np(grid.x1), _np(grid.x2), _np(values).reshape(grid.x1.shape).clip(0.0, vmax),
                        levels=levels, cmap=cmap)
    ax.figure.colorbar(image, ax=ax, label=label)
    ax.scatter(_np(x[:, 0]), _np(x[:, 1]), c=_np(y), cmap="coolwarm", s=10, edgecolors="k", linewidths=0.3)
    if marked is not None:
        ax.scatter(_np(marked[:, 0]), _np(marked[:, 1]), s=40, marker="o", facecolors="none", edgecolors="lime",
                   linewidths=1.0, label="new batch")
        ax.legend(loc="lower left", fontsize="x-small")
    ax.set_title(title)
    ax.set_xlim(float(grid.x1.min()), float(grid.x1.max()))
    ax.set_ylim(float(grid.x2.min()), float(grid.x2.max()))


def plot_probability_map(ax: Axes, grid: Grid2D, probs: Tensor, *, x: Tensor, y: Tensor, title: str = "",
                         marked: Tensor | None = None) -> None:
    """Class probabilities on a 2-D grid: :math:`P(y=1)` with the 0.5 contour (binary), else the top-class one.

    Args:
        ax: the axes to draw on.
        grid: from :func:`grid_2d`.
        probs: ``(R*R,)`` or ``(R*R, 1)`` with :math:`P(y=1)`, or ``(R*R, C)`` class probabilities.
        x, y: the data ``(N, 2)`` and labels ``(N,)`` drawn on top.
        title: the panel title.
        marked: ``(B, 2)`` inputs to circle (e.g. a new batch).
    """
    if probs.dim() == 2 and probs.shape[1] > 1:
        _class_map(ax, grid, probs.max(dim=1).values, x, y, "viridis", 1.0, "top-class probability", title, marked)
        return
    values = probs.reshape(-1)
    _class_map(ax, grid, values, x, y, "RdBu_r", 1.0, "P(y = 1)", title, marked)
    ax.contour(_np(grid.x1), _np(grid.x2), _np(values).reshape(grid.x1.shape), levels=[0.5], colors="k",
               linewidths=1.0)


def plot_uncertainty_map(ax: Axes, grid: Grid2D, probs: Tensor, *, x: Tensor, y: Tensor, title: str = "",
                         marked: Tensor | None = None) -> None:
    r"""The predictive entropy :math:`H = -\sum_c p_c \log p_c` (nats) on a 2-D grid.

    The colour scale ends at :math:`\log C`, the entropy of a uniform guess.

    Args:
        ax: the axes to draw on.
        grid: from :func:`grid_2d`.
        probs: ``(R*R,)`` or ``(R*R, 1)`` with :math:`P(y=1)`, or ``(R*R, C)`` class probabilities.
        x, y: the data ``(N, 2)`` and labels ``(N,)`` drawn on top.
        title: the panel title.
        marked: ``(B, 2)`` inputs to circle (e.g. a new batch).
    """
    entropy = predictive_entropy(probs)
    num_classes = probs.shape[1] if probs.dim() == 2 and probs.shape[1] > 1 else 2
    _class_map(ax, grid, entropy, x, y, "magma", math.log(num_classes),
               "predictive entropy (nats)", title, marked)


def plot_predicted_vs_observed(ax: Axes, mean: Tensor, std: Tensor, y: Tensor, title: str = "") -> None:
    """Predicted mean with 2-std error bars against the observed targets (regression with many inputs).

    Args:
        ax: the axes to draw on.
        mean: ``(N,)`` predictive means.
        std: ``(N,)`` predictive standard deviations.
        y: ``(N,)`` observed targets.
        title: the panel title.
    """
    observed, mu = _np(y).ravel(), _np(mean).ravel()
    ax.errorbar(observed, mu, yerr=2 * _np(std).ravel(), fmt="o", ms=3, alpha=0.6, elinewidth=0.8)
    low, high = min(observed.min(), mu.min()), max(observed.max(), mu.max())
    ax.plot([low, high], [low, high], "k--", lw=1)
    ax.set_xlabel("observed")
    ax.set_ylabel(r"predicted mean $\pm$ 2 std")
    ax.set_title(title)


def plot_reliability(ax: Axes, probs: Tensor, y: Tensor, num_bins: int = 10, title: str = "") -> None:
    """Reliability diagram: accuracy per equal-width bin of the top-class probability (the bins of
    :func:`ntkgp.metrics.expected_calibration_error`), with each bin's mean confidence as a dot.

    Args:
        ax: the axes to draw on.
        probs: ``(N, C)``, or ``(N,)`` / ``(N, 1)`` with :math:`P(y=1)`.
        y: ``(N,)`` labels.
        num_bins: the number of bins.
        title: the panel title.
    """
    if probs.dim() == 1 or probs.shape[-1] == 1:
        p1 = probs.reshape(-1)
        probs = torch.stack([1 - p1, p1], dim=-1)
    confidence, prediction = probs.max(dim=1)
    correct = (prediction == y.reshape(-1)).double()
    bins = torch.clamp(torch.ceil(confidence * num_bins).long() - 1, 0, num_bins - 1)
    width = 1.0 / num_bins
    for b in range(num_bins):
        members = bins == b
        if members.any():
            ax.bar((b + 0.5) * width, float(correct[members].mean()), width=0.9 * width, color="C0", alpha=0.7)
            ax.plot(float(confidence[members].mean()), float(correct[members].mean()), "o", color="C1", ms=4)
    ax.plot([0, 1], [0, 1], "k--", lw=1)
    ax.set_xlabel("confidence (bars: accuracy per bin; dots: mean confidence)")
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(title)
