"""SFR's choice of δ by the evidence: the bound along δ from one eigendecomposition (``evidence_scale``) against the
direct route (``K_ZZ`` and ``I + A`` refactorized at each value), side by side in one run on one model.

The model: an MLP (``--d`` inputs, one tanh layer of ``--width``, 10 outputs, float64) on ``--n`` random inputs with
random labels, SFR with ``--m`` inducing inputs, one δ, independent outputs (the SFR paper's configuration). The
search is ``sfr_images.py``'s: the best of 13 values δ₀ · 10^{-3, -2.5, …, 3}, then ``--steps`` Adam steps
(``optimize_prior_precision(method="evidence")``). Each side runs alone, first the direct route (``ScaledEvidence.at``
replaced by ``None``) then the default; the δ found by each is printed beside its time.

    python benchmarks/sfr_evidence_search.py [--m 1024] [--n 3000] [--steps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch
from torch import nn

import ntkgp
from ntkgp.models.sfr.evidence_scale import ScaledEvidence


def search(sfr, delta0: float, steps: int) -> tuple[float, float]:
    """``(δ, seconds)`` of the grid and the Adam steps, from ``delta0``."""
    sfr.covar_module.prior_precision = delta0
    grid = torch.tensor([delta0 * 10 ** (e / 2) for e in range(-6, 7)], dtype=torch.float64)
    start = time.perf_counter()
    sfr.optimize_prior_precision("evidence", optimizer="grid", grid=grid)
    delta = sfr.optimize_prior_precision("evidence", optimizer="adam", steps=steps, lr=0.05)
    return float(delta.reshape(-1)[0]), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=1024)
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--d", type=int, default=32)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(args.d, args.width), nn.Tanh(), nn.Linear(args.width, 10)).double().eval()
    x, y = torch.randn(args.n, args.d, dtype=torch.float64), torch.randint(0, 10, (args.n,))
    sfr = ntkgp.SFR(net, x, y, ntkgp.likelihoods.SoftmaxLikelihood(num_classes=10), inducing_points=x[: args.m],
                    prior_precision=1.0, prior_structure="network", prior_mean="zero",
                    output_coupling="independent", progress=False)
    with mock.patch.object(ScaledEvidence, "at", classmethod(lambda cls, model: None)):
        direct_delta, direct_s = search(sfr, 1.0, args.steps)
    scaled = ScaledEvidence.at(sfr)
    covered = scaled is not None and scaled.covers(torch.tensor(1.0))
    scaled_delta, scaled_s = search(sfr, 1.0, args.steps)
    print(f"M = {args.m}, C = 10 independent, P = {sum(q.numel() for q in net.parameters()):,}, "
          f"{args.threads} thread(s); every inducing direction kept at δ₀: {covered}")
    print(f"direct route: δ = {direct_delta:.10g} in {direct_s:.2f} s")
    print(f"scaled route: δ = {scaled_delta:.10g} in {scaled_s:.2f} s  ({direct_s / scaled_s:.1f}x faster)")


if __name__ == "__main__":
    main()
