"""Laplace-GGN evidence, 100 hyperparameter steps and the GLM predictive: ntkgp vs laplace-torch FullLaplace.

The Snelson case: N = 200, 1-50-50-50-1 tanh MLP (P = 5251), float64, one prior
precision per parameter tensor (laplace-torch's layer-wise prior) and the noise σ, optimised with Adam on
the negative evidence; the GLM predictive on 50 points. laplace-torch is used when it is importable
(it is kept out of ntkgp's dependencies); its hyperparameter loop can be shortened with
``--laplace-steps`` (the time per step is reported and extrapolated to 100, clearly labelled).

    python benchmarks/evidence.py [--data-dir DATA] [--laplace-steps 100] [--write-docs]

DATA is the benchmark data folder (its ``toy/`` holds the Snelson files; default: ``$NTKGP_DATA_DIR``);
without it a synthetic set of the same size is used. ``--write-docs`` writes the results into README.md
(generated region ``readme-evidence``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import gpytorch
import torch
from torch import nn

import ntkgp
from ntkgp._doctable import command_line, markdown_table, write_block
from ntkgp.datasets import load_snelson


def make_data(data_dir: str | None):
    if data_dir and (Path(data_dir) / "toy").is_dir():
        x, y, _ = load_snelson(data_dir)
        source = "Snelson"
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.rand(200, 1, generator=g, dtype=torch.float64) * 6
        y = torch.sin(x) + 0.3 * torch.randn(200, 1, generator=g, dtype=torch.float64)
        source = "synthetic (no --data-dir)"
    return x, y.reshape(-1, 1), source


def train(net, x, y, steps=2000):
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean() + 1e-4 * sum((p**2).sum() for p in net.parameters())
        loss.backward()
        opt.step()
    for p in net.parameters():
        p.grad = None
    return net.eval()


def run_ntkgp(net, x, y, x_test, delta0, sigma0, steps):
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = sigma0**2
    t = time.perf_counter()
    model = ntkgp.NTKGP(net, x, y.squeeze(-1), lik, prior_precision=delta0, prior_structure="parameter")
    evidence0 = model.log_marginal_likelihood()
    t_first = time.perf_counter() - t
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    opt = torch.optim.Adam(model.hyperparameters(), lr=0.1)
    model.train()
    t = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss = -mll(model(x), y.squeeze(-1))
        loss.backward()
        opt.step()
    t_steps = time.perf_counter() - t
    model.eval()
    t = time.perf_counter()
    with torch.no_grad():
        pred = model(x_test)
        mean, var = pred.mean, pred.variance
    t_pred = time.perf_counter() - t
    return {"first": t_first, "steps": t_steps, "pred": t_pred, "evidence0": evidence0.item(),
            "evidence": model.log_marginal_likelihood().item(), "mean": mean, "var": var}


def run_laplace(net, x, y, x_test, delta0, sigma0, steps):
    from laplace import FullLaplace

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    n_params = len(list(net.parameters()))
    t = time.perf_counter()
    la = FullLaplace(net, "regression", sigma_noise=sigma0, prior_precision=torch.full((n_params,), delta0, dtype=torch.float64))
    la.fit(loader)
    evidence0 = la.log_marginal_likelihood()
    t_first = time.perf_counter() - t
    log_prior = torch.full((n_params,), float(torch.log(torch.tensor(delta0))), dtype=torch.float64, requires_grad=True)
    log_sigma = torch.tensor(float(torch.log(torch.tensor(sigma0))), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([log_prior, log_sigma], lr=0.1)
    t = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        (-la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())).backward()
        opt.step()
    t_steps = time.perf_counter() - t
    t = time.perf_counter()
    f_mu, f_var = la(x_test, pred_type="glm")
    t_pred = time.perf_counter() - t
    return {"first": t_first, "steps": t_steps, "pred": t_pred, "evidence0": evidence0.item(),
            "mean": f_mu.squeeze(-1).detach(), "var": f_var.reshape(-1).detach()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("NTKGP_DATA_DIR"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--laplace-steps", type=int, default=100)
    parser.add_argument("--write-docs", action="store_true", help="write the results into README.md (readme-evidence)")
    args = parser.parse_args()
    torch.manual_seed(0)
    x, y, source = make_data(args.data_dir)
    net = train(nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 1)).double(), x, y)
    x_test = torch.linspace(x.min().item() - 1, x.max().item() + 1, 50, dtype=torch.float64).unsqueeze(-1)
    delta0, sigma0 = 1.0, 0.3
    num_params = sum(p.numel() for p in net.parameters())
    print(f"data: {source}, N = {len(x)}, P = {num_params}, float64, torch {torch.__version__}")
    ours = run_ntkgp(net, x, y, x_test, delta0, sigma0, args.steps)
    rows = [("ntkgp", ours, args.steps)]
    try:
        import laplace  # noqa: F401
    except ImportError:
        print("laplace-torch is not installed: its side is skipped")
        theirs = None
    else:
        theirs = run_laplace(net, x, y, x_test, delta0, sigma0, args.laplace_steps)
        rows.append(("laplace-torch FullLaplace", theirs, args.laplace_steps))
    print(f"{'':28} {'first evidence s':>16} {'100 steps s':>12} {'predict 50 s':>12} {'evidence':>11}")
    for name, r, steps in rows:
        per100 = r["steps"] / max(steps, 1) * 100
        label = f"{per100:.3f}" + ("" if steps == 100 else f" (from {steps})")
        print(f"{name:28} {r['first']:>16.3f} {label:>12} {r['pred']:>12.4f} {r['evidence0']:>11.4f}")
    if theirs is not None:
        print(f"evidence agreement at the initial hyperparameters: |Δ| = {abs(ours['evidence0'] - theirs['evidence0']):.2e}")
        s100 = theirs["steps"] / max(args.laplace_steps, 1) * 100
        print(f"speed-up: 100 steps {s100 / ours['steps']:.0f}x, predictive {theirs['pred'] / ours['pred']:.0f}x, "
              f"first evidence {theirs['first'] / ours['first']:.0f}x")
    print(f"ntkgp evidence after {args.steps} steps: {ours['evidence']:.4f}")
    if args.write_docs:
        write_docs(args, source, len(x), num_params, ours, theirs)


def write_docs(args, source, n, num_params, ours, theirs) -> None:
    steps = f"{args.steps} evidence steps (Adam on δ per parameter tensor and σ)"
    header = ["Snelson-size regression, float64", "ntkgp `NTKGP`"]
    ours_cells = [f"{ours['first']:.3g} s", f"{ours['steps']:.3g} s", f"{ours['pred']:.3g} s"]
    if theirs is None:
        rows = [[what, cell] for what, cell in zip(["build + first evidence", steps, "GLM predictive, 50 points"],
                                                   ours_cells)]
        agreement = "laplace-torch was not importable in this run: its side is absent."
    else:
        header += ["laplace-torch `FullLaplace`", "ntkgp faster by"]
        measured = args.laplace_steps
        per = theirs["steps"] / max(measured, 1) * args.steps
        label = f"{per:.3g} s" + ("" if measured == args.steps else f" ({measured} steps measured, × {args.steps / measured:g})")
        theirs_cells = [f"{theirs['first']:.3g} s", label, f"{theirs['pred']:.3g} s"]
        ratios = [theirs["first"] / ours["first"], per / ours["steps"], theirs["pred"] / ours["pred"]]
        rows = [[what, a, b, f"{r:.0f}×"] for what, a, b, r in zip(
            ["build + first evidence", steps, "GLM predictive, 50 points"], ours_cells, theirs_cells, ratios)]
        diff = abs(ours["evidence0"] - theirs["evidence0"])
        agreement = (f"Both evidences at the initial hyperparameters: ntkgp {ours['evidence0']:.4f}, laplace-torch "
                     f"{theirs['evidence0']:.4f} (difference {diff:.1e}, {diff / abs(ours['evidence0']):.1e} relative).")
    note = f"Data: {source}, N = {n}, 1-50-50-50-1 tanh MLP (P = {num_params}); wall times of one run."
    write_block("README.md", "readme-evidence", note + "\n\n" + markdown_table(header, rows) + "\n\n" + agreement,
                command_line() + _with_laplace())


def _with_laplace() -> str:
    """A comment for the command line in the docs: the laplace-torch version the run imported, if any."""
    try:
        from importlib.metadata import version

        import laplace  # noqa: F401
    except ImportError:
        return ""
    return f"  # with laplace-torch {version('laplace-torch')} importable"


if __name__ == "__main__":
    main()
