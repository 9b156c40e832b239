"""The GPU figures of the scale work (issue 11) in one short run: SFR's peak memory at MNIST scale and the NTK
Gram at C = 1 against the ``vmap(jacrev)`` recipe, on one device.

* **SFR** (``--part sfr``): classification, MLP 784-256-256-10, float32, ``--n`` random inputs (default 60,000),
  ``--m`` inducing inputs (default 2,048, ``K = M·C = 20,480``), ``prior_structure="layer"`` (G = 3). Three
  cases: independent outputs; joint C×C coupling with per-group statistics; joint coupling with
  ``statistics="combined"``. For each, the build (dual statistics, ``K_ZZ``) and then the predictive variances
  of 200 test points plus the sparse evidence are timed, and the peak memory of the two stages is read:
  ``torch.cuda.max_memory_allocated`` above the memory allocated before the case on a GPU, the growth of the
  resident set (sampled every millisecond) on the CPU. Joint cases are compared with the bound of
  docs/scaling.md, ``bytes × [S·(G·K)² + (G + 4)·K² + 3·2²⁴]`` (``G = 1`` with ``statistics="combined"``).
* **Gram** (``--part gram``): the NTK Gram of an MLP 8-50-50-1 (tanh) on ``--gram-n`` inputs (default 20,000),
  float32: ntkgp's ``NTKEngine.group_grams`` against the torch.func recipe (per-example Jacobians, one einsum
  per parameter), wall time and peak memory each, after a warm-up on 16 inputs; the two Grams are compared.

Random inputs: memory and time do not depend on the values. ``--small`` shrinks every size (a smoke test that
runs on the CPU in seconds; ``tests/test_gpu_scale.py`` runs it). Results are printed and, with ``--json PATH``,
written as one JSON object (rewritten after every case). ``scripts/gpu_checks.sh`` runs this with the CUDA tests on a GPU machine.

    python benchmarks/gpu_scale.py [--device cuda] [--part sfr gram] [--n 60000 --m 2048] [--gram-n 20000]
        [--json out.json] [--small]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, run as a script or by -m

from ntk_gram import PeakRSS, ntkgp_gram, recipe_gram  # noqa: E402
from sfr_memory import formula  # noqa: E402

from ntkgp.likelihoods import SoftmaxLikelihood  # noqa: E402
from ntkgp.models.sfr import SFR  # noqa: E402

C = 10
SFR_CASES = [("independent", "per_group"), ("joint", "per_group"), ("joint", "combined")]


class PeakMemory:
    """Peak memory growth (MiB) of a block on ``device``: CUDA's allocator statistics, or the resident set."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.rss = PeakRSS().__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.seconds = time.perf_counter() - self.start
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        else:
            self.seconds = time.perf_counter() - self.start
            self.rss.__exit__(*exc)
            self.mib = self.rss.mib


def sfr_case(coupling: str, statistics: str, n: int, m: int, device: torch.device) -> dict:
    """One SFR case: build, then predictive variances and evidence; times and peak memory of both stages."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, C))
    net = net.to(device).eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 784, generator=g).to(device), torch.randint(0, C, (n,), generator=g).to(device)
    x_test = torch.randn(200, 784, generator=g).to(device)
    likelihood = SoftmaxLikelihood(C).to(device)
    options = dict(prior_structure="layer", output_coupling=coupling)
    if coupling == "joint":
        options["statistics"] = statistics
    warm = SFR(net, x[:40], y[:40], likelihood, num_inducing=4, **options)
    with torch.no_grad():
        warm(x_test[:5]).variance
    del warm
    gc.collect()
    with PeakMemory(device) as build:
        sfr = SFR(net, x, y, likelihood, num_inducing=m, **options)
    with PeakMemory(device) as solve, torch.no_grad():
        variance = sfr(x_test).variance
        evidence = sfr.log_marginal_likelihood()
    k = m * C
    bound = formula(torch.float32, sfr.engine.num_groups, k, combined=statistics == "combined") if coupling == "joint" else None
    out = {"coupling": coupling, "statistics": statistics if coupling == "joint" else None, "n": n, "m": m, "k": k,
           "groups": sfr.engine.num_groups, "build_s": build.seconds, "build_mib": build.mib,
           "solve_s": solve.seconds, "solve_mib": solve.mib, "peak_mib": max(build.mib, solve.mib),
           "formula_mib": bound, "evidence": float(evidence), "variance_sum": float(variance.sum()),
           "finite": bool(torch.isfinite(variance).all() and torch.isfinite(evidence))}
    del sfr, variance, evidence
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def gram_case(n: int, device: torch.device) -> dict:
    """ntkgp's C = 1 Gram against the recipe: wall time and peak memory of each, and their largest difference."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 1)).to(device)
    x = torch.randn(n, 8).to(device)
    results, grams = {}, {}
    for name, fn in (("recipe", recipe_gram), ("ntkgp", ntkgp_gram)):
        fn(net, x[:16])  # warm-up
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with PeakMemory(device) as mem:
            grams[name] = fn(net, x)
        results[name] = {"s": mem.seconds, "mib": mem.mib}
    difference = ((grams["ntkgp"] - grams["recipe"]).abs().max() / grams["recipe"].abs().max()).item()
    return {"n": n, **{f"{k}_{q}": v[q] for k, v in results.items() for q in v},
            "time_ratio": results["ntkgp"]["s"] / results["recipe"]["s"], "max_rel_difference": difference}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--part", nargs="+", choices=["sfr", "gram"], default=["sfr", "gram"])
    parser.add_argument("--n", type=int, default=60_000, help="SFR training points")
    parser.add_argument("--m", type=int, default=2048, help="SFR inducing points")
    parser.add_argument("--gram-n", type=int, default=20_000, help="inputs of the C = 1 Gram")
    parser.add_argument("--small", action="store_true", help="tiny sizes: a smoke test (seconds on a CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = parser.parse_args()
    if args.small:
        args.n, args.m, args.gram_n = 400, 16, 300
    for name in ("n", "m", "gram_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is available")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {os.cpu_count()} cores"
    report = {"device": str(device), "machine": machine, "torch": torch.__version__, "sfr": [], "gram": None}
    print(f"{machine}, torch {torch.__version__}", flush=True)

    def save() -> None:  # after every case: a run stopped by its time limit keeps what it measured
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1))

    if "sfr" in args.part:
        for coupling, statistics in SFR_CASES:
            r = sfr_case(coupling, statistics, args.n, args.m, device)
            report["sfr"].append(r)
            save()
            bound = "" if r["formula_mib"] is None else f" (formula {r['formula_mib']:.0f} MiB)"
            print(f"SFR {coupling:<11} {str(r['statistics']):<9} N={r['n']} M={r['m']}: build {r['build_s']:.1f} s "
                  f"{r['build_mib']:.0f} MiB, predict+evidence {r['solve_s']:.1f} s {r['solve_mib']:.0f} MiB, "
                  f"peak {r['peak_mib']:.0f} MiB{bound}", flush=True)
    if "gram" in args.part:
        r = report["gram"] = gram_case(args.gram_n, device)
        print(f"Gram C=1 N={r['n']}: ntkgp {r['ntkgp_s']:.2f} s {r['ntkgp_mib']:.0f} MiB, recipe {r['recipe_s']:.2f} s "
              f"{r['recipe_mib']:.0f} MiB, time ratio {r['time_ratio']:.2f}, max rel. difference "
              f"{r['max_rel_difference']:.1e}", flush=True)
    save()
    if args.json is not None:
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
