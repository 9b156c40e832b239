"""Peak memory of SFR with joint C×C output coupling against the formula of docs/scaling.md ("Memory of SFR").

Classification, MLP 784-64-64-10, N = 6000 random inputs, M = 256 inducing inputs (K = M·C = 2560), one
process on the CPU, one thread. Each case runs in a fresh interpreter; its peak resident memory
(``ru_maxrss``) above the resident memory before the model is built (network, data and a small warm-up model
already there) is compared with the formula

    bytes × [S·(G·K)² + (G + 8)·K² + 3·2²⁴]

(``S`` = 1 slot for classification, ``G`` prior groups, the last term the streaming buffers). Stages: the
build (dual statistics), then the first prediction of 500 test points and the sparse evidence (the
factorization).

    python benchmarks/sfr_memory.py [--n 6000 --m 256] [--cases float32:network float32:layer ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def formula(dtype: torch.dtype, groups: int, k: int, slots: int = 1) -> float:
    """The bound of docs/scaling.md in MiB."""
    numbers = slots * (groups * k) ** 2 + (groups + 8) * k**2 + 3 * 2**24
    return numbers * torch.finfo(dtype).bits / 8 / 2**20


def case(dtype_name: str, structure: str, n: int, m: int) -> dict:
    import psutil
    from torch import nn

    from ntkgp.likelihoods import SoftmaxLikelihood
    from ntkgp.models.sfr import SFR

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    c = 10
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, c))
    net = net.to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 784, dtype=dtype, generator=g), torch.randint(0, c, (n,), generator=g)
    x_test = torch.randn(500, 784, dtype=dtype, generator=g)
    likelihood = SoftmaxLikelihood(c).to(dtype)
    SFR(net, x[:40], y[:40], likelihood, num_inducing=4, prior_structure=structure)(x_test[:5]).variance  # warm-up

    def peak() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    base = psutil.Process().memory_info().rss / 2**20
    start = time.perf_counter()
    sfr = SFR(net, x, y, likelihood, num_inducing=m, prior_structure=structure, output_coupling="joint")
    built, build_peak = time.perf_counter() - start, peak() - base
    with torch.no_grad():
        sfr(x_test).variance
        sfr.log_marginal_likelihood()
    return {"dtype": dtype_name, "structure": structure, "groups": sfr.engine.num_groups, "k": m * c,
            "build_s": built, "build_peak": build_peak, "peak": peak() - base,
            "formula": formula(dtype, sfr.engine.num_groups, m * c)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=6000)
    parser.add_argument("--m", type=int, default=256)
    parser.add_argument("--cases", nargs="+",
                        default=["float32:network", "float64:network", "float32:layer", "float64:layer"],
                        help="dtype:prior_structure pairs")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(case(*args.case.split(":"), args.n, args.m)))
        return
    print(f"SFR, softmax C = 10, joint coupling, MLP 784-64-64-10, N = {args.n}, M = {args.m}, one thread; MiB")
    header = (f"{'dtype':>8} {'G':>2} {'K=MC':>5} {'unit K²':>8} {'build s':>8} {'build peak':>10} {'peak':>7} "
              f"{'formula':>8} {'peak/formula':>12}")
    print(header)
    print("-" * len(header))
    for spec in args.cases:
        done = subprocess.run([sys.executable, __file__, "--case", spec, "--n", str(args.n), "--m", str(args.m)],
                              capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        unit = r["k"] ** 2 * torch.finfo(getattr(torch, r["dtype"])).bits / 8 / 2**20
        print(f"{r['dtype']:>8} {r['groups']:>2} {r['k']:>5} {unit:>8.1f} {r['build_s']:>8.1f} "
              f"{r['build_peak']:>10.0f} {r['peak']:>7.0f} {r['formula']:>8.0f} {r['peak'] / r['formula']:>12.2f}")


if __name__ == "__main__":
    main()
