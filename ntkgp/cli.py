"""The ``ntkgp`` command (``ntkgp demo``, also ``python -m ntkgp demo``) and helpers shared with ``examples/``.

``ntkgp demo`` shows the whole pipeline on small problems: train a network with Algorithm 1 (online evidence
optimisation, :func:`~ntkgp.training.train_marglik`), turn it into an :class:`~ntkgp.NTKGP` and an
:class:`~ntkgp.models.sfr.SFR`, condition both on a new batch of data without retraining, and report
evidence, test metrics and timings in one table, with figures of the predictive before and after the update.
See ``docs/cli_and_examples.md``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

import torch
from gpytorch.likelihoods import GaussianLikelihood, Likelihood
from torch import Tensor, nn

from . import metrics, plotting
from .datasets import GAP_REGRESSION_INTERVALS, gap_regression, gap_regression_function, load_csv, two_moons
from .likelihoods import LogisticLikelihood, SoftmaxLikelihood
from .models import NTKGP
from .models.sfr import SFR
from .training import train_marglik

__all__ = [
    "DEFAULT",
    "QUICK",
    "DemoConfig",
    "DemoTask",
    "Predictive",
    "csv_task",
    "format_table",
    "gap_regression_task",
    "main",
    "mlp",
    "predict",
    "resolve_data_dir",
    "run_task",
    "two_moons_task",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path("..", "shared", "data")


# ---------------------------------------------------------------------------- helpers shared with examples/
def mlp(d_in: int, d_out: int, width: int = 50, depth: int = 2, seed: int = 0,
        dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """A tanh MLP ``d_in → width → ... → width → d_out`` with ``depth`` hidden layers, initialised from ``seed``
    (PyTorch's default initialisation; the global random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        d = d_in
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.Tanh()]
            d = width
        layers.append(nn.Linear(d, d_out))
        return nn.Sequential(*layers).to(dtype)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 3) -> str:
    """A plain-text table: floats with ``digits`` decimals, ``None`` as ``-``; text columns left-aligned,
    numeric ones right-aligned."""
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


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """The shared data folder (laid out as ``/work/shared/data``).

    ``data_dir`` when given; otherwise ``../shared/data`` relative to the current directory, then relative to
    the repository root (the folder holding the ``ntkgp`` package).

    Raises:
        FileNotFoundError: naming the folders tried and the ``--data-dir`` option.
    """
    candidates = [Path(data_dir)] if data_dir is not None else [Path.cwd() / SHARED_DATA, REPO_ROOT / SHARED_DATA]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"data folder not found (tried {tried}). Pass --data-dir pointing at the shared data folder, which holds "
        "toy/ (snelson_*.dat, banana_*.csv) and uci_regression/NAME/ (data.txt, index_*.txt)"
    )


# ---------------------------------------------------------------------------- the demo's problems
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

    Regression targets are ``(N, 1)``; when they were standardised, ``y_scale`` is the training std, so that
    NLPD and RMSE are reported in the original units. Class labels are ``(N,)`` in ``0..num_classes-1``.
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


def gap_regression_task(config: DemoConfig) -> DemoTask:
    r"""1-D regression :math:`y = \sin(4x) + \varepsilon`, :math:`\varepsilon \sim N(0, 0.1^2)`, no training
    input in the gap :math:`(-0.35, 0.35)` (:func:`~ntkgp.datasets.gap_regression`). The new batch fills the
    gap; the test inputs are uniform on :math:`[-1, 1]` (data region and gap)."""
    data = gap_regression(n=config.n_regression, seed=config.seed, noise_std=0.1)
    generator = torch.Generator().manual_seed(config.seed + 1)
    (low, gap_low), (gap_high, high) = GAP_REGRESSION_INTERVALS

    def draw(n: int, lo: float, hi: float) -> tuple[Tensor, Tensor]:
        x = (lo + (hi - lo) * torch.rand(n, 1, generator=generator, dtype=torch.float64)).sort(dim=0).values
        noise = data.noise_std * torch.randn(n, 1, generator=generator, dtype=torch.float64)
        return x, gap_regression_function(x) + noise

    x_new, y_new = draw(config.n_new_regression, gap_low, gap_high)
    x_test, y_test = draw(config.n_test, low, high)
    return DemoTask("gap_regression", "regression", data.x_train, data.y_train, x_new, y_new, x_test, y_test)


