"""Data parallelism: SFR's build and the KFAC curvature pass with 1 and 2 processes, side by side.

Each run starts ``W`` processes (``torch.multiprocessing``, ``spawn``) that join a process group (``gloo`` on
CPUs; ``--backend nccl`` puts rank ``r`` on GPU ``r``), hold a contiguous shard of the same synthetic data
set (``ntkgp.distributed.shard``) and make the same calls with ``distributed=True`` (``W = 1``: one process
on all the data, the reference). Timed on every rank between barriers, best of ``--repeats``, after a
warm-up on a small problem (lazy imports, allocator):

* **SFR build**: ``SFR(net, x_shard, y_shard, SoftmaxLikelihood(C), inducing_points=Z, distributed=True)``,
  per-layer δ, joint C×C coupling (the dual statistics, all-reduced, and nothing else);
* **KFAC**: ``compute_curvature(net, x_shard, y_shard, likelihood, "kfac", distributed=True)`` and one
  evaluation of its log marginal likelihood.

Correctness: the largest difference from the one-process results over every rank, relative to the
magnitude (``max|a - b| / max(1, max|a|)``), of the SFR statistics (all :math:`A_{gh}` blocks and
:math:`b_g`), of SFR's predictive mean and variance at 200 test points and sparse evidence, and of the KFAC
factors and evidence.

    python benchmarks/distributed.py [--n 6000 --m 64 --c 10 --width 64 --threads 1 --repeats 2] [--write-docs]

``--write-docs`` writes the table into docs/scaling.md (region ``distributed-benchmark``).

The machine's cores are shared by the ranks (``--threads`` each): on a 2-core machine 2 ranks of 1 thread
can at best halve the time of 1 rank of 1 thread.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def network(d: int, width: int, c: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, c)).double().eval()


def dataset(net: nn.Module, n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, dtype=torch.float64, generator=g)
    with torch.no_grad():
        logits = net(x)
    return x, torch.distributions.Categorical(logits=logits).sample()


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """This rank's timings and results (tensors on the CPU)."""
    from ntkgp.laplace.weight_space import compute_curvature
    from ntkgp.distributed import shard
    from ntkgp.likelihoods import SoftmaxLikelihood
    from ntkgp.models.sfr import SFR

    net = network(args.d, args.width, args.c).to(device)
    x, y = dataset(net.cpu(), args.n, args.d, seed=1)
    net = net.to(device)
    z = x[torch.randperm(args.n, generator=torch.Generator().manual_seed(2))[: args.m]].to(device)
    x_test = dataset(net.cpu(), 200, args.d, seed=3)[0].to(device)
    net = net.to(device)
    xs, ys = (t.to(device) for t in shard(x, y))
    lik = SoftmaxLikelihood(args.c).to(device=device, dtype=torch.float64)
    delta = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64, device=device)

    def build(xb, yb):
        return SFR(net, xb, yb, lik, inducing_points=z, prior_precision=delta, output_coupling="joint",
                   distributed=True)

    def kfac(xb, yb):
        curvature = compute_curvature(net, xb, yb, lik, "kfac", batch_size=256, distributed=True)
        return curvature, curvature.log_marginal_likelihood(delta, lik).detach()

    build(xs[:50], ys[:50])  # warm-up
    kfac(xs[:50], ys[:50])
    best = {"sfr": float("inf"), "kfac": float("inf")}
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        sfr = build(xs, ys)
        dist.barrier()
        middle = time.perf_counter()
        curvature, evidence = kfac(xs, ys)
        dist.barrier()
        end = time.perf_counter()
        best["sfr"] = min(best["sfr"], middle - start)
        best["kfac"] = min(best["kfac"], end - middle)
    with torch.no_grad():
        post = sfr(x_test)
        sfr_evidence = sfr.log_marginal_likelihood()
    stats = sfr.dual_statistics
    return {
        "times": best,
        "rows": xs.shape[0],
        "sfr": {"precision": stats.precision.cpu(), "residual": stats.residual.cpu(), "mean": post.mean.cpu(),
                "variance": post.variance.cpu(), "evidence": sfr_evidence.cpu()},
        "kfac": {**{f"A{i}": b.input_factor.cpu() for i, b in enumerate(curvature.blocks)},
                 **{f"G{i}": b.output_factors.cpu() for i, b in enumerate(curvature.blocks)},
                 "evidence": evidence.cpu()},
    }


