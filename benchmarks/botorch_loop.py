"""One Bayesian-optimisation step on Hartmann-6: condition on one new observation, then optimise qLogNEI.

Surrogates, side by side at N = 50, 200 and 1000 observations (uniform random inputs in [0, 1]^6,
standardized negated Hartmann-6 values plus noise of standard deviation 0.05):

* ``NTKGP``: an MLP 6-32-32-1 (tanh, float64) trained to its MAP once per N (not timed), GLM predictive;
  the step conditions with ``model.condition_on_observations`` (= ``condition_on``, the network is not retrained).
* ``SFR``: the same network, M = 64 inducing points; the step conditions with ``update`` (on a copy).
* ``SingleTaskGP``: BoTorch's GP (Matérn-5/2 ARD), hyperparameters fitted once per N (not timed); the step
  conditions with BoTorch's ``condition_on_observations`` (no refit). The refit time, which a BO loop usually
  pays every step, is reported in its own column.

The acquisition is ``qLogNoisyExpectedImprovement`` (q = 1, X_baseline = the observations, pruned, 64 Sobol
samples) optimised by ``optimize_acqf`` with ``num_restarts=2, raw_samples=32`` (gradients on). The median of
``--repeats`` steps is reported, one CPU thread.

    python benchmarks/botorch_loop.py [--sizes 50 200 1000] [--repeats 3] [--write-docs]

``--write-docs`` writes the table into docs/gpytorch_and_botorch.md (generated region ``botorch-loop``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import gpytorch
import torch
from botorch.acquisition import qLogNoisyExpectedImprovement
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP
from botorch.optim import optimize_acqf
from botorch.sampling import SobolQMCNormalSampler
from botorch.test_functions import Hartmann
from gpytorch.mlls import ExactMarginalLogLikelihood

import ntkgp
from ntkgp._doctable import command_line, markdown_table, write_block

D = 6
NOISE = 0.05**2


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, D, dtype=torch.float64, generator=g)
    y = Hartmann(dim=D, negate=True)(x)
    y = (y - 0.3) / 0.4 + 0.05 * torch.randn(n, dtype=torch.float64, generator=g)
    return x, y


def train_network(x: torch.Tensor, y: torch.Tensor, steps: int = 500, prior_precision: float = 1.0) -> torch.nn.Module:
    """MAP of 0.5/σ² Σ (y − f)² + 0.5 δ ‖θ‖² by Adam (full batch)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(D, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    ).double()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.5 / NOISE * (net(x).squeeze(-1) - y).square().sum()
        loss = loss + 0.5 * prior_precision * sum(p.square().sum() for p in net.parameters())
        (loss / len(y)).backward()
        opt.step()
    return net


def gaussian() -> gpytorch.likelihoods.GaussianLikelihood:
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = NOISE
    return lik


def step(model, x_new, y_new, x_all):
    """One timed BO step: (condition time, optimise time)."""
    t0 = time.perf_counter()
    new = model.condition_on_observations(x_new, y_new[:, None])
    t1 = time.perf_counter()
    acqf = qLogNoisyExpectedImprovement(
        new, X_baseline=x_all, sampler=SobolQMCNormalSampler(torch.Size([64]), seed=0), cache_root=False
    )
    bounds = torch.stack([torch.zeros(D), torch.ones(D)]).double()
    optimize_acqf(acqf, bounds=bounds, q=1, num_restarts=2, raw_samples=32)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true",
                        help="write the table into docs/gpytorch_and_botorch.md (region botorch-loop)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in args.sizes:
        x, y = data(n, seed=n)
        x_new, y_new = data(args.repeats, seed=10_000 + n)
        net = train_network(x, y)
        models = {
            "NTKGP": ntkgp.NTKGP(net, x, y, gaussian(), prior_precision=1.0).eval(),
            "SFR (M=64)": ntkgp.SFR(net, x, y, gaussian(), num_inducing=min(64, n), prior_precision=1.0).eval(),
        }
        t = time.perf_counter()
        gp = SingleTaskGP(x, y[:, None])
        fit_gpytorch_mll(ExactMarginalLogLikelihood(gp.likelihood, gp))
        refit = time.perf_counter() - t
        gp.eval()
        gp.posterior(x[:2])  # builds the prediction caches that condition_on_observations extends
        models["SingleTaskGP"] = gp
        for name, model in models.items():
            times = []
            for r in range(args.repeats):
                xn, yn = x_new[r : r + 1], y_new[r : r + 1]
                times.append(step(model, xn, yn, torch.cat([x, xn])))
            cond = statistics.median(t[0] for t in times)
            opt = statistics.median(t[1] for t in times)
            extra = f"{refit:.2f}" if name == "SingleTaskGP" else "—"
            rows.append((n, name, cond, opt, cond + opt, extra))
            print(f"N={n:5d} {name:13s} condition {cond:7.3f} s  optimise {opt:7.3f} s  step {cond + opt:7.3f} s  refit {extra}", flush=True)
    table = markdown_table(
        ["N", "surrogate", "condition (s)", "optimise qLogNEI (s)", "step (s)", "hyperparameter refit (s)"],
        [[n, name, f"{cond:.3f}", f"{opt:.3f}", f"{total:.3f}", extra] for n, name, cond, opt, total, extra in rows],
    )
    print()
    print(table)
    if args.write_docs:
        note = f"Median of {args.repeats} steps, one CPU thread, wall time."
        write_block("docs/gpytorch_and_botorch.md", "botorch-loop", note + "\n\n" + table,
                    command_line())


if __name__ == "__main__":
    main()
