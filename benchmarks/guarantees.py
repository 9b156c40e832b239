"""The measurements behind docs/guarantees.md: float32 predictive variances, and iterated sites.

``float32``: an ill-conditioned regression (400 inputs that are 40 points each repeated 10 times up to 1e-5, a
1-24-24-1 tanh MLP with P = 673, Gaussian noise 1e-4, 50 test points; the problem of
``tests/laplace/test_float32_variance.py``): the float32 GLM variances in weight space (the ``space="auto"``
choice) and in function space (forced) against float64, and float64 weight vs function space.

``sites``: a 2-50-50-1 tanh MLP trained to its MAP (δ = 0.1, Adam then L-BFGS) on 200 two-moons points
(``sklearn.datasets.make_moons``, noise 0.1) without the right tip of the lower moon (x₁ > 1.5), then
conditioned on the held-out tip with one Newton step (``iterate=False``) and with iterated sites (the
default); accuracy on 1000 test points, for ``NTKGP`` and ``SFR`` (M = 60 random inducing inputs).

    python benchmarks/guarantees.py [--parts float32 sites] [--seeds 0 1 2 3 4] [--write-docs]

``--write-docs`` writes the tables into docs/guarantees.md (generated regions ``guarantees-float32`` and
``guarantees-iterated-sites``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import gpytorch
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from map_fit import fit_map  # noqa: E402

import ntkgp  # noqa: E402
from ntkgp._doctable import command_line, markdown_table, write_block
from ntkgp.likelihoods import LogisticLikelihood

DOC = "docs/guarantees.md"


def ill_conditioned(dtype: torch.dtype, space: str = "auto"):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 1)).double()
    base = torch.linspace(-2, 2, 40, dtype=torch.float64)[:, None]
    x = base.repeat(10, 1) + 1e-5 * torch.randn(400, 1, dtype=torch.float64)
    y = torch.sin(3 * x).squeeze(-1)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    lik.noise = 1e-4
    model = ntkgp.NTKGP(copy.deepcopy(net).to(dtype), x.to(dtype), y.to(dtype), lik, space=space).eval()
    return model, torch.linspace(-2.5, 2.5, 50, dtype=torch.float64)[:, None].to(dtype)


def raw_variances(model, x_test) -> torch.Tensor:
    """The marginal variances as returned (function space clips negative ones at zero, with a warning)."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(x_test).lazy_covariance_matrix.diagonal().double()


def float32_table() -> str:
    ref_model, x_test = ill_conditioned(torch.float64)
    reference = raw_variances(ref_model, x_test)
    rows = []
    for label, dtype, space in [("weight space (auto)", torch.float32, "auto"),
                                ("function space (forced)", torch.float32, "function"),
                                ("weight space (forced)", torch.float64, "weight")]:
        model, xt = ill_conditioned(dtype, space)
        variance = raw_variances(model, xt)
        err = ((variance - reference).abs() / reference).max().item()
        zeros = int((variance <= 0).sum())
        rows.append([label, str(dtype).replace("torch.", ""), model.site_posterior().space.value, f"{err:.2g}",
                     f"{zeros} of {len(variance)}"])
    return (f"Reference: float64, `space=\"auto\"` ({ref_model.site_posterior().space.value} space).\n\n"
            + markdown_table(["form", "precision", "space used", "largest relative error vs float64",
                              "variances ≤ 0 after clipping"], rows))


def moons(n: int, seed: int):
    from sklearn.datasets import make_moons

    x, y = make_moons(n, noise=0.1, random_state=seed)
    return torch.tensor(x, dtype=torch.float64), torch.tensor(y)


def train(x, y, seed: int, delta: float = 0.1) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 1)).double()

    def objective():
        loss = nn.functional.binary_cross_entropy_with_logits(net(x).squeeze(-1), y.double(), reduction="sum")
        return loss + 0.5 * delta * sum(p.square().sum() for p in net.parameters())

    return fit_map(net, objective, adam_steps=500, lbfgs_iterations=300)


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return ((model(x).mean.reshape(-1) > 0).long() == y).double().mean().item()


def sites_table(seeds: list[int], on_row=None) -> str:
    """The table; ``on_row(table_so_far)`` is called after each seed (the docs are written as seeds finish)."""
    rows = []
    header = ["seed", "tip points", "network on the tip (min f)", "NTKGP before", "NTKGP one step", "NTKGP iterated",
              "SFR one step", "SFR iterated"]
    for seed in seeds:
        x, y = moons(200, seed)
        x_test, y_test = moons(1000, seed + 100)
        tip = (y == 1) & (x[:, 0] > 1.5)
        net = train(x[~tip], y[~tip], seed)
        with torch.no_grad():
            min_f = net(x[tip]).min().item()
        lik = LogisticLikelihood().double()
        kw = {"prior_precision": 0.1, "prior_structure": "network"}
        model = ntkgp.NTKGP(net, x[~tip], y[~tip], lik, **kw).eval()
        before = accuracy(model, x_test, y_test)
        one = accuracy(model.condition_on(x[tip], y[tip], iterate=False), x_test, y_test)
        iterated = accuracy(model.condition_on(x[tip], y[tip]), x_test, y_test)
        sfr = ntkgp.SFR(net, x[~tip], y[~tip], lik, num_inducing=60, **kw)
        sfr_one = copy.deepcopy(sfr)
        sfr_one.update(x[tip], y[tip], iterate=False)
        sfr.update(x[tip], y[tip])
        rows.append([seed, int(tip.sum()), f"{min_f:.1f}", f"{before:.3f}", f"{one:.3f}", f"{iterated:.3f}",
                     f"{accuracy(sfr_one.eval(), x_test, y_test):.3f}", f"{accuracy(sfr.eval(), x_test, y_test):.3f}"])
        print(rows[-1], flush=True)
        if on_row is not None:
            done = len(rows) == len(seeds)
            note = "" if done else f"\n\n(Seeds {', '.join(str(r[0]) for r in rows)} of {seeds} done when written.)"
            on_row(markdown_table(header, rows) + note)
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["float32", "sites"], choices=["float32", "sites"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--write-docs", action="store_true", help=f"write the tables into {DOC}")
    args = parser.parse_args()
    command = command_line()
    if "float32" in args.parts:
        table = float32_table()
        print(table)
        if args.write_docs:
            write_block(DOC, "guarantees-float32", table, command)
    if "sites" in args.parts:
        def write(table: str) -> None:
            write_block(DOC, "guarantees-iterated-sites", table, command)

        print(sites_table(args.seeds, write if args.write_docs else None))


if __name__ == "__main__":
    main()
