"""Snelson 1-D regression: choosing the architecture and the prior precision by the Laplace evidence.

Reproduces the two experiments of Immer et al. (2021) on the Snelson data (their figures 1 and 4):

1. **Architecture.** A 1- and a 3-hidden-layer tanh network (width 50) are trained with Algorithm 1
   (online evidence optimisation, ``ntkgp.training.train_marglik``): one prior precision per layer and the
   noise σ are learned while the network trains. ``compare_models`` ranks them by evidence per data point.
2. **Prior precision.** The 3-hidden-layer network with a single (scalar) prior precision δ, noise fixed at the
   value learned in 1: online learning of δ from three initialisations (1e-3, 1, 1e3) is compared with a grid
   search, which trains the network with each fixed δ of a grid and evaluates the evidence at that MAP.

The settings of part 1 are the paper's: the data in their original units, full-batch Adam with step 0.01 for
the parameters and the hyperparameters, the evidence recomputed after every epoch (F = 1, B = 0, K = 1), the
full Laplace-GGN evidence, 1000 epochs. Part 2 takes K = 50 steps of size 0.1 every F = 50 epochs, so that
the start at δ = 1e3 (the paper starts at 1e2) travels the six orders of magnitude within the 1000 epochs. Prints two tables and writes ``snelson_regression.png``.

    python examples/snelson_regression.py --data-dir DATA --output-dir examples-output
    python examples/snelson_regression.py --quick     # width 20, 100 epochs, a 3-value grid: about a minute

``DATA`` is the benchmark data folder (``toy/``, ``uci_regression/``, ...); without ``--data-dir`` the
``NTKGP_DATA_DIR`` environment variable is used; without either, a synthetic 1-D stand-in (200 points of
``ntkgp.datasets.gap_regression``, noise 0.3) replaces the Snelson data, and the output says so.
"""

from __future__ import annotations

import argparse
import sys
import time

import gpytorch
import torch

from ntkgp import plotting
from ntkgp.datasets import gap_regression, load_snelson
from ntkgp.training import compare_models, HyperparameterSchedule, MAPOptimization, MarglikResult, train_marglik

from _common import add_data_arguments, format_table, load_data_or_stand_in, mlp

