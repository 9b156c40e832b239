"""The demo's figures: each model's predictive before and after the update, and what the update changed."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .. import plotting
from ..metrics import predictive_entropy
from .report import Predictive
from .tasks import DemoConfig, DemoTask

__all__ = ["before_after_figure", "plot_inputs"]


def plot_inputs(task: DemoTask, config: DemoConfig) -> Tensor | plotting.Grid2D | None:
    """A sorted 1-D grid (regression on one input) or a 2-D grid (classification on two inputs), else None."""
    x_all = torch.cat([task.x_train, task.x_new, task.x_test])
    if task.kind == "regression" and x_all.shape[1] == 1:
        low, high = x_all.min().item(), x_all.max().item()
        pad = 0.1 * (high - low)
        return torch.linspace(low - pad, high + pad, 300, dtype=x_all.dtype)[:, None]
    if task.kind == "classification" and x_all.shape[1] == 2:
        return plotting.grid_2d(x_all, resolution=config.grid_resolution, margin=0.15)
    return None


def before_after_figure(task: DemoTask, model_name: str, plot_at: Tensor | plotting.Grid2D | None,
                        before: tuple[Predictive | None, Predictive], after: tuple[Predictive | None, Predictive],
                        inducing: Tensor | None, path: Path) -> Path:
    """Before/after figure of one model, saved to ``path``.

    ``before``/``after`` hold the predictive at ``plot_at`` (``None`` without a plot grid) and at the test
    inputs.

    - Regression on one input: before and after, the mean with the bands ±2 std of ``y`` (noise included)
      and of ``f``, the data and the gaps in them shaded; a third panel draws the std of ``f`` before and
      after, with the noise level.
    - Classification on two inputs: ``P(y = 1)`` (or the top-class probability) with the 0.5 contour (top
      row) and the predictive entropy (bottom row), before, after, and after − before; the data as white-edged
      class markers, the new batch ringed.
    - Otherwise: predicted-vs-observed (regression) or a reliability diagram (classification) on the test set.
    """
    n_new = len(task.x_new)
    heading = (f"{model_name} on {task.name}: before and after conditioning on {n_new} new points "
               f"({task.new_batch}), without retraining")
    before_title = f"before the update (N={len(task.x_train)})"
    after_title = f"after the update (N={len(task.x_train) + n_new})"
    if isinstance(plot_at, plotting.Grid2D):
        fig = _maps(task, plot_at, before[0], after[0], before_title, after_title)
    elif plot_at is not None:
        fig = _curves(task, plot_at, before[0], after[0], inducing, before_title, after_title)
    else:
        fig, axes = plotting.new_figure(1, 2)
        for ax, title, (_, test_p) in zip(axes[0], (before_title, after_title), (before, after)):
            if task.kind == "regression":
                plotting.plot_predicted_vs_observed(ax, test_p.mean, test_p.std, task.y_test, title=f"{title}, test")
            else:
                plotting.plot_reliability(ax, test_p.probs, task.y_test, title=f"{title}, test")
    fig.suptitle(heading)
    return plotting.save_figure(fig, path)


def _curves(task: DemoTask, x: Tensor, before: Predictive, after: Predictive, inducing: Tensor | None,
            before_title: str, after_title: str):
    fig, axes = plotting.new_figure(1, 3)
    stages = ((axes[0][0], before, before_title, None, None),
              (axes[0][1], after, after_title, task.x_new, task.y_new))
    for ax, p, title, x_new, y_new in stages:
        plotting.plot_regression(ax, x, p.mean, p.std, f_std=p.f_std, x_train=task.x_train, y_train=task.y_train,
                                 x_new=x_new, y_new=y_new, inducing=inducing, gaps=task.gaps, title=title,
                                 legend=False)
        ax.set_xlabel(task.axis_labels[0])
        ax.set_ylabel(task.axis_labels[1])
    low = min(a.get_ylim()[0] for a in (axes[0][0], axes[0][1]))
    high = max(a.get_ylim()[1] for a in (axes[0][0], axes[0][1]))
    for ax in (axes[0][0], axes[0][1]):
        ax.set_ylim(low, high)
    ax = axes[0][2]
    if before.f_std is not None and after.f_std is not None:
        noise = (before.std.square() - before.f_std.square()).clamp_min(0).mean().sqrt().item()
        plotting.plot_std(ax, x, {"std of f, before": before.f_std, "std of f, after": after.f_std},
                          noise_std=noise, gaps=task.gaps, x_data=task.x_train,
                          title="uncertainty about f: before and after")
        ax.set_xlabel(task.axis_labels[0])
    else:
        ax.set_axis_off()
    handles, labels = axes[0][1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize="small")
    return fig


def _maps(task: DemoTask, grid: plotting.Grid2D, before: Predictive, after: Predictive, before_title: str,
          after_title: str):
    fig, axes = plotting.new_figure(2, 3)
    x_seen, y_seen = torch.cat([task.x_train, task.x_new]), torch.cat([task.y_train, task.y_new])
    num_classes = max(task.num_classes, 2)
    stages = ((0, before, before_title, task.x_train, task.y_train, None),
              (1, after, after_title, x_seen, y_seen, task.x_new))
    for col, p, title, x, y, marked in stages:
        plotting.plot_probability_map(axes[0][col], grid, p.probs, x=x, y=y, title=title, marked=marked, legend=False)
        plotting.plot_uncertainty_map(axes[1][col], grid, p.probs, x=x, y=y, title=title, marked=marked, legend=False)
    binary = num_classes == 2
    value = (lambda p: p.probs.reshape(-1)) if binary else (lambda p: p.probs.max(dim=1).values)
    plotting.plot_change_map(axes[0][2], grid, value(before), value(after), title="change: after − before",
                             label="Δ P(y = 1)" if binary else "Δ top-class probability", marked=task.x_new,
                             y_marked=task.y_new, num_classes=num_classes, legend=False)
    plotting.plot_change_map(axes[1][2], grid, predictive_entropy(before.probs), predictive_entropy(after.probs),
                             title="change: after − before", label="Δ predictive entropy (nats)",
                             marked=task.x_new, y_marked=task.y_new, num_classes=num_classes, legend=False)
    for ax in (a for row in axes for a in row):
        ax.set_xlabel(task.axis_labels[0])
        ax.set_ylabel(task.axis_labels[1])
    fig.legend(handles=plotting.class_legend_handles(num_classes, new_batch=True), loc="outside lower center",
               ncols=num_classes + 1, fontsize="small")
    return fig
