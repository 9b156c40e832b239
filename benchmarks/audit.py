"""A hostile but realistic user's audit of ntkgp against docs/guarantees.md (issue 25, the second audit).

Each case does one thing a user would try — a bad input at a public entry point, a change of state after
construction, a save and reload, an interrupt, a numerically awkward problem, a bad command line — and is
judged against an independent computation (a float64 reference, a freshly built model, brute force) and
against copies of the user's objects taken before (parameters, buffers, ``.grad``, ``requires_grad``,
training flags, hooks, input tensors). One line per case:

    ID  AREA  WHAT WAS TRIED  OUTCOME  detail

with OUTCOME one of ``HELD`` (the documented behaviour, value checked), ``CLEAR-ERROR`` (a documented error
naming the argument, before any side effect), ``SILENT-WRONG``, ``MODIFIED-USER-OBJECT`` or ``RAW-ERROR`` (an
exception the library did not turn into a clear error), then the counts per area and outcome.

    python benchmarks/audit.py                      # every area (a few minutes on 2 cores)
    python benchmarks/audit.py --areas sfr fsvi     # some areas
    python benchmarks/audit.py --cases sfr-03       # some cases
    python benchmarks/audit.py --list               # the cases, without running them
    python benchmarks/audit.py --write-docs         # every area, the counts into docs/guarantees.md

Areas: ntkgp, sfr, fsvi, marglik, posteriors, numerics, likelihoods, cli, data, networks, threads. The exit status is 1 when a
case is SILENT-WRONG, MODIFIED-USER-OBJECT or RAW-ERROR, else 0.
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.audit_cases import AREAS, load  # noqa: E402
from benchmarks.audit_cases.framework import (  # noqa: E402
    CLEAR, HELD, MODIFIED, OUTCOMES, RAW, SILENT, ModifiedUserObject, SilentWrong, iter_cases)


def run_case(c) -> tuple[str, str]:
    """Run one case: its outcome and a one-line detail."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = c.fn()
    except SilentWrong as wrong:
        return SILENT, str(wrong)
    except ModifiedUserObject as modified:
        return MODIFIED, str(modified)
    except BaseException as error:  # noqa: BLE001 - a KeyboardInterrupt from a case's hook is a result too
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        where = f" [{Path(frame.filename).name}:{frame.lineno}]" if frame else ""
        return RAW, f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}{where}"
    outcome, detail = result if isinstance(result, tuple) else (result, "")
    if outcome not in (HELD, CLEAR):
        raise ValueError(f"case {c.id} returned {outcome!r}")
    return outcome, detail


def _write_docs(counts, total) -> None:
    from ntkgp._doctable import command_line, markdown_table, write_block

    rows = [[area, *(counts[area][o] for o in OUTCOMES), sum(counts[area].values())]
            for area in AREAS if area in counts]
    rows.append(["**all**", *(f"**{total[o]}**" for o in OUTCOMES), f"**{sum(total.values())}**"])
    write_block("docs/guarantees.md", "guarantees-audit", markdown_table(["area", *OUTCOMES, "cases"], rows),
                command_line())


def main(argv=None) -> int:
    # the SIGINT cases send this process a real SIGINT: a shell starts a background job (``cmd &``) with SIGINT
    # ignored, and Python then raises no KeyboardInterrupt, which would count as a silent failure of ntkgp's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--areas", nargs="+", choices=AREAS, help="the areas to run (default: all)")
    parser.add_argument("--cases", nargs="+", metavar="ID", help="the case ids to run")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the counts into docs/guarantees.md (region guarantees-audit; every case only)")
    args = parser.parse_args(argv)
    if args.write_docs and (args.areas or args.cases or args.list):
        parser.error("--write-docs writes the counts of the whole audit: give no --areas, --cases or --list")
    load(args.areas or AREAS)
    cases = iter_cases(args.areas, args.cases)
    if args.cases and len(cases) != len(set(args.cases)):
        parser.error(f"unknown case ids: {sorted(set(args.cases) - {c.id for c in cases})}")
    if args.list:
        for c in cases:
            print(f"{c.id:10s} {c.area:11s} {c.what}")
        return 0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    start = time.perf_counter()
    for c in cases:
        t0 = time.perf_counter()
        outcome, detail = run_case(c)
        counts[c.area][outcome] += 1
        seconds = time.perf_counter() - t0
        print(f"{c.id:10s} {c.area:11s} {c.what:95s} {outcome:20s} {seconds:5.1f}s  {detail}", flush=True)
    total = collections.Counter()
    print(f"\n{'area':11s} " + " ".join(f"{o:>20s}" for o in OUTCOMES) + f" {'cases':>6s}")
    for area in [a for a in AREAS if a in counts]:
        total.update(counts[area])
        print(f"{area:11s} " + " ".join(f"{counts[area][o]:20d}" for o in OUTCOMES)
              + f" {sum(counts[area].values()):6d}")
    print(f"{'all':11s} " + " ".join(f"{total[o]:20d}" for o in OUTCOMES) + f" {sum(total.values()):6d}")
    print(f"{sum(total.values())} cases in {time.perf_counter() - start:.0f} s")
    if args.write_docs:
        _write_docs(counts, total)
    return 1 if any(total[o] for o in (SILENT, MODIFIED, RAW)) else 0


if __name__ == "__main__":
    sys.exit(main())