INITIAL_PRECISIONS = (1e-3, 1.0, 1e3)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(parser, quick_help="width 20, 100 epochs and a 3-value grid (a smoke test; the tables "
                       "will not match the paper's)")
    parser.add_argument("--width", type=int, help="units per hidden layer (default: 50; 20 with --quick)")
    parser.add_argument("--epochs", type=int, help="training epochs per network (default: 1000; 100 with --quick)")
    parser.add_argument("--grid-size", type=int,
                        help="δ values of the grid search, 1e-3..1e3 (default: 9; 3 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.epochs is None:
        args.epochs = 100 if args.quick else 1000
    if args.grid_size is None:
        args.grid_size = 3 if args.quick else 9
    if args.width is None:
        args.width = 20 if args.quick else 50
    if args.epochs < 1 or args.grid_size < 2 or args.width < 1:
        parser.error(f"--epochs and --width must be >= 1 and --grid-size >= 2, got {args.epochs}, {args.width} "
                     f"and {args.grid_size}")
    return args


def stand_in() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Synthetic 1-D data in place of Snelson's: 200 noisy points of sin(4x) with a gap, a test grid."""
    data = gap_regression(n=200, noise_std=0.3, seed=0)
    return data.x_train, data.y_train, data.x_test


def train(x: torch.Tensor, y: torch.Tensor, depth: int, epochs: int, seed: int, width: int, *,
          prior_precision: float = 1.0,
          prior_structure: str = "layer", noise: float | None = None, learn_hypers: bool = True,
          hyper_lr: float = 1e-2, frequency: int = 1, hyper_steps: int = 1) -> MarglikResult:
    """Algorithm 1 on a tanh net with ``depth`` hidden layers of ``width`` units; ``noise`` fixes σ² (not
    learned); ``learn_hypers=False`` keeps δ
    fixed too and evaluates the evidence once, at the end of training (the grid search)."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    if noise is not None:
        likelihood.noise = noise
    return train_marglik(
        mlp(1, 1, width=width, depth=depth, seed=seed), x, y, likelihood, prior_structure=prior_structure,
        prior_precision=prior_precision, epochs=epochs, lr=1e-2,
        schedule=HyperparameterSchedule(burn_in=0 if learn_hypers else epochs, frequency=frequency,
                                        hyper_steps=hyper_steps if learn_hypers else 0, hyper_lr=hyper_lr,
                                        learn_likelihood=noise is None),
        optimization=MAPOptimization(seed=seed),
        progress=False,
    )


def main() -> int:
    args = parse_args()
    (x_raw, y_raw, x_plot_raw), data_name = load_data_or_stand_in(
        args.data_dir, load_snelson, "Snelson (toy/snelson_*.dat)", stand_in, "synthetic 1-D gap regression")
    print(f"data: {data_name}, N = {len(x_raw)}; width {args.width}, {args.epochs} epochs per network, grid of {args.grid_size}\n")
    x, y = x_raw, y_raw
    x_plot = x_plot_raw.sort(dim=0).values
    n = len(x)
    start = time.perf_counter()

    # 1. architecture selection: 1 vs 3 hidden layers, online δ (per layer) and σ
    nets = {}
    for depth in (1, 3):
        t = time.perf_counter()
        nets[f"{depth} hidden layer{'s' if depth > 1 else ''}"] = (train(x, y, depth, args.epochs, args.seed,
                                                                        args.width),
                                                                  time.perf_counter() - t)
    models = {name: result.model(x, y) for name, (result, _) in nets.items()}
    table = compare_models(models)
    print("1. Architecture selection by the evidence (online δ per layer and σ)\n")
    print(format_table(
        ["network", "log evidence/N", "train NLL/N", "P", "σ", "δ per layer", "train s"],
        [[row.name, row.log_evidence_per_n, row.train_nll_per_n, row.num_params,
          row.likelihood_hypers["noise"][0] ** 0.5, " ".join(f"{d:.3g}" for d in row.prior_precision),
          nets[row.name][1]] for row in table]))
    deep_wins = table.best.name.startswith("3")
    print(f"\nhighest evidence: {table.best.name} -> the 3-layer net {'wins' if deep_wins else 'does NOT win'}")

    # 2. prior-precision selection: online from three initialisations vs grid search (σ fixed)
    noise = nets["3 hidden layers"][0].likelihood.noise.item()
    online = {delta0: train(x, y, 3, args.epochs, args.seed, args.width, prior_precision=delta0,
                            prior_structure="network", noise=noise,
                            hyper_lr=0.1, frequency=50, hyper_steps=50)
              for delta0 in INITIAL_PRECISIONS}
    grid = torch.logspace(-3, 3, args.grid_size, dtype=torch.float64).tolist()
    searched = [train(x, y, 3, args.epochs, args.seed, args.width, prior_precision=d, prior_structure="network",
                      noise=noise,
                      learn_hypers=False).log_evidence for d in grid]
    best = max(range(len(grid)), key=searched.__getitem__)
    print(f"\n2. Scalar δ of the 3-hidden-layer net, σ fixed at {noise ** 0.5:.3f}: online vs grid search\n")
    rows = [[f"online, δ0 = {d0:g}", float(r.prior_precision[0]), r.log_evidence, r.best_epoch]
            for d0, r in online.items()]
    rows.append([f"grid search ({len(grid)} values)", grid[best], searched[best], args.epochs])
    print(format_table(["method", "δ", "log evidence/N", "epoch"], rows, digits=4))
    print(f"\ntotal time: {time.perf_counter() - start:.1f} s (N = {n})")

    fig, axes = plotting.new_figure(1, 3, panel_size=(5.0, 3.8))
    for ax, (name, model) in zip(axes[0], models.items()):
        model.eval()
        with torch.no_grad():
            predictive = model.likelihood(model(x_plot))
        evidence = next(row.log_evidence_per_n for row in table if row.name == name)
        plotting.plot_regression(ax, x_plot, predictive.mean, predictive.variance.sqrt(), x_train=x_raw, y_train=y_raw,
                                 title=f"{name}: log evidence/N = {evidence:.3f}")
        ax.set_ylim(float(y_raw.min()) - 2.0, float(y_raw.max()) + 2.0)
    ax = axes[0][2]
    ax.plot(grid, searched, "k.-", label="grid search (train at fixed δ)")
    for k, (delta0, result) in enumerate(online.items()):
        path = [(h["prior_precision"][0], h["log_evidence"]) for h in result.history]
        ax.plot(*zip(*path), ".-", color=f"C{k}", alpha=0.7, label=f"online, δ0 = {delta0:g}")
        ax.plot(*path[-1], "o", color=f"C{k}", ms=8)
    ax.set_xscale("log")
    ax.set_xlabel("prior precision δ")
    ax.set_ylabel("log evidence / N")
    ax.set_title("online δ learning vs grid search")
    ax.legend(fontsize="x-small")
    print("figure:", plotting.save_figure(fig, args.output_dir / "snelson_regression.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
