"""What the demo reports: predictives, scores and the table (:func:`format_table`); the figures are
:mod:`ntkgp.demo.figures`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from .. import metrics
from .tasks import DemoTask

__all__ = ["HEADERS", "DemoRow", "Predictive", "format_table", "predict"]

HEADERS = ("task", "model", "N", "evidence/N", "test NLPD", "RMSE", "accuracy", "ECE", "train s", "build s",
           "predict s", "update s")
"""The columns; ``train s`` is the network's training (Algorithm 1), ``build s`` turning it into a model."""


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

    Regression: ``mean`` and ``std`` ``(G,)`` of ``y``, and for a GP model ``f_std`` ``(G,)``, the standard
    deviation of ``f`` (without the noise). Classification: ``probs``, ``(G,)`` or ``(G, 1)`` with
    :math:`P(y=1)`, or ``(G, C)``.
    """

    mean: Tensor | None = None
    std: Tensor | None = None
    probs: Tensor | None = None
    f_std: Tensor | None = None


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
        f = model(x)
        out = likelihood(f)
        if kind == "regression":
            f_std = f.variance.sqrt().reshape(-1) if not isinstance(f, Tensor) else None
            return Predictive(mean=out.mean.reshape(-1), std=out.variance.sqrt().reshape(-1), f_std=f_std)
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
    train_s: float | None
    build_s: float | None
    predict_s: float | None
    update_s: float | None

    def cells(self) -> list[object]:
        """The cells in the order of :data:`HEADERS`."""
        return [self.task, self.model, self.num_data, self.evidence, self.nlpd, self.rmse, self.accuracy,
                self.ece, self.train_s, self.build_s, self.predict_s, self.update_s]
