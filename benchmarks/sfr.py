"""SFR: build, predict and update times, and the public SFR code's (aidanscannell/sfr) measured in the same run.

MLP 8-50-50-C (tanh), float64, random inputs; C = 1 regression (N = 10,000, M = 512) and C = 10
classification (N = 5,000, M = 256). Timed: build (streaming the dual statistics and factorizing, as the
public ``set_data``), predict 2,000 points (mean and marginal variances, factorizations cached), update with
1,000 points (new statistics and refactorization; one step, ``iterate=False``, in the rows comparable to the
public code, whose update is one step; the default iterated sites elsewhere). Each setting is warmed up on a small problem first; the
best of ``--repeats`` runs is reported (the machine has 2 cores; other load inflates the figures, for both sides
alike). The setting comparable to the public code is zero prior mean, independent outputs and one prior precision
(``prior_structure="network"``); the other rows show per-layer prior precisions (statistics kept per group pair, so
δ stays learnable) and joint C×C coupling (``output_coupling="joint"``), which the public code does not offer.

``--sfr-public DIR`` names a folder holding the public code's modules (``sfr.py``, ``likelihoods.py``,
``priors.py``, ...; it needs ``jaxtyping`` importable): its ``SFR`` is then timed on the same data, network and sizes
(float64, dual batch 1000, its own random ``Z``), in this run, for the comparable rows. Without it that side is
skipped.

    python benchmarks/sfr.py [--repeats 2] [--settings comparable] [--sfr-public DIR] [--write-docs]

``--write-docs`` writes the table into docs/sfr.md (region ``sfr-times``).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import re
import sys
import time
from pathlib import Path

import torch
from gpytorch.likelihoods import GaussianLikelihood
from torch import nn

from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR
from ntkgp.models import SFRInducingOptions

SIZES = {1: (10_000, 512), 10: (5_000, 256)}
SETTINGS = [
    (1, "network", "independent", "comparable (1 δ)"),
    (1, "layer", "independent", "δ per layer"),
    (10, "network", "independent", "comparable (1 δ)"),
    (10, "layer", "independent", "δ per layer"),
    (10, "network", "joint", "joint C×C, 1 δ"),
]


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


def problem(c: int):
    n, m = SIZES[c]
    net = network(c)
    return net, data(net, n, c, 1), data(net, 1000, c, 2), data(net, 2000, c, 3)[0], m


def run_ntkgp(
    c: int, prior_structure: str, coupling: str, repeats: int, iterate: bool | None = None
) -> tuple[float, float, float]:
    net, (x, y), (x_new, y_new), x_test, m = problem(c)

    def likelihood():
        return GaussianLikelihood().double() if c == 1 else SoftmaxLikelihood(c).double()

    kw = {"num_inducing": m, "prior_mean": "zero", "output_coupling": coupling, "prior_structure": prior_structure}
    warm = SFR(net, x[: 2 * m], y[: 2 * m], likelihood(), **kw)
    _ = warm(x_test[:100]).variance
    warm.update(x_new[:100], y_new[:100], iterate=iterate)
    best = [float("inf")] * 3
    for _ in range(repeats):
        t0 = time.perf_counter()
        sfr = SFR(net, x, y, likelihood(), inducing=SFRInducingOptions(seed=0), **kw)
        sfr._factors()
        t1 = time.perf_counter()
        dist = sfr(x_test)
        _ = (dist.mean, dist.variance)
        t2 = time.perf_counter()
        sfr.update(x_new, y_new, iterate=iterate)
        sfr._factors()
        t3 = time.perf_counter()
        best = [min(b, t) for b, t in zip(best, (t1 - t0, t2 - t1, t3 - t2))]
    return tuple(best)


def load_public(folder: Path):
    """The public code's modules ``sfr``, ``likelihoods``, ``priors`` from ``folder`` (imported flat, as it expects)."""
    if not (folder / "sfr.py").exists():
        raise SystemExit(f"--sfr-public {folder}: no sfr.py there (the folder of the public SFR code's modules)")
    logging.getLogger("sfr").setLevel(logging.WARNING)  # its progress messages
    sys.path.insert(0, str(folder))
    try:
        return tuple(importlib.import_module(name) for name in ("sfr", "likelihoods", "priors"))
    except ImportError as error:
        raise SystemExit(f"the public SFR code in {folder} does not import ({error}); it needs jaxtyping") from error
    finally:
        sys.path.remove(str(folder))


