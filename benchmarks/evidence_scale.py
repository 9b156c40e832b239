"""The Laplace-GGN evidence at scale: the new routes (one-δ eigen, matrix-free CG/SLQ) against the dense Cholesky route.

Part 1 (``--part vehicle``): 100 evidence steps (value + gradient + one Adam step on the prior precisions) on a
vehicle-sized classification problem (N = 600, C = 4, 2×50 tanh MLP, trained to its MAP first; UCI vehicle
when ``DATA/uci_classification/vehicle/{X,Y}.txt`` exist, else a synthetic 18-feature, 4-class mixture of
the same size), float64, with one prior precision (``prior_structure="network"``: Cholesky, eigen,
matrix-free) and per-layer precisions (``"layer"``: Cholesky, matrix-free), side by side. Reported: time of
the 100 steps, the prior precisions reached and the exact evidence there (by the Cholesky route).

Part 2 (``--part scale``): the largest N·C each route handles within ``--budget-seconds`` (default 600) and
``--memory-gib`` (default 16) for one evidence value and its gradient: MLP 784-128-128-10, C = 10, random
inputs and labels, float32, per-layer δ (eigen: one δ). Each size runs in a fresh process (time and peak
resident memory of that process); sizes whose dense memory formula (``ntkgp.laplace.function_space.routes.dense_memory_bytes``)
exceeds the limit are not started. The search starts at the largest size in ``--sizes`` that fits and halves
N after a failure.

Part 3 (``--part accuracy``): the matrix-free value and gradient with the part-2 settings against the Cholesky
route at N = ``--accuracy-n`` (default 1000; three seeds), and the spread between two seeds at the largest
size of ``--sizes``.

Part 0 (``--part formulas``): the memory formulas of the routes at three sizes of part 2 (computed, not
measured).

``--write-docs`` writes each part's table into docs/scaling.md (regions ``evidence-scale-steps``,
``evidence-scale-largest``, ``evidence-scale-accuracy``, ``evidence-memory-examples``), with the command.

    python benchmarks/evidence_scale.py [--part formulas|vehicle|scale|accuracy|all] [--data-dir DATA]
        [--steps 100] [--budget-seconds 600] [--memory-gib 16] [--sizes 20000 10000 5000 2000 1000 500]
        [--threads T] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import ntkgp
from ntkgp._doctable import command_line, markdown_table, write_block
from ntkgp.laplace import EvidenceOptions
from ntkgp.laplace.function_space.routes import dense_memory_bytes
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.options import WEIGHT_SPACE_FROM

DOC = "docs/scaling.md"
VEHICLE_FREE = {"num_probes": 10, "cg_tolerance": 0.01, "preconditioner_rank": 100, "max_cg_iterations": 200}
SCALE_FREE = {"num_probes": 10, "cg_tolerance": 0.01, "preconditioner_rank": 50, "max_cg_iterations": 100}


# ---------------------------------------------------------------------------------------------- part 1
def vehicle_data(data_dir: str | None):
    folder = Path(data_dir) / "uci_classification" / "vehicle" if data_dir else None
    if folder is not None and (folder / "X.txt").is_file() and (folder / "Y.txt").is_file():
        import numpy as np

        x = torch.as_tensor(np.loadtxt(folder / "X.txt"), dtype=torch.float64)
        labels = np.loadtxt(folder / "Y.txt")
        y = torch.as_tensor(np.unique(labels, return_inverse=True)[1], dtype=torch.long)
        x = (x - x.mean(0)) / x.std(0).clamp_min(1e-12)
        return x[:600], y[:600], "UCI vehicle"
    g = torch.Generator().manual_seed(0)
    centers = 1.5 * torch.randn(4, 18, generator=g, dtype=torch.float64)
    y = torch.arange(600) % 4
    x = centers[y] + torch.randn(600, 18, generator=g, dtype=torch.float64)
    return (x - x.mean(0)) / x.std(0), y, "synthetic (18 features, 4 classes; no vehicle files)"


def train_map(x, y, seed=0, steps=1000):
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(x.shape[1], 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 4)
    ).double()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y) + 1e-3 * sum(
            p.square().sum() for p in net.parameters()
        ) / len(x)
        loss.backward()
        opt.step()
    for p in net.parameters():
        p.grad = None
    return net.eval()


def evidence_steps(net, x, y, structure, method, steps, seed=0):
    torch.manual_seed(seed)
    model = ntkgp.NTKGP(
        net, x, y, SoftmaxLikelihood(4).double(), prior_precision=1.0, prior_structure=structure
    )
    options = EvidenceOptions(**VEHICLE_FREE) if method == "matrix_free" else None
    params = [model.covar_module.raw_prior_precision]
    opt = torch.optim.Adam(params, lr=0.1)
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss = -model.log_marginal_likelihood(method=method, options=options) / len(x)
        loss.backward()
        opt.step()
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        exact = model.log_marginal_likelihood(method="cholesky").item() / len(x)
    return elapsed, model.covar_module.prior_precision.detach().clone(), exact


def part_vehicle(args):
    x, y, source = vehicle_data(args.data_dir)
    net = train_map(x, y)
    p = sum(q.numel() for q in net.parameters())
    print(f"\n== Part 1: {args.steps} evidence steps, {source}: N = {len(x)}, C = 4, P = {p}, float64 ==")
    print(
        f"matrix-free settings: {VEHICLE_FREE}, Lanczos steps = gpytorch default (20), fresh probes every step"
    )
    rows = []
    for structure, methods in (
        ("network", ("cholesky", "eigen", "matrix_free")),
        ("layer", ("cholesky", "matrix_free")),
    ):
        reference = None
        for method in methods:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                elapsed, delta, exact = evidence_steps(net, x, y, structure, method, args.steps)
            if reference is None:
                reference = delta
            drift = float(((delta - reference).abs() / reference).max())
            rows.append((structure, method, elapsed, elapsed / args.steps, exact, drift, delta.tolist()))
            print(
                f"  δ per {structure:8s} {method:12s} {elapsed:8.1f} s  ({1e3 * elapsed / args.steps:7.1f} ms/step)  "
                f"exact log q/N at the end = {exact:.6f}  max |δ − δ_cholesky|/δ_cholesky = {drift:.1e}  "
                f"δ = {[round(d, 4) for d in delta.tolist()]}",
                flush=True,
            )
    return rows, source, p


def vehicle_table(rows, steps: int) -> str:
    table = [
        [
            "one" if structure == "network" else "per layer", f"`{method}`", f"{elapsed:.1f} s",
            f"{1e3 * per_step:.0f} ms", f"{exact:.6f}",
            ", ".join(f"{d:.4f}" for d in delta) + ("" if method == "cholesky" else f" ({drift:.1e})"),
        ]
        for structure, method, elapsed, per_step, exact, drift, delta in rows
    ]
    return markdown_table(
        ["δ", "route", f"{steps} steps", "per step", "exact log q/N at the end",
         "δ reached (max rel. diff. to Cholesky)"], table)


# ---------------------------------------------------------------------------------------------- part 2
def mnist_like(n: int):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10))
    return net.eval(), torch.rand(n, 784), torch.randint(0, 10, (n,))


def one_run(method: str, n: int) -> dict:
    """One evidence value and gradient (run in its own process by part 2)."""
    net, x, y = mnist_like(n)
    structure = "network" if method == "eigen" else "layer"
    start = time.perf_counter()
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(10), prior_precision=1.0, prior_structure=structure)
    options = EvidenceOptions(seed=0, **SCALE_FREE) if method == "matrix_free" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = model.log_marginal_likelihood(method=method, options=options)
        value.backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad = model.covar_module.raw_prior_precision.grad
    return {
        "method": method,
        "n": n,
        "seconds": elapsed,
        "peak_bytes": peak,
        "value": value.item(),
        "grad": grad.tolist(),
    }


def dense_bytes(method: str, n: int) -> int:
    p = 784 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    groups = 1 if method == "eigen" else 3
    return dense_memory_bytes(p, groups, n, 10, 10, torch.float32, "auto")


def part_scale(args):
    print(
        f"\n== Part 2: largest N·C within {args.budget_seconds:g} s and {args.memory_gib:g} GiB (one value + "
        "gradient), MLP 784-128-128-10, C = 10, random data, float32 =="
    )
    print(
        f"matrix-free settings: {SCALE_FREE}, Lanczos steps 20 (gpytorch default); torch threads: "
        f"{torch.get_num_threads()}"
    )
    limit = int(args.memory_gib * 2**30)
    results = {}
    for method in ("cholesky", "eigen", "matrix_free"):
        sizes = sorted(set(args.sizes), reverse=True)
        if method != "matrix_free":
            fitting = [n for n in sizes if dense_bytes(method, n) <= limit]
            for n in sizes:
                if n not in fitting:
                    print(
                        f"  {method:12s} N = {n:6d} (N·C = {10 * n:7d}): not started, dense memory "
                        f"{dense_bytes(method, n) / 2**30:.1f} GiB > {args.memory_gib:g} GiB"
                    )
            sizes = fitting
        best = None
        n = sizes[0] if sizes else None
        while n is not None and n >= min(args.sizes) // 2:
            command = [
                sys.executable,
                __file__,
                "--one",
                method,
                str(n),
                "--threads",
                str(torch.get_num_threads()),
            ]
            try:
                out = subprocess.run(
                    command, capture_output=True, text=True, timeout=args.budget_seconds, check=True
                )
                run = json.loads(out.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                print(
                    f"  {method:12s} N = {n:6d} (N·C = {10 * n:7d}): over the budget of {args.budget_seconds:g} s"
                )
                n //= 2
                continue
            except subprocess.CalledProcessError as error:
                print(f"  {method:12s} N = {n:6d}: failed: {error.stderr.strip().splitlines()[-1]}")
                n //= 2
                continue
            print(
                f"  {method:12s} N = {n:6d} (N·C = {10 * n:7d}): {run['seconds']:7.1f} s, peak RSS "
                f"{run['peak_bytes'] / 2**30:5.2f} GiB, log q = {run['value']:.1f}, "
                f"∂/∂ raw δ = {[round(g, 2) for g in run['grad']]}",
                flush=True,
            )
            best = run
            break
        results[method] = best
        label = "none" if best is None else f"N·C = {10 * best['n']}"
        print(f"  -> largest for {method}: {label}", flush=True)
    return results


def scale_table(results) -> str:
    rows = []
    for method, best in results.items():
        if best is None:
            rows.append([f"`{method}`", "none within the limits", "", "", ""])
        else:
            rows.append([f"`{method}`", f"{best['n']:,}", f"{10 * best['n']:,}", f"{best['seconds']:.0f} s",
                         f"{best['peak_bytes'] / 2**30:.1f} GiB"])
    return markdown_table(["route", "largest N run", "N·C", "value + gradient", "peak resident memory"], rows)


# ---------------------------------------------------------------------------------------------- part 3
def matrix_free_runs(n: int, seeds, reference: bool):
    net, x, y = mnist_like(n)
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(10), prior_precision=1.0, prior_structure="layer")
    raw = model.covar_module.raw_prior_precision
    out = {}
    methods = (["cholesky"] if reference else []) + [f"matrix_free:{seed}" for seed in seeds]
    for method in methods:
        name, _, seed = method.partition(":")
        options = EvidenceOptions(seed=int(seed), **SCALE_FREE) if seed else None
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = model.log_marginal_likelihood(method=name, options=options)
            (grad,) = torch.autograd.grad(value, raw)
        out[method] = (value.item(), grad, time.perf_counter() - start)
    return out


def part_accuracy(args):
    print(
        "\n== Part 3: accuracy of the matrix-free route with the part-2 settings (MLP 784-128-128-10, C = 10, "
        "float32, per-layer δ) =="
    )
    runs = matrix_free_runs(args.accuracy_n, (0, 1, 2), reference=True)
    ref_value, ref_grad, ref_time = runs.pop("cholesky")
    rows = [[f"N = {args.accuracy_n}", "`cholesky`", f"{ref_value:.1f}", "reference", "reference", f"{ref_time:.1f} s"]]
    for method, (value, grad, seconds) in runs.items():
        rows.append([f"N = {args.accuracy_n}", f"`{method}`", f"{value:.1f}",
                     f"{abs(value - ref_value) / abs(ref_value):.1e}",
                     f"{float((grad - ref_grad).norm() / ref_grad.norm()):.1e}", f"{seconds:.1f} s"])
    print(
        f"  N = {args.accuracy_n}: Cholesky log q = {ref_value:.2f} ({ref_time:.1f} s), ∂/∂ raw δ = "
        f"{[round(g, 2) for g in ref_grad.tolist()]}"
    )
    for method, (value, grad, seconds) in runs.items():
        print(
            f"    {method:14s} log q = {value:.2f} (relative error {abs(value - ref_value) / abs(ref_value):.1e}), "
            f"gradient relative error {float((grad - ref_grad).norm() / ref_grad.norm()):.1e} ({seconds:.1f} s)"
        )
    big = max(args.sizes)
    runs = list(matrix_free_runs(big, (0, 1), reference=False).values())
    (v0, g0, t0), (v1, g1, t1) = runs
    print(
        f"  N = {big}: two seeds: log q = {v0:.1f} and {v1:.1f} (relative spread {abs(v0 - v1) / abs(v0):.1e}), "
        f"gradient spread {float((g0 - g1).norm() / g0.norm()):.1e}; {t0:.1f} s and {t1:.1f} s (the second reuses "
        "the layer features, not the seed's sketch)"
    )
    rows.append([f"N = {big}", "`matrix_free` seeds 0 and 1", f"{v0:.1f}, {v1:.1f}",
                 f"{abs(v0 - v1) / abs(v0):.1e} (spread)", f"{float((g0 - g1).norm() / g0.norm()):.1e} (spread)",
                 f"{t0:.1f} s, {t1:.1f} s"])
    return markdown_table(["size", "route", "log q", "value: rel. error", "gradient: rel. error", "time"], rows)


# ---------------------------------------------------------------------------------------------- part 0
def formulas_table() -> str:
    """Memory of the routes at three sizes of part 2, from the formulas (float32, per-layer δ, G = 3)."""
    widths_in, widths_out = (784, 128, 128), (128, 128, 10)
    p = 784 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    rows = []
    for n in (1000, 2000, 20000):
        function = dense_memory_bytes(p, 3, n, 10, 10, torch.float32, "function")
        chosen = dense_memory_bytes(p, 3, n, 10, 10, torch.float32, "auto")
        dense = f"{function / 2**30:.1f} GiB"
        if chosen != function:
            dense += f" (weight space, which `\"auto\"` takes since `N·k > {WEIGHT_SPACE_FROM} P`: {chosen / 2**30:.0f} GiB)"
        features = n * (10 * sum(widths_out) + sum(widths_in)) * 4
        cg = n * 10 * 10 * 6 * 4
        sketch = n * 10 * 50 * 3 * 4
        rows.append([f"{n:,}", f"{10 * n:,}", dense,
                     f"{features / 2**20:.0f} MiB + {cg / 2**20:.1f} MiB + {sketch / 2**20:.1f} MiB"])
    return markdown_table(["N", "N·C", "dense (function space)",
                           "matrix-free: features + CG vectors (t = 10, ≈ 6 blocks) + sketch (r = 50)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["formulas", "vehicle", "scale", "accuracy", "all"], default="all")
    parser.add_argument("--write-docs", action="store_true", help=f"write the tables into {DOC}")
    parser.add_argument("--accuracy-n", type=int, default=1000)
    parser.add_argument("--data-dir", default=os.environ.get("NTKGP_DATA_DIR"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--budget-seconds", type=float, default=600)
    parser.add_argument("--memory-gib", type=float, default=16)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 10000, 5000, 2000, 1000, 500])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(one_run(args.one[0], int(args.one[1]))))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    command = command_line()
    threads = f"torch.set_num_threads({torch.get_num_threads()})"
    if args.part in ("formulas", "all"):
        table = formulas_table()
        print(table)
        if args.write_docs:
            write_block(DOC, "evidence-memory-examples", table + "\n\nComputed from the formulas, not measured.",
                        command)
    if args.part in ("vehicle", "all"):
        rows, source, p = part_vehicle(args)
        if args.write_docs:
            note = (f"\n\n{source}: N = 600, C = 4, 2×50 tanh MLP (P = {p:,}) trained to its MAP, softmax, float64, "
                    f"{threads}; matrix-free settings {VEHICLE_FREE}, 20 Lanczos steps, fresh probes every step. "
                    "\"exact log q/N\" is computed by the Cholesky route at the δ reached.")
            write_block(DOC, "evidence-scale-steps", vehicle_table(rows, args.steps) + note, command)
    if args.part in ("scale", "all"):
        results = part_scale(args)
        if args.write_docs:
            note = (f"\n\nMLP 784-128-128-10, C = 10, random data, float32, per-layer δ (`eigen`: one δ), {threads}; "
                    f"limits {args.budget_seconds:g} s and {args.memory_gib:g} GiB; sizes tried: {args.sizes}; "
                    f"matrix-free settings {SCALE_FREE}.")
            write_block(DOC, "evidence-scale-largest", scale_table(results) + note, command)
    if args.part in ("accuracy", "all"):
        table = part_accuracy(args)
        if args.write_docs:
            note = f"\n\nMLP 784-128-128-10, C = 10, random data, float32, per-layer δ, {threads}; settings {SCALE_FREE}."
            write_block(DOC, "evidence-scale-accuracy", table + note, command)


if __name__ == "__main__":
    main()
