"""Data arriving in batches: updating SFR without retraining vs retraining from scratch.

The training split of a UCI regression set (default: concrete, 927 training / 103 test points, split 0 of
``uci_regression/concrete``) arrives in ``--batches`` equal batches (seeded shuffle). After the first batch a
tanh network (D-50-50-1) is trained with Algorithm 1 (``train_marglik``: online δ per layer and noise) and
summarised by SFR with ``M`` inducing inputs from that batch. Then, for each further batch:

* **SFR update**: ``sfr.update(x_batch, y_batch)`` adds the batch's dual statistics (network, inducing inputs
  and hyperparameters unchanged; the old data are not read again);
* **retrain**: a fresh network is trained with Algorithm 1 on all data so far and a new SFR is built;
* **no update**: the first-batch SFR as it was (a reference).

Prints test NLPD (original units) and wall time per batch, and writes ``sequential_updates.png``.

    python examples/sequential_updates.py --data-dir DATA --output-dir examples-output
    python examples/sequential_updates.py --quick     # 3 batches, 100 epochs, M = 50: under a minute

``DATA`` is the benchmark data folder (``toy/``, ``uci_regression/``, ...); without ``--data-dir`` the
``NTKGP_DATA_DIR`` environment variable is used; without either, scikit-learn's bundled diabetes set (442
points, 10 inputs; a seeded 90/10 split, standardized like the UCI sets) replaces the UCI set, and the
output says so.
"""

from __future__ import annotations

import argparse
import sys
import time

import gpytorch
import numpy as np
import torch

from ntkgp import metrics, plotting
from ntkgp.datasets import RegressionSplit, load_uci_regression
from ntkgp.models.sfr import SFR
from ntkgp.training import HyperparameterSchedule, MAPOptimization, train_marglik

from _common import add_data_arguments, format_table, load_data_or_stand_in, mlp
from ntkgp.models import SFRInducingOptions


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(parser, quick_help="3 batches, 100 epochs, M = 50 (a smoke test)")
    parser.add_argument("--dataset", default="concrete", help="a folder of uci_regression (default: concrete)")
    parser.add_argument("--batches", type=int, help="number of batches (default: 5; 3 with --quick)")
    parser.add_argument("--num-inducing", type=int, help="M, inducing inputs (default: 100; 50 with --quick)")
    parser.add_argument("--epochs", type=int, help="epochs per training (default: 500; 100 with --quick)")
    parser.add_argument("--width", type=int, default=50, help="units per hidden layer (default: 50)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, full, quick in (("batches", 5, 3), ("num_inducing", 100, 50), ("epochs", 500, 100),
                              ("width", 50, 50)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batches < 2:
        parser.error(f"--batches must be >= 2 (the first trains, the others update), got {args.batches}")
    return args


def diabetes(seed: int = 0) -> RegressionSplit:
    """scikit-learn's bundled diabetes set (442 × 10), a seeded 90/10 split standardized with the training
    statistics (population std), like :func:`ntkgp.datasets.load_uci_regression`."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = round(0.1 * len(y))
    test, train = order[:n_test], order[n_test:]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    y_mean, y_std = float(y[train].mean()), float(y[train].std())
    xs = torch.as_tensor((x - x_mean) / np.where(x_std > 0, x_std, 1.0))
    ys = torch.as_tensor((y - y_mean) / y_std)[:, None]
    return RegressionSplit(xs[train], ys[train], xs[test], ys[test], y_mean, y_std)


def train_sfr(x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> SFR:
    """Algorithm 1 on a fresh network, then SFR with the learned hyperparameters."""
    result = train_marglik(mlp(x.shape[1], 1, width=args.width, depth=2, seed=args.seed), x, y,
                           gpytorch.likelihoods.GaussianLikelihood().double(), epochs=args.epochs, lr=1e-2,
                           schedule=HyperparameterSchedule(burn_in=100, frequency=100, hyper_steps=50),
                           optimization=MAPOptimization(seed=args.seed), progress=False)
    return SFR(result.net, x, y, result.likelihood, num_inducing=min(args.num_inducing, len(x)),
               prior_precision=result.prior_precision, prior_structure=result.kernel.prior_structure,
               inducing=SFRInducingOptions(seed=args.seed))


def test_nlpd(sfr: SFR, data: RegressionSplit) -> float:
    """Test NLPD of the predictive over y, in the original units of the target."""
    with torch.no_grad():
        predictive = sfr.likelihood(sfr(data.x_test))
    return metrics.gaussian_nlpd(predictive.mean, predictive.variance, data.y_test, y_scale=data.y_std)


def main() -> int:
    args = parse_args()
    data, data_name = load_data_or_stand_in(
        args.data_dir, lambda folder: load_uci_regression(folder, args.dataset),
        f"UCI {args.dataset} (uci_regression/{args.dataset}, split 0)", diabetes, "scikit-learn's diabetes")
    order = torch.randperm(len(data.x_train), generator=torch.Generator().manual_seed(args.seed))
    batches = order.tensor_split(args.batches)
    start = time.perf_counter()

    t = time.perf_counter()
    first = batches[0]
    updated = train_sfr(data.x_train[first], data.y_train[first], args)
    first_seconds = time.perf_counter() - t
    frozen = test_nlpd(updated, data)
    rows = [[1, len(first), frozen, frozen, first_seconds, frozen, first_seconds]]
    for b, batch in enumerate(batches[1:], start=2):
        t = time.perf_counter()
        updated.update(data.x_train[batch], data.y_train[batch])
        update_seconds = time.perf_counter() - t
        seen = torch.cat(batches[:b])
        t = time.perf_counter()
        retrained = train_sfr(data.x_train[seen], data.y_train[seen], args)
        retrain_seconds = time.perf_counter() - t
        rows.append([b, len(seen), frozen, test_nlpd(updated, data), update_seconds, test_nlpd(retrained, data),
                     retrain_seconds])
    print(f"data: {data_name}: {len(data.x_train)} training points in {args.batches} batches, "
          f"{len(data.x_test)} test points, M = {updated.num_inducing}, {args.epochs} epochs per training\n")
    print(format_table(["batch", "N seen", "NLPD no update", "NLPD SFR update", "update s", "NLPD retrain",
                        "retrain s"], rows))
    print("\nbatch 1: both methods are the same model (its time: training + building SFR)")
    print(f"total time: {time.perf_counter() - start:.1f} s")

    fig, axes = plotting.new_figure(1, 2)
    seen_counts = [row[1] for row in rows]
    for column, label, style in ((2, "no update", "k:"), (3, "SFR update", "C0o-"), (5, "retrain", "C1s-")):
        axes[0][0].plot(seen_counts, [row[column] for row in rows], style, label=label)
    axes[0][0].set_ylabel("test NLPD")
    axes[0][1].plot(seen_counts[1:], [row[4] for row in rows[1:]], "C0o-", label="SFR update")
    axes[0][1].plot(seen_counts, [row[6] for row in rows], "C1s-", label="retrain (train + build SFR)")
    axes[0][1].set_yscale("log")
    axes[0][1].set_ylabel("wall time per batch (s)")
    for ax, title in zip(axes[0], ("test NLPD after each batch", "time per batch")):
        ax.set_xlabel("training points seen")
        ax.set_title(f"{data_name.split(' (')[0]}: {title}")
        ax.legend(fontsize="small")
    print("figure:", plotting.save_figure(fig, args.output_dir / "sequential_updates.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