def worker(rank: int, world: int, store: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    try:
        device = torch.device("cpu")
        if args.backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        dist.init_process_group(args.backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        torch.save(measure(args, device), Path(out) / f"rank{rank}.pt")
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(world: int, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, os.path.join(tmp, "store"), tmp, args), nprocs=world,
                           start_method="spawn")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def difference(reference: dict, other: dict) -> float:
    """Largest ``max|a - b| / max(1, max|a|)`` over the tensors of two result dicts."""
    worst = 0.0
    for key, a in reference.items():
        scale = max(1.0, a.abs().max().item())
        worst = max(worst, (other[key] - a).abs().max().item() / scale)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=6000, help="training points, all ranks (default: 6000)")
    parser.add_argument("--m", type=int, default=64, help="inducing points (default: 64)")
    parser.add_argument("--c", type=int, default=10, help="classes (default: 10)")
    parser.add_argument("--d", type=int, default=20, help="inputs (default: 20)")
    parser.add_argument("--width", type=int, default=64, help="hidden units per layer (default: 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: 1)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="process counts (default: 1 2)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/scaling.md")
    args = parser.parse_args()
    print(f"N = {args.n}, M = {args.m}, C = {args.c}, MLP {args.d}-{args.width}-{args.width}-{args.c}, per-layer δ, "
          f"joint coupling, float64, {args.backend}, {args.threads} thread(s) per rank, best of {args.repeats}")
    results = {world: launch(world, args) for world in args.worlds}
    reference = results[args.worlds[0]][0]
    header = (f"{'ranks':>5}  {'rows/rank':>9}  {'SFR build s':>11}  {'KFAC s':>7}  {'diff SFR stats':>14}  "
              f"{'diff SFR predictive':>19}  {'diff KFAC':>9}")
    print(header)
    print("-" * len(header))
    table = []
    for world, ranks in results.items():
        sfr_time = max(r["times"]["sfr"] for r in ranks)
        kfac_time = max(r["times"]["kfac"] for r in ranks)
        stats = max(difference({k: reference["sfr"][k] for k in ("precision", "residual")}, r["sfr"]) for r in ranks)
        predictive = max(difference({k: reference["sfr"][k] for k in ("mean", "variance", "evidence")}, r["sfr"])
                         for r in ranks)
        kfac_diff = max(difference(reference["kfac"], r["kfac"]) for r in ranks)
        rows = "/".join(str(r["rows"]) for r in ranks)
        print(f"{world:>5}  {rows:>9}  {sfr_time:>11.2f}  {kfac_time:>7.2f}  {stats:>14.2e}  {predictive:>19.2e}  "
              f"{kfac_diff:>9.2e}")
        table.append([world, rows.replace("/", " / "), f"{sfr_time:.2f}", f"{kfac_time:.2f}", f"{stats:.1e}",
                      f"{predictive:.1e}", f"{kfac_diff:.1e}"])
    if args.write_docs:
        from ntkgp._doctable import command_line, markdown_table, write_block

        content = markdown_table(["ranks", "rows per rank", "SFR build, s", "KFAC, s", "statistics",
                                  "predictive and evidence", "KFAC factors and evidence"], table)
        content += (f"\n\n`N = {args.n}`, `M = {args.m}`, MLP {args.d}-{args.width}-{args.width}-{args.c}, "
                    f"float64, `{args.backend}`, {args.threads} thread(s) per rank, best of {args.repeats}; the last "
                    "three columns are the largest difference from one process relative to the magnitude.")
        write_block("docs/scaling.md", "distributed-benchmark", content, command_line())


if __name__ == "__main__":
    main()
