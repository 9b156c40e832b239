"""One round of Algorithm 1 (curvature once + K hyperparameter steps): ntkgp vs laplace-torch marglik_training.

The Snelson case (N = 200, 1-50-50-50-1 tanh, P = 5251, float64), full GGN on both sides, layer-wise prior
precisions and σ. A round is one epoch of MAP training followed by the curvature and K = 100 Adam steps on
the negative evidence. laplace-torch's round is slow (its evidence is a P×P log-determinant per step), so
its hyperparameter steps can be capped with ``--laplace-steps``; its per-step time is then extrapolated
to K and labelled so. The laplace side runs only when laplace-torch is importable.

    python -m benchmarks.marglik_round [--data-dir DATA] [--laplace-steps 5] [--write-docs]

``--write-docs`` writes the result into README.md (generated region ``readme-marglik-round``).

DATA as in ``benchmarks/evidence.py`` (default: ``$NTKGP_DATA_DIR``; without it, synthetic data).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import gpytorch
import torch
from torch import nn

from benchmarks.evidence import _with_laplace, make_data
from ntkgp._doctable import command_line, markdown_table, write_block
from ntkgp.training import HyperparameterSchedule, train_marglik


def snelson_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(),
                         nn.Linear(50, 1)).double()


def ntkgp_round(net, x, y, steps: int) -> float:
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    t = time.perf_counter()
    train_marglik(net, x, y, lik, epochs=1,
                  schedule=HyperparameterSchedule(burn_in=0, frequency=1, hyper_steps=steps), lr=1e-3,
                  progress=False)
    return time.perf_counter() - t


def laplace_round(net, x, y, steps: int) -> float:
    from laplace.marglik_training import marglik_training

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    t = time.perf_counter()
    marglik_training(net, loader, likelihood="regression", hessian_structure="full", n_epochs=1, n_epochs_burnin=0,
                     marglik_frequency=1, n_hypersteps=steps, optimizer_kwargs={"lr": 1e-3})
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("NTKGP_DATA_DIR"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--laplace-steps", type=int, default=5)
    parser.add_argument("--write-docs", action="store_true", help="write the result into README.md")
    args = parser.parse_args()
    command = command_line() + _with_laplace()
    x, y, source = make_data(args.data_dir)
    net = snelson_net()
    print(f"data: {source}, N = {len(x)}, P = {sum(p.numel() for p in net.parameters())}, float64, K = {args.steps}")
    ntkgp_round(copy.deepcopy(net), x[:20], y[:20], 1)  # warm-up: one-time imports and torch.func set-up
    ours = ntkgp_round(copy.deepcopy(net), x, y, args.steps)
    print(f"ntkgp train_marglik, one round (1 epoch + curvature + {args.steps} steps): {ours:.3f} s")
    try:
        import laplace  # noqa: F401
    except ImportError:
        print("laplace-torch is not installed: its side is skipped")
        if args.write_docs:
            write_block("README.md", "readme-marglik-round", markdown_table(
                ["one Algorithm-1 round", "ntkgp `train_marglik`"],
                [[f"1 epoch + curvature + {args.steps} steps, {source}", f"{ours:.3g} s"]]) +
                "\n\nlaplace-torch was not importable in this run: its side is absent.", command)
        return
    t1 = laplace_round(copy.deepcopy(net), x, y, 1)
    tk = laplace_round(copy.deepcopy(net), x, y, args.laplace_steps)
    per_step = (tk - t1) / max(args.laplace_steps - 1, 1)
    theirs = t1 + per_step * (args.steps - 1)
    print(f"laplace-torch marglik_training full GGN: 1 step {t1:.2f} s, {args.laplace_steps} steps {tk:.2f} s "
          f"→ {per_step:.2f} s/step, one round with {args.steps} steps ≈ {theirs:.1f} s (extrapolated)")
    print(f"speed-up per round: {theirs / ours:.0f}x")
    if args.write_docs:
        table = markdown_table(
            ["one Algorithm-1 round (full GGN)", "ntkgp `train_marglik`", "laplace-torch `marglik_training`",
             "ntkgp faster by"],
            [[f"1 epoch + curvature + {args.steps} steps, {source}", f"{ours:.3g} s",
              f"≈ {theirs:.3g} s ({args.laplace_steps} steps measured: {per_step:.3g} s/step, extrapolated to "
              f"{args.steps})", f"≈ {theirs / ours:.0f}×"]])
        write_block("README.md", "readme-marglik-round", table, command)


if __name__ == "__main__":
    main()
