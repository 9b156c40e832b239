"""Running the demo: train (Algorithm 1), build NTKGP and SFR, update both, score, draw."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gpytorch.likelihoods import GaussianLikelihood, Likelihood

from ntkgp import NTKGP, SFR, plotting
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from ntkgp.training import HyperparameterSchedule, MAPOptimization, train_marglik

from .figures import before_after_figure, plot_inputs
from .notes import COLUMNS, REFIT, explain
from .report import HEADERS, DemoRow, format_table, predict, scores
from .tasks import DemoConfig, DemoTask, mlp
from ntkgp.models import SFRInducingOptions

__all__ = ["DemoResult", "run_demo", "run_task"]


@dataclass
class DemoResult:
    """The table rows and figure paths of a demo run, and its wall time."""

    rows: list[DemoRow] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
    seconds: float = 0.0

    def report(self) -> str:
        """The text ``ntkgp demo`` prints: the table, what its columns measure, the reason for each number a
        first reader would question (:func:`ntkgp.demo.notes.explain`), the figures, the total time."""
        lines = [format_table(HEADERS, [row.cells() for row in self.rows]), "", *COLUMNS]
        why = explain(self.rows)
        if why:
            lines += ["", "why:", *[f"- {line}" for line in why]]
        lines += ["", "figures:", *[f"  {path}" for path in self.figures]]
        lines.append(f"total time: {self.seconds:.1f} s")
        return "\n".join(lines)


def _evidence_per_datum(model: NTKGP | SFR) -> float:
    """NTKGP: the Laplace-GGN log marginal likelihood / N; SFR: its sparse (Titsias) bound / N."""
    with torch.no_grad():
        total = model.log_marginal_likelihood()
    return total.item() / model.num_data


def _refit(model: NTKGP) -> NTKGP:
    """``model`` with δ refit by its evidence (:meth:`~ntkgp.NTKGP.optimize_prior_precision`, θ* fixed), in eval
    mode."""
    model.optimize_prior_precision(steps=100, lr=0.1)
    return model.eval()


def _timed(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    """``fn(*args)`` and its wall time in seconds."""
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def _likelihood(task: DemoTask) -> Likelihood:
    if task.kind == "regression":
        return GaussianLikelihood().double()
    if task.num_classes == 2:
        return LogisticLikelihood().double()
    return SoftmaxLikelihood(num_classes=task.num_classes).double()


def run_task(task: DemoTask, config: DemoConfig, output_dir: Path,
             log: Callable[[str], None] = lambda message: None) -> tuple[list[DemoRow], list[Path]]:
    """Train, build NTKGP and SFR, update both with the new batch; return the table rows and figure paths.

    Rows: the network alone (``train s``: its training), NTKGP, NTKGP after ``condition_on``; where NTKGP's
    test ECE is above the network's, NTKGP with δ refit by the evidence at the final weights
    (:meth:`~ntkgp.NTKGP.optimize_prior_precision`; ``build s`` includes the refit); SFR, SFR after
    ``update``. The network is trained with Algorithm 1 on the full Laplace-GGN log marginal likelihood (one
    prior precision per layer, learned noise for regression).

    Args:
        task: the problem.
        config: sizes and training settings.
        output_dir: folder of the two figures ``<task>_ntkgp.png`` and ``<task>_sfr.png``.
        log: receives one status line per stage.

    Returns:
        The rows (five, or six with the refit) and the two figure paths.
    """
    d_in = task.x_train.shape[1]
    d_out = 1 if task.kind == "regression" or task.num_classes == 2 else task.num_classes
    net = mlp(d_in, d_out, width=config.width, depth=config.depth, seed=config.seed)
    likelihood = _likelihood(task)
    n = len(task.x_train)
    log(f"[{task.name}] Algorithm 1 on a {d_in}-{'-'.join([str(config.width)] * config.depth)}-{d_out} tanh "
        f"network, N={n}, {config.epochs} epochs")
    result, train_s = _timed(lambda: train_marglik(
        net, task.x_train, task.y_train, likelihood, structure="full_ggn", epochs=config.epochs, lr=config.lr,
        schedule=HyperparameterSchedule(burn_in=config.burn_in, frequency=config.frequency,
                                        hyper_steps=config.hyper_steps),
        optimization=MAPOptimization(seed=config.seed),
        progress=config.progress))
    net_pred, net_s = _timed(predict, net, likelihood, task.x_test, task.kind)
    rows = [DemoRow(task.name, "network (MAP)", n, None, **scores(task, net_pred), train_s=train_s, build_s=None,
                    predict_s=net_s, update_s=None)]

    num_inducing = max(1, round(config.inducing_fraction * n))
    builders: list[tuple[str, str, Callable[[], NTKGP | SFR], Callable[[NTKGP | SFR], NTKGP | SFR]]] = [
        ("NTKGP", "NTKGP", lambda: result.model(task.x_train, task.y_train).eval(),
         lambda m: m.condition_on(task.x_new, task.y_new).eval()),
        ("SFR", f"SFR (M={num_inducing})",
         lambda: SFR(net, task.x_train, task.y_train, likelihood, num_inducing=num_inducing,
                     prior_precision=result.prior_precision, prior_structure=result.kernel.prior_structure,
                     inducing=SFRInducingOptions(seed=config.seed)),
         lambda m: m.update(task.x_new, task.y_new)),
    ]
    plot_at = plot_inputs(task, config)
    grid_x = plot_at.points if isinstance(plot_at, plotting.Grid2D) else plot_at
    figures = []
    for short, name, build, update in builders:
        log(f"[{task.name}] {name}: build, predict, update with {len(task.x_new)} new points")
        model, build_s = _timed(build)
        before, predict_s = _timed(predict, model, likelihood, task.x_test, task.kind)
        built = DemoRow(task.name, name, model.num_data, _evidence_per_datum(model), **scores(task, before),
                        train_s=None, build_s=build_s, predict_s=predict_s, update_s=None)
        rows.append(built)
        grid_before = predict(model, likelihood, grid_x, task.kind) if grid_x is not None else None
        inducing = model.inducing_points if isinstance(model, SFR) else None
        updated, update_s = _timed(update, model)
        after, predict_s = _timed(predict, updated, likelihood, task.x_test, task.kind)
        rows.append(DemoRow(task.name, f"{short} + new batch", updated.num_data,
                            _evidence_per_datum(updated), **scores(task, after), train_s=None, build_s=None,
                            predict_s=predict_s, update_s=update_s))
        grid_after = predict(updated, likelihood, grid_x, task.kind) if grid_x is not None else None
        figures.append(before_after_figure(task, name, plot_at, (grid_before, before), (grid_after, after),
                                           inducing, output_dir / f"{task.name}_{short.lower()}.png"))
        if short == "NTKGP" and task.kind == "classification" and built.ece > rows[0].ece:  # less calibrated
            log(f"[{task.name}] NTKGP: refit δ by the evidence at the final weights")
            refit, refit_s = _timed(lambda: _refit(build()))
            scored, predict_s = _timed(predict, refit, likelihood, task.x_test, task.kind)
            rows.append(DemoRow(task.name, REFIT, refit.num_data, _evidence_per_datum(refit), **scores(task, scored),
                                train_s=None, build_s=refit_s, predict_s=predict_s, update_s=None))
    return rows, figures


def run_demo(tasks: Sequence[DemoTask], config: DemoConfig, output_dir: Path,
             log: Callable[[str], None] = lambda message: None) -> DemoResult:
    """:func:`run_task` on each task in turn.

    Args:
        tasks: the problems (their inputs already checked).
        config: sizes and training settings.
        output_dir: folder of the figures.
        log: receives status lines.

    Returns:
        All rows and figures, and the wall time.
    """
    start = time.perf_counter()
    result = DemoResult()
    for task in tasks:
        rows, figures = run_task(task, config, output_dir, log)
        result.rows += rows
        result.figures += figures
    result.seconds = time.perf_counter() - start
    return result
