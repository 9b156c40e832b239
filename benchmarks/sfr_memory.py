"""Peak memory of SFR with joint C×C output coupling against the formula of docs/scaling.md ("Memory of SFR").

Classification, MLP 784-64-64-10, ``--n`` random inputs, ``--m`` inducing inputs (``K = M·C``), one process on
the CPU, one thread. Each case runs in a fresh interpreter. After a small warm-up model, the peak resident
memory is reset (``/proc/self/clear_refs``) and measured (``VmHWM``) above the resident memory before the
model is built, for two stages: the build (dual statistics and per-group ``K_ZZ``), and the first prediction
of 200 test points plus the sparse evidence (the factorization). The peak is the larger of the two. It is
compared with the formula

    8 bytes × [S·(G·K)² + (G + 4)·K² + 3·2²⁴]

(``S`` = 1 slot for classification, ``G`` prior groups, the last term the streaming and prediction buffers; 8
bytes for a float32 network too, whose statistics SFR sums and factorizes in float64);
before the change that stopped keeping ``K_ZZ``, ``B_u`` and ``A`` the constant was ``G + 8``. With
``statistics="combined"`` the statistics and ``K_ZZ`` are one group whatever ``G``: ``8 bytes × [S·K² + 5·K² + 3·2²⁴]``.

A case is ``dtype:prior_structure``, or ``dtype:prior_structure:combined`` for ``statistics="combined"``
(measured the same way, compared with the combined formula).

``--before PATH`` runs every case a second time with the ``ntkgp`` package found in ``PATH`` (a copy of an
earlier tree) and prints both side by side. ``--write-docs`` writes the regions ``sfr-memory`` (the measured
table) and ``sfr-memory-mnist`` (the formula at the MNIST scale of issue 11; a computation, not a measurement)
of docs/scaling.md. ``--mnist-only`` computes (and, with ``--write-docs``, writes) only the second, in a moment.
``--combined-table`` measures instead ``float32:layer`` and ``float32:layer:combined`` side by side (peaks,
formulas, and the largest relative difference of the evidence and predictive variances between the two modes)
and, with ``--write-docs``, writes only the region ``sfr-memory-combined``.

    python benchmarks/sfr_memory.py [--n 1000 --m 512] [--cases float32:network float32:layer ...]
        [--before /tmp/old_tree] [--write-docs]
    python benchmarks/sfr_memory.py --mnist-only [--write-docs]
    python benchmarks/sfr_memory.py --combined-table [--n 300 --m 256] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch
from ntkgp.models import SFRMemoryOptions

DOC = "docs/scaling.md"
OLD_CONSTANT, NEW_CONSTANT = 8, 4


def formula(
    dtype: torch.dtype, groups: int, k: int, slots: int = 1, constant: int = NEW_CONSTANT, combined: bool = False
) -> float:
    """The bound of docs/scaling.md in MiB: ``8 bytes × [S·(G·K)² + (G + constant)·K² + 3·2²⁴]``; with
    ``combined`` (``statistics="combined"``) the statistics and ``K_ZZ`` are one group: ``G = 1`` in it.

    SFR keeps its statistics, ``K_ZZ`` and the factorization in float64 whatever the network's dtype (a float32
    network's cross-Grams are summed in float64), so the bytes are 8 for both dtypes; ``dtype`` (the network's) is
    kept for the callers and changes only the streaming buffers, which the ``3·2²⁴`` term bounds from above."""
    del dtype  # every term of the bound is float64 (an upper bound for the network-dtype streaming buffers)
    groups = 1 if combined else groups
    numbers = slots * (groups * k) ** 2 + (groups + constant) * k**2 + 3 * 2**24
    return numbers * 8 / 2**20


def _high_water_mib() -> float:
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+)", status.read())[1]) / 1024


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def case(spec: str, n: int, m: int) -> dict:
    """One case ``dtype:prior_structure[:combined]``, measured in this interpreter."""
    import psutil
    from torch import nn

    import ntkgp
    from ntkgp.likelihoods import SoftmaxLikelihood
    from ntkgp.models.sfr import SFR

    dtype_name, structure, *mode = spec.split(":")
    if mode not in ([], ["combined"]):
        raise ValueError(f"a case is dtype:prior_structure[:combined], got {spec!r}")
    statistics = "combined" if mode else "per_group"
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    c = 10
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, c))
    net = net.to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 784, dtype=dtype, generator=g), torch.randint(0, c, (n,), generator=g)
    x_test = torch.randn(200, 784, dtype=dtype, generator=g)
    likelihood = SoftmaxLikelihood(c).to(dtype)
    SFR(net, x[:40], y[:40], likelihood, num_inducing=4, prior_structure=structure,  # warm-up
        memory=SFRMemoryOptions(statistics=statistics))(x_test[:5]).variance

    base = psutil.Process().memory_info().rss / 2**20
    _reset_high_water()
    start = time.perf_counter()
    sfr = SFR(net, x, y, likelihood, num_inducing=m, prior_structure=structure, output_coupling="joint",
              memory=SFRMemoryOptions(statistics=statistics))
    built, build_peak = time.perf_counter() - start, _high_water_mib() - base
    _reset_high_water()
    start = time.perf_counter()
    with torch.no_grad():
        variance = sfr(x_test).variance
        evidence = sfr.log_marginal_likelihood()
    solved, solve_peak = time.perf_counter() - start, _high_water_mib() - base
    return {"dtype": dtype_name, "structure": structure, "statistics": statistics,
            "groups": sfr.engine.num_groups, "k": m * c,
            "build_s": built, "solve_s": solved, "build_peak": build_peak, "solve_peak": solve_peak,
            "peak": max(build_peak, solve_peak), "evidence": float(evidence), "variance": float(variance.sum()),
            "variances": variance.double().flatten().tolist(),
            "ntkgp": os.path.dirname(ntkgp.__file__)}


def run_case(spec: str, n: int, m: int, tree: str | None = None) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.path.abspath(tree) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", spec, "--n", str(n), "--m", str(m)],
                          capture_output=True, text=True, env=env, cwd=tree or None)
    if done.returncode != 0:
        raise RuntimeError(f"case {spec} ({tree or 'this tree'}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mnist_table() -> str:
    """The formulas at the MNIST scale of issue 11 (``M = 2048``, ``C = 10``, float32, ``S = 1``): a computation,
    not a measurement."""
    from ntkgp._doctable import markdown_table

    k = 2048 * 10
    gib = 2**10
    rows = []
    for groups, label, combined in ((1, '`"network"`', False), (3, '`"layer"` (3 layers)', False),
                                    (3, '`"layer"` (3 layers), `statistics="combined"` (one group: `G = 1`)', True)):
        old = "—" if combined else f"{formula(torch.float32, groups, k, constant=OLD_CONSTANT) / gib:.1f}"
        stored = 1 if combined else groups
        rows.append([label, f"{k:,}", old, f"{formula(torch.float32, groups, k, combined=combined) / gib:.1f}",
                     f"{stored**2 * k**2 * 8 / 2**30:.1f}"])
    return markdown_table(
        ["prior structure", "`K = M·C`", "old formula (`G + 8`), GiB", "formula (`G + 4`), GiB",
         "of which the statistics `(G·K)²`, GiB"], rows)


def _largest_difference(a: dict, b: dict) -> tuple[float, float]:
    """The relative difference of the evidence, and the largest relative difference of the predictive variances
    (each point and output), of two cases."""
    evidence = abs(a["evidence"] - b["evidence"]) / abs(b["evidence"])
    variances = max(abs(u - v) / abs(v) for u, v in zip(a["variances"], b["variances"], strict=True))
    return evidence, variances


def combined_table(n: int, m: int, write_docs: bool) -> None:
    """``float32:layer`` with per-group and with combined statistics at the same ``N``, ``M``, side by side."""
    from ntkgp._doctable import command_line, markdown_table, write_block

    print(f"SFR, softmax C = 10, joint coupling, MLP 784-64-64-10, N = {n}, M = {m}, one thread; MiB", flush=True)
    results = {}
    for spec in ("float32:layer", "float32:layer:combined"):
        result = results[spec] = run_case(spec, n, m)
        combined = result["statistics"] == "combined"
        bound = result["bound"] = formula(torch.float32, result["groups"], result["k"], combined=combined)
        print(f"{spec}: G={result['groups']} K={result['k']}: build {result['build_s']:.1f} s, build peak "
              f"{result['build_peak']:.0f}, factorization peak {result['solve_peak']:.0f} (formula {bound:.0f}, "
              f"ratio {result['peak'] / bound:.2f}); evidence {result['evidence']:.6g}", flush=True)
    per_group, combined = results["float32:layer"], results["float32:layer:combined"]
    evidence, variances = _largest_difference(combined, per_group)
    print(f"combined against per-group: evidence {evidence:.1e}, variances (largest) {variances:.1e}")
    labels = {"per_group": ('`"per_group"` (default)', "`S·(G·K)² + (G + 4)·K² + 3·2²⁴`"),
              "combined": ('`"combined"`', "`S·K² + 5·K² + 3·2²⁴`")}
    rows = []
    for result in (per_group, combined):
        label, expression = labels[result["statistics"]]
        bound = result["bound"]
        difference = "—" if result is per_group else f"{evidence:.0e} / {variances:.0e}"
        rows.append([label, f"{result['build_s']:.1f}",
                     f"{result['peak']:.0f} ({result['build_peak']:.0f} / {result['solve_peak']:.0f})",
                     expression, f"{bound:.0f}", f"{result['peak'] / bound:.2f}", difference])
    table = markdown_table(
        ["`statistics`", "build s", "peak, MiB (build / factorization)", "formula", "formula, MiB",
         "peak / formula", "rel. diff. from per-group: evidence / variances (largest)"], rows)
    note = (f"\n\nfloat32, `prior_structure=\"layer\"` (`G = {per_group['groups']}`), N = {n}, M = {m} "
            f"(`K = {per_group['k']}`, `K² = {per_group['k'] ** 2 * 8 / 2**20:.0f} MiB` in float64), MLP 784-64-64-10, softmax, "
            "joint coupling, `S = 1`, one thread on the CPU; each case in a fresh interpreter, in the same run. The "
            "last column compares the evidence and the 200 × 10 predictive variances of the combined case with "
            "those of the per-group case.")
    print()
    print(table)
    if write_docs:
        write_block(DOC, "sfr-memory-combined", table + note, command_line())


MNIST_NOTE = ("\n\nComputed from the formulas (a float32 network, whose statistics are float64; `S = 1`, `M = 2048`, "
              "`C = 10`), not measured: no GPU was available.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--m", type=int, default=512)
    parser.add_argument("--cases", nargs="+",
                        default=["float32:network", "float64:network", "float32:layer", "float64:layer"],
                        help="dtype:prior_structure pairs")
    parser.add_argument("--before", help="a folder holding an earlier ntkgp package, measured side by side")
    parser.add_argument("--write-docs", action="store_true", help=f"write the tables into {DOC}")
    parser.add_argument("--mnist-only", action="store_true",
                        help="only the formula table at the MNIST scale (no measurement)")
    parser.add_argument("--combined-table", action="store_true",
                        help="measure float32:layer with per-group and with combined statistics side by side "
                             "(with --write-docs, write only the region sfr-memory-combined)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(case(args.case, args.n, args.m)))
        return
    if args.combined_table:
        combined_table(args.n, args.m, args.write_docs)
        return
    if args.mnist_only:
        from ntkgp._doctable import command_line, write_block

        table = mnist_table()
        print(table)
        if args.write_docs:
            write_block(DOC, "sfr-memory-mnist", table + MNIST_NOTE, command_line())
        return
    print(f"SFR, softmax C = 10, joint coupling, MLP 784-64-64-10, N = {args.n}, M = {args.m}, one thread; MiB",
          flush=True)
    rows = []
    for spec in args.cases:
        before = run_case(spec, args.n, args.m, args.before) if args.before else None
        after = run_case(spec, args.n, args.m)
        dtype = getattr(torch, after["dtype"])
        unit = after["k"] ** 2 * 8 / 2**20  # K² in float64, the statistics' dtype for both networks
        new = formula(dtype, after["groups"], after["k"], combined=after["statistics"] == "combined")
        old = formula(dtype, after["groups"], after["k"], constant=OLD_CONSTANT)
        same = None if before is None else max(
            abs(before[key] - after[key]) / max(abs(after[key]), 1e-300) for key in ("evidence", "variance"))
        rows.append((after, before, unit, old, new, same))
        line = (f"{after['dtype']} G={after['groups']} K={after['k']} K²={unit:.0f} MiB: after: build "
                f"{after['build_s']:.1f} s, build peak {after['build_peak']:.0f}, factorization peak "
                f"{after['solve_peak']:.0f}, peak {after['peak']:.0f} (formula {new:.0f}, ratio {after['peak'] / new:.2f})")
        if before is not None:
            line += (f"; before: build peak {before['build_peak']:.0f}, factorization peak {before['solve_peak']:.0f}, "
                     f"peak {before['peak']:.0f} (old formula {old:.0f}); results differ by {same:.1e}")
        print(line, flush=True)

    header = ["dtype", "`G`", "`K²`, MiB", "build s"]
    if args.before:
        header += ["peak before, MiB (build / factorization)", "old formula `G + 8`, MiB"]
    header += ["peak after, MiB (build / factorization)", "formula `G + 4`, MiB", "peak / formula"]
    if args.before:
        header += ["evidence, variances: largest rel. diff."]
    table = []
    for after, before, unit, old, new, same in rows:
        mode = ", combined" if after["statistics"] == "combined" else ""
        cells = [after["dtype"], f"{after['groups']} (`\"{after['structure']}\"`{mode})", f"{unit:.0f}",
                 f"{after['build_s']:.0f}"]
        if before is not None:
            cells += [f"{before['peak']:.0f} ({before['build_peak']:.0f} / {before['solve_peak']:.0f})", f"{old:.0f}"]
        cells += [f"{after['peak']:.0f} ({after['build_peak']:.0f} / {after['solve_peak']:.0f})", f"{new:.0f}",
                  f"{after['peak'] / new:.2f}"]
        if before is not None:
            cells.append(f"{same:.0e}")
        table.append(cells)

    from ntkgp._doctable import markdown_table, write_block

    measured = markdown_table(header, table)
    extrapolated = mnist_table()
    print()
    print(measured)
    print()
    print(extrapolated)
    if args.write_docs:
        command = "python benchmarks/sfr_memory.py"
        command += f" --n {args.n} --m {args.m}" + (" --before <copy of the tree before>" if args.before else "")
        command += " --write-docs"
        note = (f"\n\nN = {args.n}, M = {args.m} (`K = {args.m * 10}`), MLP 784-64-64-10, softmax, "
                "one thread on the CPU; each case in a fresh interpreter. \"before\" is the same script run on "
                "the tree before the change.")
        write_block(DOC, "sfr-memory", measured + note, command)
        write_block(DOC, "sfr-memory-mnist", extrapolated + MNIST_NOTE, command)


if __name__ == "__main__":
    main()
