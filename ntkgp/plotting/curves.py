"""1-D predictives and test-set diagnostics: regression bands, standard deviations along the input,
predicted-vs-observed and the reliability diagram."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .figures import to_numpy as _np

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_predicted_vs_observed", "plot_regression", "plot_reliability", "plot_std"]


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
    f_std: Tensor | None = None,
    gaps: Sequence[tuple[float, float]] = (),
    title: str = "",
    legend: bool = True,
) -> None:
    r"""A 1-D predictive: the mean and the band :math:`\mu \pm 2\sigma` over ``y``, with the data.

    With ``f_std`` a second, darker band :math:`\mu \pm 2\sigma_f` shows the uncertainty about the function
    alone (without the observation noise), which is where the data, or their absence, show.

    Args:
        ax: the axes to draw on.
        x_grid: ``(G,)`` or ``(G, 1)`` sorted inputs.
        mean, std: ``(G,)`` (or ``(G, 1)``) predictive mean and standard deviation of ``y`` at ``x_grid``.
        x_train, y_train: training data, ``(N, 1)``; drawn as dots.
        x_new, y_new: a second batch (e.g. data added by an update), drawn as crosses.
        inducing: ``(M, 1)`` inducing inputs, marked on the lower edge of the axes.
        f_std: ``(G,)`` standard deviation of ``f`` at ``x_grid`` (drawn as the inner band).
        gaps: input intervals without training data, shaded grey.
        title: the panel title.
        legend: a legend in the panel (``False``: e.g. one legend for the figure, from
            ``ax.get_legend_handles_labels()``).
    """
    x, mu, sd = _np(x_grid).ravel(), _np(mean).ravel(), _np(std).ravel()
    _shade_gaps(ax, gaps)
    ax.fill_between(x, mu - 2 * sd, mu + 2 * sd, color="C0", alpha=0.2, lw=0, label=r"$\pm$ 2 std of y (f + noise)")
    if f_std is not None:
        fsd = _np(f_std).ravel()
        ax.fill_between(x, mu - 2 * fsd, mu + 2 * fsd, color="C0", alpha=0.45, lw=0, label=r"$\pm$ 2 std of f")
    ax.plot(x, mu, color="C0", lw=1.5, label="mean")
    ax.scatter(_np(x_train).ravel(), _np(y_train).ravel(), s=8, color="k", alpha=0.6, label="training data")
    if x_new is not None and y_new is not None:
        ax.scatter(_np(x_new).ravel(), _np(y_new).ravel(), s=22, marker="x", color="C3", label="new batch")
    if inducing is not None:
        ax.plot(_np(inducing).ravel(), [0.0] * inducing.shape[0], "|", color="C2", ms=10, mew=1.5,
                transform=ax.get_xaxis_transform(), label="inducing inputs")
    ax.set_xlim(x.min(), x.max())
    ax.set_title(title)
    if legend:
        ax.legend(loc="best", fontsize="x-small")


def plot_std(ax: Axes, x_grid: Tensor, stds: dict[str, Tensor], *, noise_std: float | None = None,
             gaps: Sequence[tuple[float, float]] = (), x_data: Tensor | None = None, title: str = "") -> None:
    """Standard deviations of ``f`` along a 1-D input, one line per entry of ``stds`` (e.g. before/after an
    update), with the noise level as a dotted line and the gaps in the data shaded.

    Args:
        ax: the axes to draw on.
        x_grid: ``(G,)`` or ``(G, 1)`` sorted inputs.
        stds: label → ``(G,)`` standard deviations at ``x_grid``.
        noise_std: the observation noise's standard deviation (a dotted horizontal line).
        gaps: input intervals without training data, shaded grey.
        x_data: ``(N, 1)`` training inputs, marked on the lower edge.
        title: the panel title.
    """
    x = _np(x_grid).ravel()
    _shade_gaps(ax, gaps)
    for k, (label, std) in enumerate(stds.items()):
        ax.plot(x, _np(std).ravel(), color="C0" if k == 0 else "C3", ls="--" if k == 0 else "-", lw=1.6,
                label=label)
    if noise_std is not None:
        ax.axhline(noise_std, color="0.4", ls=":", lw=1.2, label=f"noise std σ = {noise_std:.3g}")
    if x_data is not None:
        ax.plot(_np(x_data).ravel(), [0.0] * x_data.shape[0], "|", color="k", ms=6, alpha=0.5,
                transform=ax.get_xaxis_transform(), label="training inputs")
    ax.set_xlim(x.min(), x.max())
    top = max([float(s.max()) for s in stds.values()] + ([noise_std] if noise_std is not None else []))
    ax.set_ylim(0.0, 1.5 * top)  # room for the legend above the curves
    ax.set_ylabel("std of f")
    ax.set_title(title)
    ax.legend(loc="upper center", fontsize="x-small", ncols=2)


def _shade_gaps(ax: Axes, gaps: Sequence[tuple[float, float]]) -> None:
    for k, (low, high) in enumerate(gaps):
        ax.axvspan(low, high, color="0.9", lw=0, zorder=0, label="gap: no training data" if k == 0 else None)




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
