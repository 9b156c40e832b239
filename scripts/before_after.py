"""Run benchmark scripts side by side on two checkouts of ntkgp and compare their times and their printed values.

A developer tool for "behaviour unchanged" checks after a refactoring: each command of a list is run from each
root's own copy of its script, with ``PYTHONPATH=<root>`` (so that ``import ntkgp`` and ``import benchmarks``
take that root's package), one thread (``OMP_NUM_THREADS=1`` and the like), alternated before / after / before /
after (``--repeats`` rounds). Every run's output and its working folder are kept under ``--out`` (default
``/tmp/before_after``), never in a repository.

The commands come from ``--commands FILE`` (or ``-c`` on the command line), one a line::

    NAME | SCRIPT ARGS...                      # the same arguments on both sides
    NAME | SCRIPT ARGS... | BEFORE_ARGS...     # the base's script has another command line

``SCRIPT`` is a path relative to the root (``benchmarks/fsvi.py``) or ``-m MODULE``; blank lines and lines that
start with ``#`` are skipped. Placeholders in the arguments: ``{run}`` a fresh empty folder of that run (results,
JSON files), ``{shared}`` a folder of that command kept across its runs and both sides (a cache of a trained
network, say). ``--write-docs`` is refused: the docs are never rewritten.

The printed output is read as markdown tables and lines of text. Times are the numbers with a unit of time
(``0.52 s``, ``31 ms``), the ratios written ``2.1×`` and every number of a column whose header names a time
(``fit s``, ``CPU``, ``wall``, ``time``...). Every other number is a value: each is compared between the sides,
keyed by its table's header, its row's leading cells and its column (or, outside tables, by its line with the
numbers masked). A value that changes between two runs of the same side (a date, a load average, a peak memory)
is "noisy" and not compared; a value the same within each side but different between them is reported, with the
printed digits: "round-off" when the two differ by at most one unit of the last printed digit (or relatively by
``--rtol``), "DIFFERS" otherwise.

    python scripts/before_after.py --before ../old-checkout --commands cmds.txt [--after .] [--repeats 2]
        [--lock /tmp/bench.lock] [--cpu 0] [--timeout 900]

Prints a markdown table (command, the smallest wall time of each side, the ratio after / before, the geometric
mean and range of the ratios of the script's own times, whether the values agree) and, per command, the ratio
of each timed cell and every value that differs. ``--json`` also writes everything as JSON.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

NUMBER = re.compile(r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+−]?\d+)?")
TIME_UNIT = re.compile(r"^\s*(?:ms|s|sec|secs|seconds?|min|minutes?|h|hours?|µs|us)\b")
RATIO = re.compile(r"^\s*×(?!\s*[\d(])")
TIME_HEADER = re.compile(r"(?i:\b(?:seconds?|secs?|times?|wall|cpu|speed-?up|per step)\b|/ ?step\b)|×|\(m?s\)"
                         r"|(?:^|\s)m?s\s*$")  # a lone "s" only at the end: "f + J s (NTKGP)" is no time
DATE = re.compile(r"\d{4}-\d{2}-\d{2}(?:[ T]\d{2}:\d{2}(?::\d{2})?)?(?: UTC)?")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


@dataclass
class Command:
    """One line of the command list: its name and each side's command line after the interpreter."""

    name: str
    after: list[str]
    before: list[str]


@dataclass
class Run:
    """One run of one command on one side: its wall time, exit status and the numbers read from its output."""

    side: str
    round: int
    wall: float
    returncode: int
    times: dict[str, float] = field(default_factory=dict)
    values: dict[str, list[str]] = field(default_factory=dict)


