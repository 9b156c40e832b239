"""Where the low-rank route of the several-δ weight-space evidence (ntkgp/laplace/ggn/low_rank_groups.py)
becomes cheaper than the Cholesky route (exact_log_det.scaled_log_det), and what its decomposition costs.

For P columns, one group of P_b = f·P columns and the other k = P − P_b split into three groups, a random positive
semi-definite D (the Gram of 2P rows): the CPU time of one evaluation with its gradient in (w, δ) on either route, the
route's one-off decomposition (GroupSchur), and whether ``low_rank_cheaper`` takes the route.

    python benchmarks/low_rank_crossover.py [--sizes 600,1200,2400] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from ntkgp.laplace.ggn.exact_log_det import scaled_log_det
from ntkgp.laplace.ggn.low_rank_groups import GroupSchur, low_rank_cheaper


def cpu(fn, repeats: int = 3) -> float:
    fn()
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="600,1200,2400")
    parser.add_argument("--fractions", default="0.3,0.4,0.5,0.6,0.7,0.8,0.9")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for p in (int(v) for v in args.sizes.split(",")):
        rows = torch.randn(2 * p, p, dtype=torch.float64, generator=torch.Generator().manual_seed(p))
        component = rows.T @ rows
        for fraction in (float(v) for v in args.fractions.split(",")):
            large = int(fraction * p)
            rest = p - large
            sizes = torch.tensor([large, rest // 3, rest // 3, rest - 2 * (rest // 3)])
            groups = torch.repeat_interleave(torch.arange(4), sizes)
            weight = torch.tensor([0.7], dtype=torch.float64, requires_grad=True)
            delta = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64, requires_grad=True)
            start = time.process_time()
            schur = GroupSchur(component, groups, sizes)
            decompose = time.process_time() - start

            def low_rank():
                torch.autograd.grad(schur.log_det_ratio(weight, delta), [weight, delta])

            def cholesky():
                torch.autograd.grad(scaled_log_det(weight, delta[groups].rsqrt(), component[None]), [weight, delta])

            a, b = cpu(low_rank), cpu(cholesky)
            print(f"P = {p}, P_b/P = {fraction:.2f}: low-rank {a * 1e3:.3g} ms, Cholesky {b * 1e3:.3g} ms "
                  f"(ratio {a / b:.2g}), decomposition {decompose * 1e3:.3g} ms, "
                  f"low_rank_cheaper {low_rank_cheaper(sizes)}", flush=True)


if __name__ == "__main__":
    main()
