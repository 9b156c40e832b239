"""Shared helpers of the reproduction scripts (benchmarks/reproduce/*.py).

Every script:

* takes ``--data-dir PATH`` (or the ``NTKGP_DATA_DIR`` environment variable), the benchmark data folder;
* writes one JSON file per run (one data set, split or seed, method setting) into ``--out`` and skips the
  runs whose file exists, so an interrupted reproduction resumes where it stopped and a table can be
  rebuilt from the files alone (``--table-only``);
* prints its table beside the published values with standard errors, and with ``--write-docs`` writes it
  into docs/reproductions.md (``ntkgp._doctable.write_block``);
* has ``--quick``, a short check of the whole pipeline (fewer epochs, splits and data sets; its runs are
  kept apart from the full ones because the settings are part of each file's name).

Standard errors are ``std / sqrt(n)`` (``ddof=1``) over the splits or seeds. A cell counts as *within* the
published value when ``|ours - published| <= 2 * sqrt(se_ours**2 + se_published**2)`` (two standard errors of
the difference); otherwise it is marked ``worse`` or ``better`` (lower NLL/NLPD is better).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from ntkgp._doctable import REPO_ROOT, command_line, markdown_table, write_block
from ntkgp.datasets import resolve_data_dir
from ntkgp.models.sfr.evidence_scale import evidence_of_delta

DOC = "docs/reproductions.md"
RESULTS_ROOT = REPO_ROOT / "benchmarks" / "reproduce" / "results"


def parser(description: str, name: str) -> argparse.ArgumentParser:
    """The common options; ``name`` is the script's results folder under benchmarks/reproduce/results/."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="benchmark data folder (default: $NTKGP_DATA_DIR)")
    p.add_argument("--out", default=str(RESULTS_ROOT / name), help="folder of the per-run JSON files")
    p.add_argument("--quick", action="store_true", help="a short check: few epochs, splits and data sets")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--table-only", action="store_true", help="run nothing; build the table from the JSON files")
    p.add_argument("--write-docs", action="store_true", help=f"write the table into {DOC}")
    return p


def setup(args: argparse.Namespace) -> Path | None:
    """Threads and the data folder (``None`` with ``--table-only``); creates ``--out``."""
    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.table_only:
        return None
    return resolve_data_dir(args.data_dir)


class Store:
    """One JSON file per run in ``folder``; :meth:`run` skips runs whose file exists."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def load(self, key: str) -> dict | None:
        path = self.path(key)
        return json.loads(path.read_text()) if path.is_file() else None

    def run(self, key: str, fn: Callable[[], dict], enabled: bool = True) -> dict | None:
        """The stored result of ``key``, or ``fn()`` (timed, stored atomically); ``None`` if not run."""
        found = self.load(key)
        if found is not None or not enabled:
            return found
        start = time.perf_counter()
        print(f"[run] {key} ...", flush=True)
        result = fn()
        result["run_seconds"] = time.perf_counter() - start
        result["key"] = key
        result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
        result["threads"] = torch.get_num_threads()
        tmp = self.path(key).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=float))
        tmp.replace(self.path(key))
        print(f"[done] {key} in {result['run_seconds']:.1f} s", flush=True)
        return result


def run_grid(store: Store, data_dir: Path | None, datasets: Iterable[str], count: int,
             key: Callable[[str, int], str], run: Callable[[Path, str, int], dict]) -> dict[str, list[dict]]:
    """Every run ``i < count`` of every data set through ``store`` (stored results are loaded, missing ones run
    unless ``data_dir`` is ``None``), grouped by data set."""
    runs: dict[str, list[dict]] = {}
    for dataset in datasets:
        for i in range(count):
            r = store.run(key(dataset, i), lambda: run(data_dir, dataset, i), enabled=data_dir is not None)
            if r is not None:
                runs.setdefault(dataset, []).append(r)
    return runs


def mean_se(values: Iterable[float]) -> tuple[float, float, int]:
    """Mean, standard error (``std(ddof=1) / sqrt(n)``, NaN for n < 2) and n of the finite values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n), n


