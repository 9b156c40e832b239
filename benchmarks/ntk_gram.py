"""Empirical-NTK Gram: ntkgp side by side with the torch.func recipe (vmap(jacrev) + einsum).

MLP 8-50-50-C (tanh), N = 1000, C ∈ {1, 10}, float32, and with ``--large-n N`` one more row at C = 1 and that N
(one repeat; the issue's large case is N = 20,000). Both sides are warmed
up on a small input, then timed on the full one; results are checked equal; peak memory is the growth of
the process's resident set during each computation (sampled by a background thread).

    python benchmarks/ntk_gram.py [--n 1000] [--outputs 1 10] [--repeats 3] [--large-n 20000] [--write-docs]

``--write-docs`` writes the table into README.md (generated region ``readme-ntk-gram``).
"""

from __future__ import annotations

import argparse
import gc
import threading
import time

import psutil
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from ntkgp._doctable import command_line, markdown_table, write_block
from ntkgp.ntk import NTKEngine


def recipe_gram(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The torch.func tutorial recipe: per-example Jacobians, then one einsum per parameter."""
    params = {k: v.detach() for k, v in net.named_parameters()}

    def f_single(p, xi):
        return functional_call(net, p, (xi.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(f_single), (None, 0))(params, x)
    n, c = x.shape[0], jac[next(iter(jac))].shape[1]
    gram = sum(torch.einsum("Naf,Mbf->NaMb", j.flatten(2), j.flatten(2)) for j in jac.values())
    return gram.reshape(n * c, n * c)


def ntkgp_gram(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return NTKEngine(net, prior_structure="network").group_grams(x)[0]


class PeakRSS:
    """Peak resident-set growth over a block, sampled every millisecond."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.mib = (self.peak - self.base) / 2**20


def timed(fn, net, x, repeats):
    fn(net, x[:16])  # warm-up
    times, out, mib = [], None, 0.0
    for _ in range(repeats):
        out = None
        gc.collect()
        with PeakRSS() as mem:
            t = time.perf_counter()
            out = fn(net, x)
            times.append(time.perf_counter() - t)
        mib = max(mib, mem.mib)
    return min(times), out, mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--outputs", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large-n", type=int, default=None, help="one more row: C = 1 at this N, one repeat")
    parser.add_argument("--write-docs", action="store_true", help="write the table into README.md (readme-ntk-gram)")
    args = parser.parse_args()
    rows = []
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
    print(f"{'C':>3} {'N':>6} {'P':>6} | {'recipe s':>9} {'MiB':>7} | {'ntkgp s':>8} {'MiB':>7} | {'time ratio':>10} | {'max rel err':>11}")
    cases = [(c, args.n, args.repeats) for c in args.outputs]
    if args.large_n is not None:
        cases.append((1, args.large_n, 1))
    for c, n, repeats in cases:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, c))
        x = torch.randn(n, 8)
        p = sum(q.numel() for q in net.parameters())
        t_ref, k_ref, m_ref = timed(recipe_gram, net, x, repeats)
        t_new, k_new, m_new = timed(ntkgp_gram, net, x, repeats)
        err = ((k_new - k_ref).abs().max() / k_ref.abs().max()).item()
        assert err < 1e-4, f"Grams differ: {err}"
        print(f"{c:>3} {n:>6} {p:>6} | {t_ref:>9.3f} {m_ref:>7.0f} | {t_new:>8.3f} {m_new:>7.0f} | {t_new / t_ref:>10.3f} | {err:>11.1e}")
        rows.append([f"8-50-50-{c}", p, n, f"{t_new:.3g} s, {m_new:.0f} MiB", f"{t_ref:.3g} s, {m_ref:.0f} MiB",
                     f"{t_new / t_ref:.2f}×", f"{err:.1e}"])
        del k_ref, k_new
    if args.write_docs:
        table = markdown_table(["MLP (tanh), float32", "P", "N", "ntkgp `group_grams`", "`vmap(jacrev)` + einsum",
                                "time ratio", "max rel. difference"], rows)
        runs = f"best of {args.repeats}" + (f"; one run for N = {args.large_n}" if args.large_n is not None else "")
        note = (f"Wall time ({runs}) and peak resident-memory growth of one NTK Gram, {torch.get_num_threads()} "
                "threads, both sides in the same run.")
        write_block("README.md", "readme-ntk-gram", note + "\n\n" + table,
                    command_line())


if __name__ == "__main__":
    main()
