"""Structured NTK passes on the FSVI paper's Fashion-MNIST CNN: NTKEngine Grams and diagonals, timed.

The CNN: conv 32 and conv 64 (3×3, padding 1, or ``--padding same``: the same layers written with
``padding="same"``), ReLU and 2×2 max-pooling after each, FC 128 (ReLU), FC 10; P = 421,642. Random 28×28 inputs (no data needed), float32. Rows:

* ``output_grams(x, z, with_diagonal=True)`` — SFR's pass: per-output cross-Grams ``(G, C, N, M)`` of ``N``
  points against ``M`` inducing points and the output diagonals of ``z``;
* ``group_grams(x, z)`` — the full cross-Gram ``(G, N·C, M·C)``;
* ``diag_blocks(x)`` — the per-point ``C×C`` blocks ``(G, N, C, C)``;

each timed on a fresh engine (first call: the layer plan and its check included) and again on the same engine
(warm), in wall-clock and in CPU seconds of the process (all threads; steadier on a shared machine). The results are checked against ``strategy="contraction"`` (``vmap(jacrev)`` Jacobians) on the first
few points.

    python benchmarks/cnn_passes.py [--n 256] [--m 64] [--repeats 2] [--threads 2] [--padding same]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from ntkgp.ntk import NTKEngine


def fmnist_cnn(seed: int = 0, padding: int | str = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=padding), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=padding), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    ).eval()


CALLS = {
    "output_grams": lambda e, x, z: e.output_grams(x, z, with_diagonal=True),
    "group_grams": lambda e, x, z: e.group_grams(x, z),
    "diag_blocks": lambda e, x, z: e.diag_blocks(x),
}


def timed(call, engine, x, z) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    call(engine, x, z)
    return time.perf_counter() - wall, time.process_time() - cpu


def rel_err(a, b) -> float:
    if isinstance(a, tuple):
        return max(rel_err(u, v) for u, v in zip(a, b))
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="data points")
    parser.add_argument("--m", type=int, default=64, help="inducing points")
    parser.add_argument("--repeats", type=int, default=2, help="warm calls (best of)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--check", type=int, default=6, help="points checked against vmap(jacrev)")
    parser.add_argument("--calls", nargs="+", default=list(CALLS), choices=list(CALLS))
    parser.add_argument("--padding", default="1", choices=["1", "same"], help="the convolutions' padding argument")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    net = fmnist_cnn(padding=1 if args.padding == "1" else "same")
    p = sum(q.numel() for q in net.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.n, 1, 28, 28, generator=g)
    z = torch.randn(args.m, 1, 28, 28, generator=g)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, P = {p:,}, N = {args.n}, M = {args.m}, "
          f"padding={args.padding}")
    print(f"{'call':>13} | {'first s':>8} {'(cpu)':>8} | {'warm s':>8} {'(cpu)':>8} | {'check rel err':>13}")
    for name in args.calls:
        call = CALLS[name]
        engine = NTKEngine(net)
        first = timed(call, engine, x, z)
        warm = min((timed(call, engine, x, z) for _ in range(args.repeats)), key=lambda t: t[1])
        k = args.check
        fast = call(engine, x[:k], z[: max(1, k // 2)])
        reference = call(NTKEngine(net, strategy="contraction"), x[:k], z[: max(1, k // 2)])
        err = rel_err(fast, reference)
        print(f"{name:>13} | {first[0]:>8.2f} {first[1]:>8.2f} | {warm[0]:>8.2f} {warm[1]:>8.2f} | {err:>13.1e}")


if __name__ == "__main__":
    main()
