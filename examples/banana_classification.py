"""Banana classification: online evidence optimisation against a weakly regularised network.

As in figure 3 of Immer et al. (2021): the same tanh network (2-50-50-1) is trained twice on the 400-point
banana set (``toy/banana_400_*.csv``; a seeded, stratified 70/30 train/test split):

* **online**: Algorithm 1 (``ntkgp.training.train_marglik``) learns one prior precision δ per layer from the
  Laplace evidence while the network trains (δ starts at 1);
* **baseline**: a tiny fixed δ (weak weight decay) and no hyperparameter learning; its evidence is evaluated
  at the end of training.

The baseline should overfit: a wiggly decision boundary, overconfident test predictions, and a lower evidence.
The table reports evidence per data point and test accuracy, NLPD and ECE, for the network's own
probabilities (MAP) and for the NTKGP (linearized Laplace, probit) predictive. Writes
``banana_classification.png`` (probability maps of both models).

    python examples/banana_classification.py --data-dir DATA --output-dir examples-output
    python examples/banana_classification.py --quick     # 300 epochs: under a minute

``DATA`` is the benchmark data folder (``toy/``, ``uci_regression/``, ...); without ``--data-dir`` the
``NTKGP_DATA_DIR`` environment variable is used; without either, 400 points of two moons
(``ntkgp.datasets.two_moons``, noise 0.2) replace the banana set, and the output says so.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ntkgp import metrics, plotting
from ntkgp.datasets import load_banana, two_moons
from ntkgp.likelihoods import LogisticLikelihood
from ntkgp.training import HyperparameterSchedule, MAPOptimization, train_marglik

from _common import add_data_arguments, format_table, load_data_or_stand_in, mlp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(parser, quick_help="300 epochs (a smoke test; the table will not match the paper's)")
    parser.add_argument("--epochs", type=int, help="training epochs per network (default: 2000; 300 with --quick)")
    parser.add_argument("--baseline-precision", type=float, default=1e-4, help="the baseline's fixed δ")
    parser.add_argument("--width", type=int, default=50, help="units per hidden layer (default: 50)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.width < 1:
        parser.error(f"--width must be >= 1, got {args.width}")
    if args.epochs is None:
        args.epochs = 300 if args.quick else 2000
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if not args.baseline_precision > 0:
        parser.error(f"--baseline-precision must be positive, got {args.baseline_precision}")
    return args


def stratified_split(y: torch.Tensor, train_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted train and test indices, ``train_fraction`` of each class in train."""
    generator = torch.Generator().manual_seed(seed)
    train, test = [], []
    for label in y.unique():
        members = (y == label).nonzero().squeeze(1)
        members = members[torch.randperm(len(members), generator=generator)]
        cut = round(train_fraction * len(members))
        train.append(members[:cut])
        test.append(members[cut:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def main() -> int:
    args = parse_args()
    (x, y), data_name = load_data_or_stand_in(args.data_dir, load_banana, "banana (toy/banana_400_*.csv)",
                                              lambda: two_moons(400, noise=0.2, seed=0), "two moons")
    train, test = stratified_split(y, 0.7, args.seed)
    x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    start = time.perf_counter()
    settings = {
        "online": {"prior_precision": 1.0, "schedule": HyperparameterSchedule(burn_in=100, frequency=100, hyper_steps=50)},
        "baseline": {"prior_precision": args.baseline_precision,
                     "schedule": HyperparameterSchedule(burn_in=args.epochs, frequency=100, hyper_steps=0)},
    }
    models, rows = {}, []
    for name, setting in settings.items():
        t = time.perf_counter()
        result = train_marglik(mlp(2, 1, width=args.width, depth=2, seed=args.seed), x_train, y_train,
                               LogisticLikelihood().double(), epochs=args.epochs, lr=1e-2,
                               optimization=MAPOptimization(seed=args.seed),
                               progress=False, **setting)
        seconds = time.perf_counter() - t
        model = result.model(x_train, y_train).eval()
        with torch.no_grad():
            predictives = {"MAP": torch.sigmoid(result.net(x_test)).squeeze(-1),
                           "NTKGP": model.likelihood(model(x_test)).probs}
        for kind, probs in predictives.items():
            rows.append([name, kind, " ".join(f"{d:.3g}" for d in result.prior_precision.tolist()),
                         result.log_evidence, metrics.accuracy(probs, y_test), metrics.categorical_nlpd(probs, y_test),
                         metrics.expected_calibration_error(probs, y_test), seconds])
        models[name] = (result, model)
    print(f"data: {data_name}, N_train = {len(x_train)}, N_test = {len(x_test)}, {args.epochs} epochs\n")
    print(format_table(["model", "predictive", "δ per layer", "evidence/N", "test acc", "test NLPD", "ECE",
                        "train s"], rows))
    online, baseline = (models[name][0].log_evidence for name in ("online", "baseline"))
    verdict = "higher" if online > baseline else "NOT higher"
    print(f"\nthe online model's evidence is {verdict} than the baseline's ({online:.3f} vs {baseline:.3f})")
    print(f"total time: {time.perf_counter() - start:.1f} s")

    grid = plotting.grid_2d(x, resolution=80, margin=0.1)
    fig, axes = plotting.new_figure(2, 2)
    for row, (name, (result, model)) in enumerate(models.items()):
        with torch.no_grad():
            maps = {"network (MAP)": torch.sigmoid(result.net(grid.points)).squeeze(-1),
                    "NTKGP predictive": model.likelihood(model(grid.points)).probs}
        for col, (kind, probs) in enumerate(maps.items()):
            plotting.plot_probability_map(axes[row][col], grid, probs, x=x_train, y=y_train,
                                          title=f"{name}, {kind}: evidence/N = {result.log_evidence:.3f}")
    print("figure:", plotting.save_figure(fig, args.output_dir / "banana_classification.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
