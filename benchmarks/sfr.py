"""SFR: build, predict and update times against those of the public SFR code (aidanscannell/sfr).

MLP 8-50-50-C (tanh), float64, random inputs; C = 1 regression (N = 10,000, M = 512) and C = 10
classification (N = 5,000, M = 256). Timed: build (streaming the dual statistics and factorising, as the
public ``fit``), predict 2,000 points (mean and marginal variances, factorisations cached), update with
1,000 points (new statistics and refactorisation). Each setting is warmed up on a small problem first; the
best of ``--repeats`` runs is reported (the machine has 2 cores; other load inflates the figures). The setting comparable to the public code is zero prior
mean, independent outputs and one prior precision (``prior_structure="network"``); the other rows show per-layer
prior precisions (statistics kept per group pair, so δ stays learnable) and joint C×C coupling (``output_coupling="joint"``).

    python benchmarks/sfr.py [--repeats 2] [--write-docs]

``--write-docs`` writes the table into docs/sfr.md (region ``sfr-times``).
"""

from __future__ import annotations

import argparse
import time

import torch
from gpytorch.likelihoods import GaussianLikelihood
from torch import nn

from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR

# The public SFR code (aidanscannell/sfr), measured on a 2-core CPU machine at the same sizes, float64, batch 1000:
# (build, predict 2000, update 1000) seconds.
REFERENCE = {1: (2.0, 0.56, 0.10), 10: (3.6, 5.3, 0.66)}
SIZES = {1: (10_000, 512), 10: (5_000, 256)}


def network(c: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, c)).double().eval()


def data(net: nn.Module, n: int, c: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, dtype=torch.float64, generator=g)
    with torch.no_grad():
        f = net(x)
    if c == 1:
        return x, f.squeeze(-1) + 0.1 * torch.randn(n, dtype=torch.float64, generator=g)
    return x, torch.distributions.Categorical(logits=f).sample()


def run(c: int, prior_structure: str, coupling: str, repeats: int) -> tuple[float, float, float]:
    n, m = SIZES[c]
    net = network(c)
    x, y = data(net, n, c, 1)
    x_new, y_new = data(net, 1000, c, 2)
    x_test, _ = data(net, 2000, c, 3)
    lik = GaussianLikelihood().double() if c == 1 else SoftmaxLikelihood(c).double()
    warm = SFR(net, x[: 2 * m], y[: 2 * m], lik, num_inducing=m, prior_mean="zero", output_coupling=coupling,
               prior_structure=prior_structure)
    _ = warm(x_test[:100]).variance
    warm.update(x_new[:100], y_new[:100])
    best = [float("inf")] * 3
    for _ in range(repeats):
        lik = GaussianLikelihood().double() if c == 1 else SoftmaxLikelihood(c).double()
        t0 = time.perf_counter()
        sfr = SFR(net, x, y, lik, num_inducing=m, prior_mean="zero", output_coupling=coupling,
                  prior_structure=prior_structure, seed=0)
        sfr._factors()
        t1 = time.perf_counter()
        dist = sfr(x_test)
        _ = (dist.mean, dist.variance)
        t2 = time.perf_counter()
        sfr.update(x_new, y_new)
        sfr._factors()
        t3 = time.perf_counter()
        best = [min(b, t) for b, t in zip(best, (t1 - t0, t2 - t1, t3 - t2))]
    return tuple(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/sfr.md")
    args = parser.parse_args()
    settings = [
        (1, "network", "independent", "comparable (1 δ)"),
        (1, "layer", "independent", "δ per layer"),
        (10, "network", "independent", "comparable (1 δ)"),
        (10, "layer", "independent", "δ per layer"),
        (10, "network", "joint", "joint C×C, 1 δ"),
    ]
    header = f"{'N, M, C':<16}{'setting':<20}{'build s (ref, ratio)':<26}{'predict s (ref, ratio)':<26}{'update s (ref, ratio)':<26}"
    print(header)
    print("-" * len(header))
    table = []
    for c, prior_structure, coupling, label in settings:
        times = run(c, prior_structure, coupling, args.repeats)
        n, m = SIZES[c]
        cells = [f"{t:6.3f} ({r:.2f}, {t / r:.2f}x)" for t, r in zip(times, REFERENCE[c])]
        print(f"{f'{n}, {m}, {c}':<16}{label:<20}" + "".join(f"{cell:<26}" for cell in cells), flush=True)
        table.append([f"{n}, {m}, {c}", label] + [f"{t:.2f} ({r:.2f})" for t, r in zip(times, REFERENCE[c])])
    if args.write_docs:
        from ntkgp._doctable import command_line, markdown_table, write_block

        content = markdown_table(["N, M, C", "setting", "build s (public code)", "predict 2000 s (public code)",
                                  "update 1000 s (public code)"], table)
        content += (f"\n\nBest of {args.repeats}, float64, MLP 8-50-50-C, `torch.get_num_threads() = "
                    f"{torch.get_num_threads()}`. The public code's figures in parentheses are constants of the "
                    "script (`REFERENCE`), measured once on a quiet 2-core machine, not in this run.")
        write_block("docs/sfr.md", "sfr-times", content, command_line())


if __name__ == "__main__":
    main()
