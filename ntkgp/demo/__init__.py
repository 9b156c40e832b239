"""The demo behind ``ntkgp demo``: small problems run through the whole pipeline.

Train a network with Algorithm 1 (online optimization of the log marginal likelihood,
:func:`~ntkgp.training.train_marglik`), turn it into an :class:`~ntkgp.NTKGP` and an :class:`~ntkgp.SFR`,
condition both on a new batch of data without retraining, and report evidence, test metrics and timings in
one table (:mod:`~ntkgp.demo.report`), with the reason for each number a first reader would question
(:mod:`~ntkgp.demo.notes`) and figures of the predictive before and after the update and of what it changed
(:mod:`~ntkgp.demo.figures`). The command line itself (arguments, exit codes) is :mod:`ntkgp.cli`; see
``docs/cli_and_examples.md``.

Example:
    >>> from ntkgp.demo import QUICK, gap_regression_task, run_demo
    >>> result = run_demo([gap_regression_task(QUICK)], QUICK, Path("figures"))  # doctest: +SKIP
    >>> print(result.report())  # doctest: +SKIP
"""

from .report import HEADERS, DemoRow, Predictive, format_table, predict
from .run import DemoResult, run_demo, run_task
from .tasks import DEFAULT, QUICK, DemoConfig, DemoTask, csv_task, gap_regression_task, mlp, two_moons_task

__all__ = [
    "DEFAULT",
    "HEADERS",
    "QUICK",
    "DemoConfig",
    "DemoResult",
    "DemoRow",
    "DemoTask",
    "Predictive",
    "csv_task",
    "format_table",
    "gap_regression_task",
    "mlp",
    "predict",
    "run_demo",
    "run_task",
    "two_moons_task",
]
