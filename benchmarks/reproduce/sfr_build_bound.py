"""A measured lower bound of the SFR build of ``sfr_images.py`` (the SFR paper's CNN, P = 892,010, float32) on this
machine, and what its parts cost: the float64 products of each image's convolution columns with each inducing
input's (``2·C·P_c`` flops per pair, ``P_c`` the convolutions' parameters), which no exact build avoids, and the
passes through the network that a build with more inducing inputs than memory repeats (docs/scaling.md, windows).

Timed bare (best of ``--repeats``): one ``torch.bmm`` of ``--n`` images' float64 columns ``(C, n, P_c)`` with
``--m`` inducing inputs' ``(C, P_c, m)``; the pass of a chunk of ``--n`` images through the float32 network with
its layer features (``chunk_features``: the forward pass, ``C`` backward passes, the per-example blocks); the pass
of a chunk of inducing inputs through the float64 copy. The projection for ``M`` inducing inputs on ``N`` images
(``--project M N KEPT WINDOW STEP``) adds to the products' bound the windowed build's passes: ``1 + ⌈(M − kept) /
window⌉`` passes over every image and ``M − kept`` recomputed inducing inputs per step of ``STEP`` images.

    python benchmarks/reproduce/sfr_build_bound.py --threads 1 --n 64 --m 384 --project 3200 60000 384 384 5000
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _images  # noqa: E402
from ntkgp.models.sfr.system_grams import precise_engine  # noqa: E402
from ntkgp.ntk import NTKEngine  # noqa: E402
from ntkgp.ntk.feature_pass import chunk_features, contracted_width  # noqa: E402


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up (allocations, first-call dispatch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(width_scale: int, n: int, m: int, repeats: int) -> dict:
    net = _images.immer_cnn(width_scale, 0).eval()
    engine = NTKEngine(net, "network", chunk_size=n)
    precise = precise_engine(engine)
    x = torch.rand(n, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    plan = engine.plan(x)
    c, p_c = 10, contracted_width(engine.core, plan)
    g = torch.Generator().manual_seed(1)
    columns = torch.randn(c, n, p_c, generator=g, dtype=torch.float64)
    inducing = torch.randn(c, p_c, m, generator=g, dtype=torch.float64)
    product = best_of(lambda: torch.bmm(columns, inducing), repeats)
    with torch.no_grad():
        data_pass = best_of(lambda: chunk_features(engine.core, plan, x, False), repeats)
        z = x.double()
        z_pass = best_of(lambda: chunk_features(precise.core, precise.plan(z), z, False, single=False), repeats)
    return {"num_parameters": _images.num_parameters(net), "p_conv": p_c, "n": n, "m": m,
            "pair_s": product / (n * m), "pair_gflops": 2 * c * p_c * n * m / product / 1e9,
            "image_pass_s": data_pass / n, "inducing_pass_s": z_pass / n}


def project(r: dict, m: int, n: int, kept: int, window: int, step: int) -> dict:
    products = r["pair_s"] * m * n
    passes = (1 + (math.ceil((m - kept) / window) if m > kept else 0)) * n * r["image_pass_s"]
    recomputed = (m - kept) * math.ceil(n / step) * r["inducing_pass_s"] if m > kept else 0.0
    return {"products_s": products, "passes_s": passes, "recomputed_s": recomputed,
            "total_s": products + passes + recomputed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, default=64, help="images per timed chunk")
    p.add_argument("--m", type=int, default=384, help="inducing inputs in the timed product (a window's width)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width-scale", type=int, default=1, help="divide the CNN's widths (tests)")
    p.add_argument("--project", type=int, nargs=5, metavar=("M", "N", "KEPT", "WINDOW", "STEP"), action="append",
                   default=[], help="project a build: M inducing inputs, N images, kept, window, step")
    args = p.parse_args()
    for name in ("threads", "n", "m", "repeats", "width_scale"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    torch.set_num_threads(args.threads)
    r = measure(args.width_scale, args.n, args.m, args.repeats)
    print(f"CNN P = {r['num_parameters']:,}, P_conv = {r['p_conv']:,}; {args.threads} thread(s)")
    print(f"float64 products: {r['pair_s'] * 1e6:.1f} µs per (image, inducing input), {r['pair_gflops']:.1f} GFLOP/s")
    print(f"pass of an image (float32, layer features): {r['image_pass_s'] * 1e3:.1f} ms; of an inducing input "
          f"(float64 copy, columns): {r['inducing_pass_s'] * 1e3:.1f} ms")
    for m, n, kept, window, step in args.project:
        q = project(r, m, n, kept, window, step)
        print(f"M = {m:,}, N = {n:,} (kept {kept}, window {window}, step {step}): products {q['products_s'] / 3600:.2f} h "
              f"(the bound), passes {q['passes_s'] / 3600:.2f} h, recomputed inducing inputs "
              f"{q['recomputed_s'] / 3600:.2f} h; {q['total_s'] / 3600:.2f} h in all")


if __name__ == "__main__":
    main()
