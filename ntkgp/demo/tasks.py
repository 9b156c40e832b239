"""The demo's problems and settings: :class:`DemoConfig`, :class:`DemoTask` and the three task builders."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..datasets import GAP_REGRESSION_INTERVALS, gap_regression, gap_regression_function, load_csv, two_moons

__all__ = ["DEFAULT", "QUICK", "DemoConfig", "DemoTask", "csv_task", "gap_regression_task", "mlp", "two_moons_task"]


def mlp(d_in: int, d_out: int, width: int = 50, depth: int = 2, seed: int = 0,
        dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """A tanh MLP ``d_in → width → ... → width → d_out`` with ``depth`` hidden layers.

    Args:
        d_in: number of inputs.
        d_out: number of outputs.
        width: units per hidden layer.
        depth: number of hidden layers.
        seed: seed of PyTorch's default initialization (the global random state is left as it was).
        dtype: dtype of the parameters.

    Returns:
        The network, in training mode.

    Example:
        >>> mlp(2, 1, width=8, depth=1)
        Sequential(
          (0): Linear(in_features=2, out_features=8, bias=True)
          (1): Tanh()
          (2): Linear(in_features=8, out_features=1, bias=True)
        )
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        d = d_in
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.Tanh()]
            d = width
        layers.append(nn.Linear(d, d_out))
        return nn.Sequential(*layers).to(dtype)


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and training settings of the demo (:data:`DEFAULT`, or :data:`QUICK` for tests).

    Algorithm 1 runs ``epochs`` full-batch Adam epochs (step ``lr``); after ``burn_in`` epochs, every
    ``frequency`` epochs, it takes ``hyper_steps`` steps on the prior precisions and the likelihood's noise.
    SFR uses ``M = round(inducing_fraction * N)`` inducing inputs.
    """

    n_regression: int = 100
    n_new_regression: int = 20
    n_classification: int = 200
    new_fraction: float = 0.15
    n_test: int = 500
    width: int = 50
    depth: int = 2
    epochs: int = 1000
    lr: float = 1e-2
    burn_in: int = 100
    frequency: int = 100
    hyper_steps: int = 50
    inducing_fraction: float = 0.25
    grid_resolution: int = 60
    seed: int = 0
    progress: bool = True


DEFAULT = DemoConfig()
QUICK = DemoConfig(n_regression=30, n_new_regression=6, n_classification=40, n_test=60, width=10, depth=1,
                   epochs=30, burn_in=10, frequency=10, hyper_steps=5, grid_resolution=15)


@dataclass
class DemoTask:
    """One problem of the demo: an initial training set, a new batch that arrives later, and a test set.

    Regression targets are ``(N, 1)``; when they were standardized, ``y_scale`` is the training std, so that
    NLPD and RMSE are reported in the original units. Class labels are ``(N,)`` in ``0..num_classes-1``.
    ``gaps`` are input intervals (1-D tasks) with no training data, shaded in the figures; ``new_batch`` says
    in a few words where the new batch lies (for the figure titles).
    """

    name: str
    kind: str
    x_train: Tensor
    y_train: Tensor
    x_new: Tensor
    y_new: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int = 0
    y_scale: float = 1.0
    axis_labels: tuple[str, str] = ("x", "y")
    gaps: tuple[tuple[float, float], ...] = ()
    new_batch: str = "a random subset"


def gap_regression_task(config: DemoConfig) -> DemoTask:
    r"""1-D regression :math:`y = \sin(4x) + \varepsilon`, :math:`\varepsilon \sim N(0, 0.1^2)`, no training
    input in the gap :math:`(-0.35, 0.35)` (:func:`~ntkgp.datasets.gap_regression`).

    The new batch fills the gap; the test inputs are uniform on :math:`[-1, 1]` (data region and gap).

    Args:
        config: sizes (``n_regression``, ``n_new_regression``, ``n_test``) and ``seed``.

    Returns:
        The task ``"gap_regression"``.
    """
    data = gap_regression(n=config.n_regression, seed=config.seed, noise_std=0.1)
    generator = torch.Generator().manual_seed(config.seed + 1)
    (low, gap_low), (gap_high, high) = GAP_REGRESSION_INTERVALS

    def draw(n: int, lo: float, hi: float) -> tuple[Tensor, Tensor]:
        x = (lo + (hi - lo) * torch.rand(n, 1, generator=generator, dtype=torch.float64)).sort(dim=0).values
        noise = data.noise_std * torch.randn(n, 1, generator=generator, dtype=torch.float64)
        return x, gap_regression_function(x) + noise

    x_new, y_new = draw(config.n_new_regression, gap_low, gap_high)
    x_test, y_test = draw(config.n_test, low, high)
    return DemoTask("gap_regression", "regression", data.x_train, data.y_train, x_new, y_new, x_test, y_test,
                    gaps=((gap_low, gap_high),), new_batch="inside the gap")


def two_moons_task(config: DemoConfig) -> DemoTask:
    """Two-moons classification (scikit-learn's ``make_moons``, noise 0.2, so that the classes overlap).

    The new batch is the left tip of the lower moon, which reaches into the bend of the upper one: the
    ``round(new_fraction * n)`` points of class 1 with the smallest first coordinate. The network never sees
    them, so the update has something to change, as the gap batch of :func:`gap_regression_task` has. The
    test set is a fresh draw of both moons.

    Args:
        config: sizes (``n_classification``, ``new_fraction``, ``n_test``) and ``seed``.

    Returns:
        The task ``"two_moons"``.
    """
    x, y = two_moons(n=config.n_classification, noise=0.2, seed=config.seed)
    n_new = min(max(1, round(config.new_fraction * len(x))), int((y == 1).sum()) - 1)
    lower = (y == 1).nonzero().reshape(-1)
    new = lower[x[lower, 0].argsort()[:n_new]].sort().values
    train = torch.ones(len(x), dtype=torch.bool)
    train[new] = False
    x_test, y_test = two_moons(n=config.n_test, noise=0.2, seed=config.seed + 1)
    return DemoTask("two_moons", "classification", x[train], y[train], x[new], y[new], x_test, y_test,
                    num_classes=2, axis_labels=("x1", "x2"), new_batch="the left tip of the lower moon")


def csv_task(path: str | Path, input_columns: Sequence[str], target_column: str, kind: str,
             seed: int = 0) -> DemoTask:
    """A user's CSV file (:func:`~ntkgp.datasets.load_csv`), split by a seeded permutation.

    20 % of the rows are the test set, 20 % of the rest the new batch, the remainder the training set.
    Inputs (and regression targets) are standardized with the training split's mean and std (a constant
    column keeps std 1).

    Args:
        path: the CSV file (a header row; every cell is checked before anything else happens).
        input_columns: header names of the input columns.
        target_column: header name of the target column.
        kind: ``"regression"`` or ``"classification"``.
        seed: seed of the split.

    Returns:
        The task, named after the file.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: for any problem of the file (naming the line and column), fewer than 10 data rows, a
            single class, or a column whose values overflow when standardized (e.g. ``1e308``).
    """
    data = load_csv(path, input_columns, target_column, task=kind)
    n = data.x.shape[0]
    if n < 10:
        raise ValueError(f"{path} has {n} data rows; the demo needs at least 10")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(0.2 * n)
    n_new = round(0.2 * (n - n_test))
    test, new, train = order[:n_test], order[n_test : n_test + n_new], order[n_test + n_new :]

    def standardize(values: Tensor, names: Sequence[str]) -> tuple[Tensor, Tensor, Tensor]:
        mean, std = values[train].mean(0), values[train].std(0, unbiased=False)
        scaled = (values - mean) / torch.where(std > 0, std, torch.ones_like(std))
        bad = ~(mean.isfinite() & std.isfinite() & scaled.isfinite().all(0))
        if bad.any():
            name = names[int(bad.nonzero()[0, 0])]
            raise ValueError(f"column {name!r} of {path}: its values are too large to standardize in float64 "
                             "(the mean or standard deviation overflows); rescale the column")
        return scaled, mean, std

    x, _, _ = standardize(data.x, data.input_names)
    y, y_scale = data.y, 1.0
    if kind == "regression":
        y, _, y_std = standardize(data.y, [target_column])
        y_scale = float(y_std[0]) if y_std[0] > 0 else 1.0
    num_classes = len(data.class_names) if kind == "classification" else 0
    if kind == "classification" and num_classes < 2:
        raise ValueError(f"column {target_column!r} of {path} holds a single class; classification needs two")
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", Path(path).stem) or "csv"
    labels = (f"{data.input_names[0]} (standardized)",
              f"{target_column} (standardized)" if kind == "regression" else
              f"{data.input_names[-1]} (standardized)")
    return DemoTask(name, kind, x[train], y[train], x[new], y[new], x[test], y[test], num_classes=num_classes,
                    y_scale=y_scale, axis_labels=labels, new_batch="a random 20 % of the rest")