def two_moons_task(config: DemoConfig) -> DemoTask:
    """Two-moons classification (scikit-learn's ``make_moons``, noise 0.2, so that the classes overlap a
    little). A random ``new_fraction`` of the points is held back as the new batch; the test set is a fresh
    draw."""
    x, y = two_moons(n=config.n_classification, noise=0.2, seed=config.seed)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(config.seed + 1))
    n_new = max(1, round(config.new_fraction * len(x)))
    train, new = order[:-n_new].sort().values, order[-n_new:].sort().values
    x_test, y_test = two_moons(n=config.n_test, noise=0.2, seed=config.seed + 1)
    return DemoTask("two_moons", "classification", x[train], y[train], x[new], y[new], x_test, y_test,
                    num_classes=2, axis_labels=("x1", "x2"))


def csv_task(path: str | Path, input_columns: Sequence[str], target_column: str, kind: str,
             seed: int = 0) -> DemoTask:
    """A user's CSV file (:func:`~ntkgp.datasets.load_csv`), split by a seeded permutation: 20 % test, then
    20 % of the rest as the new batch, the remainder for training. Inputs (and regression targets) are
    standardised with the training split's mean and std (a constant column keeps std 1)."""
    data = load_csv(path, input_columns, target_column, task=kind)
    n = data.x.shape[0]
    if n < 10:
        raise ValueError(f"{path} has {n} data rows; the demo needs at least 10")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(0.2 * n)
    n_new = round(0.2 * (n - n_test))
    test, new, train = order[:n_test], order[n_test : n_test + n_new], order[n_test + n_new :]

    def standardise(values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mean, std = values[train].mean(0), values[train].std(0, unbiased=False)
        return (values - mean) / torch.where(std > 0, std, torch.ones_like(std)), mean, std

    x, _, _ = standardise(data.x)
    y, y_scale = data.y, 1.0
    if kind == "regression":
        y, _, y_std = standardise(data.y)
        y_scale = float(y_std[0]) if y_std[0] > 0 else 1.0
    num_classes = len(data.class_names) if kind == "classification" else 0
    if kind == "classification" and num_classes < 2:
        raise ValueError(f"column {target_column!r} of {path} holds a single class; classification needs two")
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", Path(path).stem) or "csv"
    labels = (f"{data.input_names[0]} (standardised)",
              f"{target_column} (standardised)" if kind == "regression" else
              f"{data.input_names[-1]} (standardised)")
    return DemoTask(name, kind, x[train], y[train], x[new], y[new], x[test], y[test], num_classes=num_classes,
                    y_scale=y_scale, axis_labels=labels)


# ---------------------------------------------------------------------------- predictions and scores
@dataclass
class Predictive:
    """A predictive distribution over ``y`` at ``G`` inputs: ``mean``, ``std`` ``(G,)`` (regression) or
    ``probs`` (``(G,)`` or ``(G, 1)`` with :math:`P(y=1)`, or ``(G, C)``)."""

    mean: Tensor | None = None
    std: Tensor | None = None
    probs: Tensor | None = None


def predict(model: Callable[[Tensor], object], likelihood: Likelihood, x: Tensor, kind: str) -> Predictive:
    """``likelihood(model(x))`` without gradients: works for NTKGP and SFR (a distribution over ``f``) and for
    a network (a tensor of outputs ``f``, giving the likelihood's conditional distribution)."""
    with torch.no_grad():
        out = likelihood(model(x))
    if kind == "regression":
        return Predictive(mean=out.mean.reshape(-1), std=out.variance.sqrt().reshape(-1))
    return Predictive(probs=out.probs)


def _scores(task: DemoTask, p: Predictive) -> dict[str, float | None]:
    """Test NLPD, RMSE or accuracy and ECE (regression: in the original units of ``y``)."""
    if task.kind == "regression":
        return {"nlpd": metrics.gaussian_nlpd(p.mean, p.std.square(), task.y_test, y_scale=task.y_scale),
                "rmse": metrics.rmse(p.mean, task.y_test) * task.y_scale, "accuracy": None, "ece": None}
    return {"nlpd": metrics.categorical_nlpd(p.probs, task.y_test), "rmse": None,
            "accuracy": metrics.accuracy(p.probs, task.y_test),
            "ece": metrics.expected_calibration_error(p.probs, task.y_test)}


def _evidence_per_datum(model: NTKGP | SFR) -> float:
    """NTKGP: the Laplace-GGN evidence / N; SFR: its sparse (Titsias) bound / N."""
    with torch.no_grad():
        total = model.sparse_evidence() if isinstance(model, SFR) else model.log_marginal_likelihood()
    return total.item() / model.num_data


def _timed(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    """``fn(*args)`` and its wall time in seconds."""
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


HEADERS = ("task", "model", "N", "evidence/N", "test NLPD", "RMSE", "accuracy", "ECE", "build s", "predict s",
           "update s")


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
        return [self.task, self.model, self.num_data, self.evidence, self.nlpd, self.rmse, self.accuracy,
                self.ece, self.build_s, self.predict_s, self.update_s]


# ---------------------------------------------------------------------------- running one problem
def _likelihood(task: DemoTask) -> Likelihood:
    if task.kind == "regression":
        return GaussianLikelihood().double()
    if task.num_classes == 2:
        return LogisticLikelihood().double()
    return SoftmaxLikelihood(num_classes=task.num_classes).double()


def _plot_inputs(task: DemoTask, config: DemoConfig) -> Tensor | plotting.Grid2D | None:
    """A sorted 1-D grid (regression on one input) or a 2-D grid (classification on two inputs), else None."""
    x_all = torch.cat([task.x_train, task.x_new, task.x_test])
    if task.kind == "regression" and x_all.shape[1] == 1:
        low, high = x_all.min().item(), x_all.max().item()
        pad = 0.25 * (high - low)
        return torch.linspace(low - pad, high + pad, 300, dtype=x_all.dtype)[:, None]
    if task.kind == "classification" and x_all.shape[1] == 2:
        return plotting.grid_2d(x_all, resolution=config.grid_resolution, margin=0.15)
    return None


def _figure(task: DemoTask, model_name: str, plot_at: Tensor | plotting.Grid2D | None,
            before: tuple[Predictive, Predictive], after: tuple[Predictive, Predictive],
            inducing: Tensor | None, path: Path) -> Path:
    """Before/after figure of one model; ``before``/``after`` hold the predictive at ``plot_at`` and at the
    test inputs."""
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


def run_task(task: DemoTask, config: DemoConfig, output_dir: Path,
             log: Callable[[str], None] = lambda message: None) -> tuple[list[DemoRow], list[Path]]:
    """Train, build NTKGP and SFR, update both with the new batch; return the table rows and figure paths.

    Rows: the network alone (build = training time), NTKGP, NTKGP after ``condition_on``, SFR, SFR after
    ``update``. The network is trained with Algorithm 1 on the full Laplace-GGN evidence (``structure="full"``,
    one prior precision per layer, learned noise for regression).
    """
    d_in = task.x_train.shape[1]
    d_out = 1 if task.kind == "regression" or task.num_classes == 2 else task.num_classes
    net = mlp(d_in, d_out, width=config.width, depth=config.depth, seed=config.seed)
    likelihood = _likelihood(task)
    n = len(task.x_train)
    log(f"[{task.name}] Algorithm 1 on a {d_in}-{'-'.join([str(config.width)] * config.depth)}-{d_out} tanh "
        f"network, N={n}, {config.epochs} epochs")
    result, train_s = _timed(lambda: train_marglik(
        net, task.x_train, task.y_train, likelihood, structure="full", epochs=config.epochs, lr=config.lr,
        burn_in=config.burn_in, frequency=config.frequency, hyper_steps=config.hyper_steps, seed=config.seed,
        progress=config.progress))
    net_pred, net_s = _timed(predict, net, likelihood, task.x_test, task.kind)
    rows = [DemoRow(task.name, "network (MAP)", n, None, **_scores(task, net_pred), build_s=train_s,
                    predict_s=net_s, update_s=None)]

    num_inducing = max(1, round(config.inducing_fraction * n))
    builders: list[tuple[str, str, Callable[[], NTKGP | SFR], Callable[[NTKGP | SFR], NTKGP | SFR]]] = [
        ("NTKGP", "NTKGP", lambda: result.model(task.x_train, task.y_train).eval(),
         lambda m: m.condition_on(task.x_new, task.y_new).eval()),
        ("SFR", f"SFR (M={num_inducing})",
         lambda: SFR(net, task.x_train, task.y_train, likelihood, num_inducing=num_inducing,
                     prior_precision=result.prior_precision, groups=result.kernel.groups_spec, seed=config.seed),
         lambda m: m.update(task.x_new, task.y_new)),
    ]
    plot_at = _plot_inputs(task, config)
    grid_x = plot_at.points if isinstance(plot_at, plotting.Grid2D) else plot_at
    figures = []
    for short, name, build, update in builders:
        log(f"[{task.name}] {name}: build, predict, update with {len(task.x_new)} new points")
        model, build_s = _timed(build)
        before, predict_s = _timed(predict, model, likelihood, task.x_test, task.kind)
        rows.append(DemoRow(task.name, name, model.num_data, _evidence_per_datum(model), **_scores(task, before),
                            build_s=build_s, predict_s=predict_s, update_s=None))
        grid_before = predict(model, likelihood, grid_x, task.kind) if grid_x is not None else None
        inducing = model.inducing_points if isinstance(model, SFR) else None
        updated, update_s = _timed(update, model)
        after, predict_s = _timed(predict, updated, likelihood, task.x_test, task.kind)
        rows.append(DemoRow(task.name, f"{short} + new batch", updated.num_data,
                            _evidence_per_datum(updated), **_scores(task, after), build_s=None,
                            predict_s=predict_s, update_s=update_s))
        grid_after = predict(updated, likelihood, grid_x, task.kind) if grid_x is not None else None
        figures.append(_figure(task, name, plot_at, (grid_before, before), (grid_after, after), inducing,
                               output_dir / f"{task.name}_{short.lower()}.png"))
    return rows, figures


# ---------------------------------------------------------------------------- the command line
def build_parser() -> argparse.ArgumentParser:
    """The ``ntkgp`` argument parser (one subcommand, ``demo``)."""
    parser = argparse.ArgumentParser(prog="ntkgp", description="Trained PyTorch networks as Gaussian processes.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="train, build NTKGP and SFR, update with new data, print a table and save figures",
        description="Train a small network with online evidence optimisation (Algorithm 1), build NTKGP and SFR, "
        "condition both on a new batch, print evidence / test metrics / timings and save before/after figures. "
        "Runs on a 1-D gap regression and two-moons classification, or on your own CSV file (--csv).")
    demo.add_argument("--output-dir", type=Path, default=Path("ntkgp-demo-output"),
                      help="folder for the PNG figures (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="seed of data, initialisation and splits (default: 0)")
    demo.add_argument("--quick", action="store_true", help="a tiny configuration (seconds; for tests)")
    demo.add_argument("--epochs", type=int, help="training epochs (default: 1000, or 30 with --quick)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars or status lines")
    own = demo.add_argument_group("your own data (replaces the built-in problems)")
    own.add_argument("--csv", type=Path, metavar="PATH", help="a CSV file with a header row")
    own.add_argument("--input-columns", nargs="+", metavar="NAME", help="header names of the input columns")
    own.add_argument("--target-column", metavar="NAME", help="header name of the target column")
    own.add_argument("--task", choices=("regression", "classification"), default="regression",
                     help="what the target is (default: regression)")
    demo.set_defaults(error=demo.error)
    return parser


def _demo(args: argparse.Namespace) -> int:
    """Run ``ntkgp demo`` with parsed ``args``; user errors exit through ``args.error`` (argparse, status 2)."""
    error: Callable[[str], NoReturn] = args.error
    if args.csv is None and (args.input_columns or args.target_column):
        error("--input-columns and --target-column need --csv")
    if args.csv is not None and not (args.input_columns and args.target_column):
        error("--csv needs --input-columns and --target-column")
    if args.epochs is not None and args.epochs < 1:
        error(f"--epochs must be positive, got {args.epochs}")
    config = replace(QUICK if args.quick else DEFAULT, seed=args.seed, progress=not args.no_progress)
    if args.epochs is not None:
        config = replace(config, epochs=args.epochs)
    try:
        plotting.require_matplotlib()
        if args.csv is not None:
            tasks = [csv_task(args.csv, args.input_columns, args.target_column, args.task, seed=args.seed)]
        else:
            tasks = [gap_regression_task(config), two_moons_task(config)]
    except (ImportError, FileNotFoundError, ValueError) as problem:
        error(str(problem))

    def log(message: str) -> None:
        if config.progress:
            print(message, file=sys.stderr, flush=True)

    start = time.perf_counter()
    rows, figures = [], []
    for task in tasks:
        task_rows, task_figures = run_task(task, config, args.output_dir, log)
        rows += task_rows
        figures += task_figures
    print(format_table(HEADERS, [row.cells() for row in rows]))
    print("\nevidence/N: Laplace-GGN log evidence per data point (SFR: its collapsed bound on the Gaussian-site "
          "evidence of the linearised GP, which exceeds the Laplace evidence when θ* is not exactly a MAP); "
          "NLPD and RMSE in the units of the data; times in seconds")
    print("figures:")
    for path in figures:
        print(f"  {path}")
    print(f"total time: {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ntkgp`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return _demo(args)
