"""Bayesian optimisation with a network surrogate (NTKGP, SFR) against BoTorch's SingleTaskGP.

Problems: Branin (2-d) and Hartmann-6, inputs scaled to the unit cube, maximised (negated functions).
Each run starts from ``2d + 1`` Sobol points and takes one point per iteration chosen by ``LogExpectedImprovement``
(``optimize_acqf``, 4 restarts, 64 raw samples, gradients on). Surrogates:

* ``NTKGP``: an MLP d-32-32-1 (tanh, float64) trained to its MAP (Adam, Gaussian likelihood σ = 0.1 on
  standardized values, prior precision δ = 1) every ``--retrain-every`` iterations; in between the model is
  only conditioned on the new point (``NTKGP.condition_on``: the network is not retrained).
* ``SFR``: the same network and schedule, ``SFR.update`` in between (M = all points up to 64).
* ``SingleTaskGP``: refit (hyperparameters by ``fit_gpytorch_mll``) at every iteration, BoTorch's default loop.

Printed: the mean (± standard deviation over seeds) simple regret ``f* − best value found`` after several
iteration budgets, and the wall-clock time per iteration (surrogate update + acquisition optimisation).
Saved: ``bo_regret.png`` (log regret per iteration, mean over seeds) in ``--output-dir``.

    python examples/bayesian_optimization.py [--quick] [--seeds 5] [--iterations 40] [--output-dir DIR]

(``--quick``: 2 seeds, 12 iterations, 300 training steps; an explicit option overrides it.)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gpytorch
import torch
from botorch.acquisition import LogExpectedImprovement
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP
from botorch.optim import optimize_acqf
from botorch.test_functions import Branin, Hartmann
from gpytorch.mlls import ExactMarginalLogLikelihood
from torch.quasirandom import SobolEngine

import ntkgp

NOISE = 0.1**2  # likelihood noise of the network surrogates, on standardized values
PROBLEMS = {"Branin": Branin(negate=True), "Hartmann-6": Hartmann(dim=6, negate=True)}


def evaluate(problem, x: torch.Tensor) -> torch.Tensor:
    """The function at unit-cube inputs ``x``."""
    lower, upper = problem.bounds.to(x)
    return problem(lower + (upper - lower) * x)


def train_network(x: torch.Tensor, y: torch.Tensor, steps: int, seed: int) -> torch.nn.Module:
    """MAP of 0.5/σ² Σ (y − f)² + 0.5 ‖θ‖² by full-batch Adam, from a fresh initialization."""
    torch.manual_seed(seed)
    d = x.shape[-1]
    net = torch.nn.Sequential(
        torch.nn.Linear(d, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    ).double()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.5 / NOISE * (net(x).squeeze(-1) - y).square().sum()
        loss = loss + 0.5 * sum(p.square().sum() for p in net.parameters())
        (loss / len(y)).backward()
        opt.step()
    return net


class NetworkSurrogate:
    """A network surrogate (``"ntkgp"`` or ``"sfr"``), retrained every ``retrain_every`` steps, conditioned in between."""

    def __init__(self, kind: str, retrain_every: int, train_steps: int, seed: int):
        self.kind, self.retrain_every, self.train_steps, self.seed = kind, retrain_every, train_steps, seed
        self.model, self.since, self.shift, self.scale = None, 0, 0.0, 1.0

    def fit(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Full retraining on all data: new standardization, new network, new model."""
        self.shift, self.scale = y.mean(), y.std().clamp_min(1e-9)
        z = (y - self.shift) / self.scale
        net = train_network(x, z, self.train_steps, self.seed)
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = NOISE
        if self.kind == "ntkgp":
            self.model = ntkgp.NTKGP(net, x, z, lik, prior_precision=1.0).eval()
        else:
            self.model = ntkgp.SFR(net, x, z, lik, num_inducing=min(64, len(z)), prior_precision=1.0).eval()
        self.since = 0

    def observe(self, x: torch.Tensor, y: torch.Tensor, x_new: torch.Tensor, y_new: torch.Tensor) -> None:
        """Retrain every ``retrain_every`` observations, else condition on the new one (same network)."""
        self.since += 1
        if self.since >= self.retrain_every:
            self.fit(x, y)
            return
        z_new = (y_new - self.shift) / self.scale
        if self.kind == "ntkgp":
            self.model = self.model.condition_on(x_new, z_new)
        else:
            self.model.update(x_new, z_new)

    def best_f(self, y: torch.Tensor) -> torch.Tensor:
        return (y.max() - self.shift) / self.scale