def parse_commands(lines: list[str]) -> list[Command]:
    """The commands of ``lines`` (``NAME | ARGS [| BEFORE_ARGS]``).

    Raises:
        ValueError: a line without a name and a command, or one that asks for ``--write-docs``.
    """
    commands = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]
        if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
            raise ValueError(f"commands line {number}: expected 'NAME | SCRIPT ARGS [| BEFORE_ARGS]', got {line!r}")
        after = shlex.split(parts[1])
        before = shlex.split(parts[2]) if len(parts) == 3 else list(after)
        if any(a.startswith("--write-docs") for a in after + before):
            raise ValueError(f"commands line {number}: --write-docs is refused (the docs are not rewritten)")
        commands.append(Command(parts[0], after, before))
    names = [c.name for c in commands]
    if len(set(names)) != len(names):
        raise ValueError(f"commands: names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return commands


def to_float(text: str) -> float:
    """A printed number as a float (thousands separators and the minus sign ``−`` read)."""
    return float(text.replace(",", "").replace("−", "-"))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _mask(text: str) -> str:
    return NUMBER.sub("#", DATE.sub("DATE", text)).strip()


def _numbers(text: str, timed_column: bool) -> tuple[list[str], list[str]]:
    """The times and the values printed in ``text`` (a table cell or a line)."""
    times, values = [], []
    text = DATE.sub(" ", text)
    if "load average" in text:
        text = re.sub(r"load average[^,;)]*", " ", text)
    for match in NUMBER.finditer(text):
        rest = text[match.end():]
        if timed_column or TIME_UNIT.match(rest) or RATIO.match(rest):
            scale = 1e-3 if re.match(r"^\s*ms\b", rest) else 1e-6 if re.match(r"^\s*(µs|us)\b", rest) else 1.0
            scale = 60.0 if re.match(r"^\s*min", rest) else 3600.0 if re.match(r"^\s*h(ours?)?\b", rest) else scale
            times.append(str(to_float(match.group()) * scale) if not RATIO.match(rest) else "x" + match.group())
        else:
            values.append(match.group())
    return times, values


def read_output(text: str) -> tuple[dict[str, float], dict[str, list[str]]]:
    """The times (in seconds; ratios ``×`` as they are, their keys marked) and the values of a printed output."""
    times: dict[str, float] = {}
    values: dict[str, list[str]] = {}
    seen: dict[str, int] = {}

    def key(base: str) -> str:
        seen[base] = seen.get(base, 0) + 1
        return base if seen[base] == 1 else f"{base} #{seen[base]}"

    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        is_table = (line.lstrip().startswith("|") and i + 1 < len(lines)
                    and re.fullmatch(r"\s*\|?(\s*:?-{3,}:?\s*\|)+\s*:?-*:?\s*", lines[i + 1]) is not None)
        fixed = (not is_table and i + 1 < len(lines) and re.fullmatch(r"\s*-{10,}\s*", lines[i + 1]) is not None
                 and len(re.split(r"\s{2,}", line.strip())) > 1)  # a fixed-width table: columns 2+ spaces apart
        if is_table or fixed:
            split = _cells if is_table else (lambda text: re.split(r"\s{2,}", text.strip()))
            header = split(line)
            table = key("table[" + _mask(" | ".join(header))[:80] + "]")
            timed = [bool(TIME_HEADER.search(h)) for h in header]
            i += 2
            while i < len(lines) and (lines[i].lstrip().startswith("|") if is_table else lines[i].strip()
                                      and not lines[i].lstrip().startswith("|")):
                cells = split(lines[i])
                row = key(table + " row[" + " / ".join(_mask(c)[:40] for c in cells[:2]) + "]")
                for j, cell in enumerate(cells):
                    column = header[j] if j < len(header) else f"column {j}"
                    cell_times, cell_values = _numbers(cell, j < len(timed) and timed[j] and j > 0)
                    for k, t in enumerate(cell_times):
                        name = f"{row} :: {column}" + (f" [{k}]" if k else "")
                        if t.startswith("x"):
                            times[name + " (× ratio)"] = to_float(t[1:])
                        else:
                            times[name] = float(t)
                    if cell_values:
                        values[f"{row} :: {column}"] = cell_values
                i += 1
            continue
        line_times, line_values = _numbers(line, False)
        if line_times or line_values:
            base = key("line[" + _mask(line)[:100] + "]")
            for k, t in enumerate(line_times):
                if t.startswith("x"):
                    times[f"{base} [{k}] (× ratio)"] = to_float(t[1:])
                else:
                    times[f"{base} [{k}]"] = float(t)
            if line_values:
                values[base] = line_values
        i += 1
    return times, values


def expand(args: list[str], run_dir: Path, shared: Path) -> list[str]:
    return [a.replace("{run}", str(run_dir)).replace("{shared}", str(shared)) for a in args]


def run_one(command: Command, side: str, root: Path, round_: int, args) -> Run:
    """Run ``command`` on ``side`` from ``root`` once; its output goes to ``args.out/NAME/SIDE-ROUND.*``."""
    folder = Path(args.out) / command.name
    run_dir = folder / f"{side}-{round_}"
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "work").mkdir(parents=True)
    shared = folder / "shared"
    shared.mkdir(exist_ok=True)
    argv = expand(command.before if side == "before" else command.after, run_dir / "work", shared)
    if argv[0] != "-m":
        argv[0] = str(root / argv[0])
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    env.update({v: str(args.threads) for v in THREAD_VARIABLES})
    full = (["taskset", "-c", args.cpu] if args.cpu is not None else []) + [args.python, *argv]
    (run_dir / "command.txt").write_text(shlex.join(full) + f"\n# cwd {root}, PYTHONPATH={root}\n")
    with open(run_dir / "stdout.txt", "w") as out, open(run_dir / "stderr.txt", "w") as err, \
            open(args.lock or os.devnull, "a") as lock:
        if args.lock:  # the wait for the lock is not timed
            fcntl.flock(lock, fcntl.LOCK_EX)
        start = time.perf_counter()
        try:
            rc = subprocess.run(full, cwd=root, env=env, stdout=out, stderr=err, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -999
        wall = time.perf_counter() - start
        if args.lock:
            fcntl.flock(lock, fcntl.LOCK_UN)
    (run_dir / "run.json").write_text(json.dumps({"wall": wall, "returncode": rc}))
    times, values = read_output((run_dir / "stdout.txt").read_text(errors="replace").replace(str(run_dir), "RUN"))
    print(f"  {command.name} {side} round {round_}: {wall:.1f} s, rc {rc}", file=sys.stderr, flush=True)
    return Run(side, round_, wall, rc, times, values)


def load_runs(command: Command, args) -> list[Run]:
    """The runs of ``command`` kept under ``args.out`` by an earlier call (``--report-only``), in their order."""
    runs = []
    for run_dir in sorted((Path(args.out) / command.name).glob("*-*"), key=lambda d: (int(d.name.split("-")[1]),
                                                                                     d.name.split("-")[0] == "after")):
        meta = run_dir / "run.json"
        if run_dir.name.split("-")[0] not in ("before", "after") or not meta.is_file():
            continue
        info = json.loads(meta.read_text())
        times, values = read_output((run_dir / "stdout.txt").read_text(errors="replace").replace(str(run_dir), "RUN"))
        runs.append(Run(run_dir.name.split("-")[0], int(run_dir.name.split("-")[1]), info["wall"],
                        info["returncode"], times, values))
    return runs


def _last_digit(text: str) -> float:
    mantissa = re.split(r"[eE]", text)[0]
    exponent = int(re.split(r"[eE]", text)[1].replace("−", "-")) if re.search(r"[eE]", text) else 0
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 10.0 ** (exponent - decimals)


def compare_values(runs: list[Run], rtol: float) -> tuple[list[str], list[str], int]:
    """The values that differ between the sides (each a line), the noisy keys and the number of values compared."""
    by_side = {s: [r for r in runs if r.side == s and r.returncode == 0] for s in ("before", "after")}
    if not by_side["before"] or not by_side["after"]:
        return ["a side has no successful run"], [], 0
    keys = set.intersection(*(set(r.values) for r in by_side["before"] + by_side["after"]))
    differs, noisy, compared = [], [], 0
    for key in sorted(keys):
        seen = {s: [r.values[key] for r in rs] for s, rs in by_side.items()}
        if any(any(v != vs[0] for v in vs) for vs in seen.values()):
            noisy.append(key)
            continue
        b, a = seen["before"][0], seen["after"][0]
        compared += len(b)
        if b == a:
            continue
        if len(a) != len(b):
            differs.append(f"DIFFERS `{key}`: {b} → {a}")
            continue
        for x, y in zip(b, a):
            if x == y:
                continue
            fx, fy = to_float(x), to_float(y)
            close = (abs(fx - fy) <= 1.01 * max(_last_digit(x), _last_digit(y))
                     or abs(fx - fy) <= rtol * max(abs(fx), abs(fy)))
            differs.append(f"{'round-off' if close else 'DIFFERS'} `{key}`: {x} → {y}")
    only = {s: set.union(*(set(r.values) for r in rs)) - keys for s, rs in by_side.items()}
    for s, extra in only.items():
        if extra:
            differs.append(f"only {s} prints {len(extra)} value keys (e.g. `{sorted(extra)[0]}`)")
    return differs, noisy, compared


def time_ratios(runs: list[Run]) -> list[tuple[str, float, float, float]]:
    """Per timed cell printed by both sides in every run: the smallest time of each side and after / before."""
    ok = [r for r in runs if r.returncode == 0]
    if not any(r.side == "before" for r in ok) or not any(r.side == "after" for r in ok):
        return []
    keys = set.intersection(*(set(r.times) for r in ok))
    rows = []
    for key in sorted(keys, key=lambda k: list(ok[0].times).index(k)):
        b = min(r.times[key] for r in ok if r.side == "before")
        a = min(r.times[key] for r in ok if r.side == "after")
        rows.append((key, b, a, a / b if b > 0 else math.nan))
    return rows


def report(commands: list[Command], results: dict[str, list[Run]], rtol: float) -> tuple[str, dict]:
    """The markdown summary and per-command details, and the same as a JSON-ready dictionary."""
    lines = ["| command | before s | after s | ratio after/before (wall) | script's times: geo-mean ratio "
             "(cells, range) | values other than times |", "|---|---|---|---|---|---|"]
    details, data = [], {}
    for c in commands:
        runs = results.get(c.name, [])
        failed = [f"{r.side} {r.round} rc {r.returncode}" for r in runs if r.returncode != 0]
        wall = {s: min((r.wall for r in runs if r.side == s and r.returncode == 0), default=math.nan)
                for s in ("before", "after")}
        ratios = time_ratios(runs)
        own = [q for k, _, _, q in ratios if not k.endswith("(× ratio)") and q > 0 and math.isfinite(q)]
        differs, noisy, compared = compare_values(runs, rtol)
        hard = [d for d in differs if not d.startswith("round-off")]
        verdict = ("failed: " + ", ".join(failed)) if failed else (
            f"agree ({compared} values" + (f", {len(differs)} round-off" if differs else "")
            + (f", {len(noisy)} noisy keys skipped" if noisy else "") + ")" if not hard
            else f"**{len(hard)} differ** ({compared} values)")
        geo = (f"{math.exp(sum(map(math.log, own)) / len(own)):.2f} ({len(own)}, {min(own):.2f}–{max(own):.2f})"
               if own else "—")
        shown = " ".join(c.after)
        lines.append(f"| {c.name} (`{shown}`) | {wall['before']:.1f} | {wall['after']:.1f} | "
                     f"{wall['after'] / wall['before']:.2f} | {geo} | {verdict} |")
        details.append(f"\n### {c.name}\n\nafter: `{shlex.join(c.after)}`; before: `{shlex.join(c.before)}`; "
                       f"walls: " + ", ".join(f"{r.side} {r.wall:.1f} s" for r in runs) + "\n")
        if ratios:
            details.append("| timed cell | before s | after s | after/before |\n|---|---|---|---|")
            details += [f"| {k.replace('|', '/')} | {b:.4g} | {a:.4g} | {q:.2f} |" for k, b, a, q in ratios]
        details += [f"- {d}" for d in differs]
        if noisy:
            details.append(f"- noisy (differ between runs of one side, not compared): {len(noisy)} keys, e.g. "
                           + "; ".join(f"`{k}`" for k in noisy[:3]))
        data[c.name] = {"after": c.after, "before": c.before, "runs": [r.__dict__ for r in runs],
                        "time_ratios": ratios, "differs": differs, "noisy": noisy, "compared": compared}
    return "\n".join(lines) + "\n\n## Per command\n" + "\n".join(details), data


def main() -> None:
    here = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the root of the earlier checkout")
    parser.add_argument("--after", type=Path, default=here, help="the root of the later checkout (default: this one)")
    parser.add_argument("--commands", type=Path, help="a file of commands, 'NAME | SCRIPT ARGS [| BEFORE_ARGS]'")
    parser.add_argument("-c", dest="inline", action="append", default=[], help="one command line (repeatable)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these command names")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of before / after (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS and the like (default 1)")
    parser.add_argument("--cpu", default=None, help="taskset -c CPU for every run")
    parser.add_argument("--lock", default=None, help="flock this file around every run (one timed run at a time)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--rtol", type=float, default=1e-6, help="relative difference counted as round-off")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (default: this one)")
    parser.add_argument("--out", default="/tmp/before_after", help="folder of every run's output")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--report-only", action="store_true", help="run nothing: report the runs kept in --out")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be a positive integer, got {args.repeats}")
    roots = {"before": args.before.resolve(), "after": args.after.resolve()}
    for side, root in roots.items():
        if not (root / "ntkgp" / "__init__.py").is_file():
            parser.error(f"--{side} {root}: no ntkgp package there")
    text = args.commands.read_text().splitlines() if args.commands else []
    try:
        commands = parse_commands(text + args.inline)
    except ValueError as error:
        parser.error(str(error))
    if args.only:
        unknown = set(args.only) - {c.name for c in commands}
        if unknown:
            parser.error(f"--only: unknown command names {sorted(unknown)}")
        commands = [c for c in commands if c.name in args.only]
    if not commands:
        parser.error("no commands (--commands FILE or -c 'NAME | SCRIPT ARGS')")
    for c in commands:
        for side in ("before", "after"):
            argv = c.before if side == "before" else c.after
            if argv[0] != "-m" and not (roots[side] / argv[0]).is_file():
                parser.error(f"{c.name}: {argv[0]} is not a file under --{side} {roots[side]}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results: dict[str, list[Run]] = {}
    for c in commands:
        if args.report_only:
            results[c.name] = load_runs(c, args)
            continue
        for round_ in range(args.repeats):
            for side in ("before", "after"):
                results.setdefault(c.name, []).append(run_one(c, side, roots[side], round_, args))
    markdown, data = report(commands, results, args.rtol)
    header = (f"before: {roots['before']}, after: {roots['after']}; {args.repeats} rounds alternated, "
              f"{args.threads} thread(s)" + (f", CPU {args.cpu}" if args.cpu is not None else "")
              + f"; outputs in {args.out}\n\n")
    print(header + markdown)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    main()
