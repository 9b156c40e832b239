"""Figures of predictive distributions: 1-D regression bands, 2-D class-probability, uncertainty and change maps.

matplotlib is optional (the ``examples`` extra, ``pip install 'ntkgp[examples]'``); it is imported when a
figure is made, never at ``import ntkgp``. Figures are built with the object-oriented
:class:`matplotlib.figure.Figure` API, so no pyplot state or backend is touched and nothing is shown on
screen: every figure is written to a file by :func:`save_figure`.

All functions take torch tensors (any dtype, on the CPU) and draw onto a given ``Axes``.
"""

from .curves import plot_predicted_vs_observed, plot_regression, plot_reliability, plot_std
from .figures import new_figure, require_matplotlib, save_figure
from .maps import (
    Grid2D,
    class_legend_handles,
    grid_2d,
    plot_change_map,
    plot_probability_map,
    plot_uncertainty_map,
)

__all__ = [
    "Grid2D",
    "class_legend_handles",
    "grid_2d",
    "new_figure",
    "plot_change_map",
    "plot_predicted_vs_observed",
    "plot_probability_map",
    "plot_regression",
    "plot_reliability",
    "plot_std",
    "plot_uncertainty_map",
    "require_matplotlib",
    "save_figure",
]