def run_public(modules, c: int, repeats: int) -> tuple[float, float, float]:
    """The public ``SFR`` at the same sizes: ``set_data`` (build), ``predict_f`` (2,000 points), ``update`` (1,000)."""
    public_sfr, public_likelihoods, public_priors = modules
    net, (x, y), (x_new, y_new), x_test, m = problem(c)
    if c == 1:  # its regression targets are (N, 1)
        y, y_new = y[:, None], y_new[:, None]

    def build(x, y, m):
        model = copy.deepcopy(net)  # set_data casts the network to float64 in place: never the shared one
        lik = public_likelihoods.Gaussian(log_sigma_noise=0.0) if c == 1 else public_likelihoods.CategoricalLh()
        prior = public_priors.Gaussian(params=model.parameters, prior_precision=1.0)
        sfr = public_sfr.SFR(model, prior=prior, likelihood=lik, output_dim=c, num_inducing=m, dual_batch_size=1000)
        sfr.set_data((x, y))
        return sfr

    warm = build(x[: 2 * m], y[: 2 * m], m)
    warm.predict_f(x_test[:100])
    warm.update(x=x_new[:100], y=y_new[:100])
    best = [float("inf")] * 3
    for _ in range(repeats):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        sfr = build(x, y, m)
        t1 = time.perf_counter()
        sfr.predict_f(x_test)
        t2 = time.perf_counter()
        sfr.update(x=x_new, y=y_new)
        t3 = time.perf_counter()
        best = [min(b, t) for b, t in zip(best, (t1 - t0, t2 - t1, t3 - t2))]
    return tuple(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", choices=["all", "comparable"], default="all")
    parser.add_argument("--sfr-public", type=Path, default=None, help="folder of the public SFR code's modules")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/sfr.md")
    args = parser.parse_args()
    public = None if args.sfr_public is None else load_public(args.sfr_public)
    settings = [s for s in SETTINGS if args.settings == "all" or s[3].startswith("comparable")]
    header = f"{'N, M, C':<16}{'setting':<20}{'build s':<22}{'predict s':<22}{'update s':<22}"
    print(header + ("  (public code, ratio)" if public else ""))
    print("-" * len(header))
    table, public_times = [], {}
    for c, prior_structure, coupling, label in settings:
        comparable = label.startswith("comparable")
        times = run_ntkgp(c, prior_structure, coupling, args.repeats, iterate=False if comparable else None)
        reference = None
        if public is not None and comparable:
            reference = public_times.setdefault(c, run_public(public, c, args.repeats))
        n, m = SIZES[c]
        if reference is None:
            cells = [f"{t:.2f}" for t in times]
        else:
            cells = [f"{t:.2f} ({r:.2f}, {t / r:.2f}×)" for t, r in zip(times, reference)]
        print(f"{f'{n}, {m}, {c}':<16}{label:<20}" + "".join(f"{cell:<22}" for cell in cells), flush=True)
        table.append([f"{n}, {m}, {c}", label, *cells])
    if args.write_docs:
        from ntkgp._doctable import command_line, markdown_table, write_block

        suffix = " (public code, ratio)" if public else ""
        headers = ["N, M, C", "setting", f"build s{suffix}", f"predict 2000 s{suffix}", f"update 1000 s{suffix}"]
        content = markdown_table(headers, table)
        content += (f"\n\nBest of {args.repeats}, float64, MLP 8-50-50-C, `torch.get_num_threads() = "
                    f"{torch.get_num_threads()}`.")
        if public:
            content += (" The public code was timed in the same run, on the same data and network, for the rows "
                        "comparable to it (one δ, zero prior mean, independent outputs, a one-step update); the ratio "
                        "is ntkgp's time over its time. The other rows update with the default iterated sites.")
        command = re.sub(r"--sfr-public(=| )\S+", r"--sfr-public\1SFR_PUBLIC", command_line())
        write_block("docs/sfr.md", "sfr-times", content, command)


if __name__ == "__main__":
    main()