class GPSurrogate:
    """BoTorch's SingleTaskGP, refit at every step (its default transforms standardize the outputs)."""

    def fit(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model = SingleTaskGP(x, y[:, None])
        fit_gpytorch_mll(ExactMarginalLogLikelihood(self.model.likelihood, self.model))
        self.y = y

    def observe(self, x, y, x_new, y_new) -> None:
        self.fit(x, y)

    def best_f(self, y: torch.Tensor) -> torch.Tensor:
        return y.max()  # SingleTaskGP's posterior is in the original units (outcome transform undone)


def run(problem, surrogate, iterations: int, seed: int) -> tuple[list[float], float]:
    """One BO run: regret after each iteration, seconds per iteration."""
    d = problem.dim
    x = SobolEngine(d, scramble=True, seed=seed).draw(2 * d + 1).double()
    y = evaluate(problem, x)
    bounds = torch.stack([torch.zeros(d), torch.ones(d)]).double()
    surrogate.fit(x, y)
    regret, start = [], time.perf_counter()
    for i in range(iterations):
        torch.manual_seed(1000 * seed + i)
        acqf = LogExpectedImprovement(surrogate.model, best_f=surrogate.best_f(y))
        candidate, _ = optimize_acqf(acqf, bounds=bounds, q=1, num_restarts=4, raw_samples=64)
        y_new = evaluate(problem, candidate)
        x, y = torch.cat([x, candidate]), torch.cat([y, y_new])
        surrogate.observe(x, y, candidate, y_new)
        regret.append(float(problem.optimal_value - y.max()))
    return regret, (time.perf_counter() - start) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, 12 iterations, 300 training steps")
    parser.add_argument("--seeds", type=int, help="runs per problem and surrogate (default: 5; 2 with --quick)")
    parser.add_argument("--iterations", type=int, help="BO iterations per run (default: 40; 12 with --quick)")
    parser.add_argument("--retrain-every", type=int, default=5)
    parser.add_argument("--train-steps", type=int, help="Adam steps per training (default: 500; 300 with --quick)")
    parser.add_argument("--output-dir", type=Path, default=Path("examples-output"))
    args = parser.parse_args()
    for name, full, quick in (("seeds", 5, 2), ("iterations", 40, 12), ("train_steps", 500, 300)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("seeds", "iterations", "train_steps", "retrain_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    budgets = sorted({b for b in (5, 10, 20, 40, args.iterations) if b <= args.iterations})
    names = ["NTKGP", "SFR", "SingleTaskGP"]
    results = {}
    for pname, problem in PROBLEMS.items():
        for name in names:
            runs, times = [], []
            for seed in range(args.seeds):
                if name == "SingleTaskGP":
                    surrogate = GPSurrogate()
                else:
                    surrogate = NetworkSurrogate(name.lower(), args.retrain_every, args.train_steps, seed)
                regret, seconds = run(problem, surrogate, args.iterations, seed)
                runs.append(regret)
                times.append(seconds)
            results[pname, name] = (torch.tensor(runs), sum(times) / len(times))
            print(f"{pname:10s} {name:12s} final regret {torch.tensor(runs)[:, -1].mean():.4f}  {results[pname, name][1]:.2f} s/iter", flush=True)

    header = " | ".join(f"regret @ {b}" for b in budgets)
    print(f"\n| problem | surrogate | {header} | s / iteration |")
    print("|---|---|" + "---|" * len(budgets) + "---|")
    for (pname, name), (regret, seconds) in results.items():
        cells = " | ".join(f"{regret[:, b - 1].mean():.3g} ± {regret[:, b - 1].std(unbiased=False):.2g}" for b in budgets)
        print(f"| {pname} | {name} | {cells} | {seconds:.2f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PROBLEMS), figsize=(5 * len(PROBLEMS), 3.5))
    for ax, pname in zip(axes, PROBLEMS):
        for name in names:
            regret = results[pname, name][0].clamp_min(1e-8)
            ax.plot(range(1, args.iterations + 1), regret.log10().mean(0), label=name)
        ax.set_title(pname)
        ax.set_xlabel("iteration")
        ax.set_ylabel("log10 simple regret (mean over seeds)")
    axes[0].legend()
    fig.tight_layout()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / "bo_regret.png"
    fig.savefig(path, dpi=120)
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