def compare(ours: tuple[float, float, int], published: tuple[float, float] | None, paper_runs: int | None = None) -> str:
    """``within``, ``worse`` or ``better`` (lower is better) at two standard errors of the difference;
    ``n/a`` without a published value or a result.

    Our standard error comes from our runs. With fewer runs than the paper's (``paper_runs``, when given) it is at
    least ``SE_paper · sqrt(paper_runs / n)``, the standard error of a mean of ``n`` runs that spread as the paper's
    (per-run standard deviation ``SE_paper · sqrt(paper_runs)``): a standard error estimated from two or three
    runs can be far too small, and a single run has none (it then takes that floor, one run of the paper). Without
    ``paper_runs`` a single run's SE is taken as 0 (only the published SE counts)."""
    mean, se, n = ours
    if published is None or n == 0 or not math.isfinite(mean):
        return "n/a"
    p_mean, p_se = published
    se_ours = se if math.isfinite(se) else 0.0
    if paper_runs and n < paper_runs:
        se_ours = max(se_ours, p_se * math.sqrt(paper_runs / n))
    bound = 2 * math.sqrt(se_ours**2 + p_se**2)
    if abs(mean - p_mean) <= bound:
        return "within"
    return "worse" if mean > p_mean else "better"


def fmt(mean: float, se: float | None = None, digits: int = 2) -> str:
    if mean is None or not math.isfinite(mean):
        return "—"
    if se is None or not math.isfinite(se):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


MARK = {"within": "", "worse": " ✗", "better": " ↑", "n/a": ""}


def cell(ours: tuple[float, float, int], published: tuple[float, float] | None,
         paper_runs: int | None = None) -> tuple[str, str]:
    """A table cell ``ours (n) / published`` and the comparison (:func:`compare`)."""
    verdict = compare(ours, published, paper_runs)
    mean, se, n = ours
    text = "not run" if n == 0 else f"{fmt(mean, se)} (n={n})"
    if published is not None:
        text += f" / {fmt(*published)}"
    return text + MARK[verdict], verdict


def table(header: list[str], rows: list[list[object]]) -> str:
    return markdown_table(header, rows)


def publish(args: argparse.Namespace, name: str, markdown: str, title: str = "") -> None:
    """Print the table; with ``--write-docs`` write it into the region ``name`` of docs/reproductions.md."""
    print(f"\n{title or name}\n{markdown}\n")
    if args.write_docs:
        write_block(DOC, name, markdown, command_line())
        print(f"written: {DOC} region {name}")


def mlp(d_in: int, d_out: int, width: int, depth: int, activation: type[nn.Module], seed: int,
        dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """``depth`` hidden layers of ``width`` units, PyTorch's default initialisation under ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), activation()]
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers).to(dtype)


def seconds(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def set_delta(model, delta: float) -> None:
    """Set every prior precision of a model's NTK kernel to ``delta``."""
    model.covar_module.prior_precision = torch.full_like(model.covar_module.prior_precision, delta)


def evidence_delta(sfr, grid: Iterable[float], steps: int) -> float:
    """The δ maximising SFR's sparse evidence on its training data: the best of ``grid``, then ``steps`` Adam steps
    (0.05) on the kernel's raw parameter, log δ; the model is left at that δ, in eval mode. Each value is the model's
    ``log_marginal_likelihood``, with one δ from one eigendecomposition where that is the same model
    (``ntkgp.models.sfr.evidence_scale``: one eigendecomposition in all instead of refactorizing ``K_ZZ`` and
    ``I + A`` at each value)."""
    evidence, scores = evidence_of_delta(sfr), []
    with torch.no_grad():
        for delta in grid:
            set_delta(sfr, delta)
            scores.append((float(evidence()), delta))
    set_delta(sfr, max(scores)[1])
    opt = torch.optim.Adam([sfr.covar_module.raw_prior_precision], lr=0.05)
    sfr.train()
    for _ in range(steps):
        loss = -evidence() / sfr.num_data
        opt.zero_grad()
        loss.backward()
        opt.step()
    sfr.eval()
    return float(sfr.covar_module.prior_precision.detach().reshape(-1)[0])
