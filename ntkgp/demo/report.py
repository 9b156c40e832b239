"""What the demo reports: predictives, scores, the table (:func:`format_table`) and the before/after figures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from .. import metrics, plotting
from .tasks import DemoConfig, DemoTask

__all__ = ["HEADERS", "DemoRow", "Predictive", "format_table", "predict"]

HEADERS = ("task", "model", "N", "evidence/N", "test NLPD", "RMSE", "accuracy", "ECE", "build s", "predict s",
           "update s")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 3) -> str:
    """A plain-text table: floats with ``digits`` decimals, ``None`` as ``-``.

    Text columns are left-aligned, numeric ones right-aligned; a rule of dashes follows the header.

    Args:
        headers: the column titles.
        rows: the cells, one sequence per row, as many cells as ``headers``.
        digits: decimals of floats.

    Returns:
        The table, lines joined by ``"\\n"`` (no trailing newline).

    Raises:
        ValueError: if a row does not have as many cells as ``headers``.

    Example:
        >>> print(format_table(["name", "value"], [["a", 1.23456], ["bb", None]]))
        name  value
        ----  -----
        a     1.235
        bb        -
    """
    for number, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"rows[{number}] has {len(row)} cells but there are {len(headers)} headers")

    def cell(value: object) -> str:
        if value is None:
            return "-"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    text = [all(isinstance(row[i], str) for row in rows) for i in range(len(headers))]
    cells = [list(headers)] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if left else c.rjust(w) for c, w, left in zip(r, widths, text)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass
class Predictive:
    """A predictive distribution over ``y`` at ``G`` inputs.

    Regression: ``mean`` and ``std`` ``(G,)``. Classification: ``probs``, ``(G,)`` or ``(G, 1)`` with
    :math:`P(y=1)`, or ``(G, C)``.
    """

    mean: Tensor | None = None
    std: Tensor | None = None
    probs: Tensor | None = None


def predict(model: Callable[[Tensor], object], likelihood: Likelihood, x: Tensor, kind: str) -> Predictive:
    """``likelihood(model(x))`` without gradients.

    Args:
        model: an NTKGP or SFR (giving a distribution over ``f``) or a network (giving the outputs ``f``,
            so that the likelihood returns its conditional distribution).
        likelihood: the model's likelihood.
        x: the inputs.
        kind: ``"regression"`` or ``"classification"``.

    Returns:
        The predictive over ``y``.
    """
    with torch.no_grad():
        out = likelihood(model(x))
    if kind == "regression":
        return Predictive(mean=out.mean.reshape(-1), std=out.variance.sqrt().reshape(-1))
    return Predictive(probs=out.probs)


def scores(task: DemoTask, p: Predictive) -> dict[str, float | None]:
    """Test NLPD, RMSE or accuracy and ECE (regression: in the original units of ``y``)."""
    if task.kind == "regression":
        return {"nlpd": metrics.gaussian_nlpd(p.mean, p.std.square(), task.y_test, y_scale=task.y_scale),
                "rmse": metrics.rmse(p.mean, task.y_test) * task.y_scale, "accuracy": None, "ece": None}
    return {"nlpd": metrics.categorical_nlpd(p.probs, task.y_test), "rmse": None,
            "accuracy": metrics.accuracy(p.probs, task.y_test),
            "ece": metrics.expected_calibration_error(p.probs, task.y_test)}


@dataclass
class DemoRow:
    """One line of the demo's table (``None``: not applicable)."""

    task: str
    model: str
    num_data: int
    evidence: float | None
    nlpd: float | None
    rmse: float | None
    accuracy: float | None
    ece: float | None
    build_s: float | None
    predict_s: float | None
    update_s: float | None

    def cells(self) -> list[object]:
        """The cells in the order of :data:`HEADERS`."""
        return [self.task, self.model, self.num_data, self.evidence, self.nlpd, self.rmse, self.accuracy,
                self.ece, self.build_s, self.predict_s, self.update_s]


def plot_inputs(task: DemoTask, config: DemoConfig) -> Tensor | plotting.Grid2D | None:
    """A sorted 1-D grid (regression on one input) or a 2-D grid (classification on two inputs), else None."""
    x_all = torch.cat([task.x_train, task.x_new, task.x_test])
    if task.kind == "regression" and x_all.shape[1] == 1:
        low, high = x_all.min().item(), x_all.max().item()
        pad = 0.25 * (high - low)
        return torch.linspace(low - pad, high + pad, 300, dtype=x_all.dtype)[:, None]
    if task.kind == "classification" and x_all.shape[1] == 2:
        return plotting.grid_2d(x_all, resolution=config.grid_resolution, margin=0.15)
    return None


def before_after_figure(task: DemoTask, model_name: str, plot_at: Tensor | plotting.Grid2D | None,
                        before: tuple[Predictive | None, Predictive], after: tuple[Predictive | None, Predictive],
                        inducing: Tensor | None, path: Path) -> Path:
    """Before/after figure of one model, saved to ``path``.

    ``before``/``after`` hold the predictive at ``plot_at`` (``None`` without a plot grid) and at the test
    inputs. Regression on one input: mean ± 2 std with the data; classification on two inputs: probability
    and entropy maps; otherwise predicted-vs-observed or a reliability diagram on the test set.
    """
    x_seen = torch.cat([task.x_train, task.x_new])
    y_seen = torch.cat([task.y_train, task.y_new])
    stages = ((f"{model_name}: before the update (N={len(task.x_train)})", before, task.x_train, task.y_train, None),
              (f"{model_name}: after the update (N={len(x_seen)})", after, x_seen, y_seen, task.x_new))
    if isinstance(plot_at, plotting.Grid2D):
        fig, axes = plotting.new_figure(2, 2)
        for col, (title, (grid_p, _), x, y, marked) in enumerate(stages):
            plotting.plot_probability_map(axes[0][col], plot_at, grid_p.probs, x=x, y=y, title=title, marked=marked)
            plotting.plot_uncertainty_map(axes[1][col], plot_at, grid_p.probs, x=x, y=y, title=title, marked=marked)
        for ax in (a for row in axes for a in row):
            ax.set_xlabel(task.axis_labels[0])
            ax.set_ylabel(task.axis_labels[1])
    else:
        fig, axes = plotting.new_figure(1, 2)
        for ax, (title, (grid_p, test_p), x, y, marked) in zip(axes[0], stages):
            if plot_at is not None:
                new_y = task.y_new if marked is not None else None
                plotting.plot_regression(ax, plot_at, grid_p.mean, grid_p.std, x_train=task.x_train,
                                         y_train=task.y_train, x_new=marked, y_new=new_y, inducing=inducing,
                                         title=title)
                ax.set_xlabel(task.axis_labels[0])
                ax.set_ylabel(task.axis_labels[1])
            elif task.kind == "regression":
                plotting.plot_predicted_vs_observed(ax, test_p.mean, test_p.std, task.y_test, title=f"{title}, test")
            else:
                plotting.plot_reliability(ax, test_p.probs, task.y_test, title=f"{title}, test")
    return plotting.save_figure(fig, path)
