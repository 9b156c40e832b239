"""Write the examples gallery (``docs/gallery/``) and the demo table of ``docs/cli_and_examples.md`` by running
the demo and the examples.

Each entry of :data:`ENTRIES` is run as a subprocess from the repository root with its quick settings; its
printed output and its figures (shrunk to a small palette PNG) go to ``docs/gallery/NAME.md`` and
``docs/gallery/NAME*.png``. The page is written whole by this script; its results lie in the generated region
named in the entry (see :mod:`ntkgp._doctable`), with the command, the date and the machine beside them.
``docs/gallery/index.md`` lists the pages. The ``demo`` entry runs ``ntkgp demo`` with its default settings
and also writes the ``demo-table`` region of ``docs/cli_and_examples.md``.

    python scripts/gallery.py                          # everything (tens of minutes on 2 cores)
    python scripts/gallery.py --only banana_classification sequential_updates
    python scripts/gallery.py --data-dir DATA          # the benchmark data instead of the stand-ins

Without ``--data-dir`` (or ``NTKGP_DATA_DIR``) the examples that read the benchmark data use their synthetic
or bundled stand-ins, and their pages say so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _load_doctable():
    """``ntkgp._doctable`` from its file, without importing ``ntkgp`` (torch, GPyTorch) into this process."""
    spec = importlib.util.spec_from_file_location("ntkgp_doctable", REPO / "ntkgp" / "_doctable.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_doctable = _load_doctable()
block_pattern, markdown_table, write_block = _doctable.block_pattern, _doctable.markdown_table, _doctable.write_block

GALLERY = REPO / "docs" / "gallery"
CLI_DOC = REPO / "docs" / "cli_and_examples.md"
MAX_WIDTH = 1400  # pixels; wider figures are scaled down


@dataclass(frozen=True)
class Entry:
    """One gallery page: what to run (``argv`` after the program, quick settings) and how to present it."""

    name: str
    region: str  # the generated region of the page (written literally here: tests/docs/test_generated.py)
    title: str
    purpose: str
    program: str  # "python" (an example script), "ntkgp" (the CLI) or "torchrun"
    argv: list[str]
    full_command: str
    full_note: str
    figures: list[str] = field(default_factory=list)
    uses_data: bool = False
    quick: bool = True  # False: the page shows the full run (the demo)


ENTRIES = [
    Entry(
        name="demo",
        region="gallery-demo",
        title="`ntkgp demo`: the whole pipeline on two small problems",
        purpose=(
            "Trains a tanh network with Algorithm 1 (online optimization of the Laplace-GGN evidence) on a 1-D "
            "regression with a gap and on two moons, turns it into an `NTKGP` and an `SFR` (a quarter of the "
            "points as inducing inputs), conditions both on a new batch of data without retraining "
            "(`NTKGP.condition_on`, `SFR.update`), and prints evidence, test metrics and timings. The figures "
            "show each predictive before and after the update. See [the CLI page](../cli_and_examples.md) for "
            "what each column means."),
        program="ntkgp",
        argv=["demo", "--no-progress"],
        full_command="ntkgp demo",
        full_note="the default configuration; `ntkgp demo --quick` is a seconds-long smoke test",
        figures=["gap_regression_ntkgp.png", "gap_regression_sfr.png", "two_moons_ntkgp.png", "two_moons_sfr.png"],
        quick=False,
    ),
    Entry(
        name="snelson_regression",
        region="gallery-snelson-regression",
        title="Snelson regression: architecture and prior precision by the evidence",
        purpose=(
            "Immer et al. (2021), figures 1 and 4. (1) A 1- and a 3-hidden-layer tanh network are trained with "
            "Algorithm 1 (one prior precision per layer and the noise learned online) and ranked by their "
            "evidence (`compare_models`). (2) The 3-layer network with one scalar prior precision δ: online "
            "learning of δ from three starts (1e-3, 1, 1e3) against a grid search that trains to the MAP at "
            "each fixed δ. The figure shows both predictives and the grid's evidence curve with the online "
            "trajectories."),
        program="python",
        argv=["examples/snelson_regression.py", "--quick"],
        full_command="python examples/snelson_regression.py --data-dir DATA",
        full_note="width 50, 1000 epochs, a 9-value grid, on the Snelson data",
        figures=["snelson_regression.png"],
        uses_data=True,
    ),
    Entry(
        name="banana_classification",
        region="gallery-banana-classification",
        title="Banana classification: online evidence optimization against weak regularization",
        purpose=(
            "Immer et al. (2021), figure 3. The same 2-50-50-1 tanh network is trained twice: *online*, "
            "learning one prior precision per layer from the Laplace evidence (Algorithm 1), and *baseline*, "
            "with a tiny fixed prior precision (1e-4). The table compares evidence, test accuracy, NLPD and ECE "
            "for the network's own probabilities (MAP) and the NTKGP (linearized Laplace, probit) predictive; "
            "the figure shows the probability maps."),
        program="python",
        argv=["examples/banana_classification.py", "--quick"],
        full_command="python examples/banana_classification.py --data-dir DATA",
        full_note="2000 epochs, on the 400-point banana set",
        figures=["banana_classification.png"],
        uses_data=True,
    ),
    Entry(
        name="sequential_updates",
        region="gallery-sequential-updates",
        title="Sequential updates: `SFR.update` against retraining",
        purpose=(
            "A regression training set arrives in batches. After the first, a network is trained with "
            "Algorithm 1 and summarized by SFR; each later batch is added with `SFR.update` (no retraining, the "
            "old data not read again) and compared with retraining a fresh network on all data so far, and with "
            "the first-batch model left as it was. The figure shows test NLPD and wall time per batch."),
        program="python",
        argv=["examples/sequential_updates.py", "--quick"],
        full_command="python examples/sequential_updates.py --data-dir DATA",
        full_note="UCI concrete in 5 batches, 500 epochs per training, M = 100",
        figures=["sequential_updates.png"],
        uses_data=True,
    ),
    Entry(
        name="bayesian_optimization",
        region="gallery-bayesian-optimization",
        title="Bayesian optimization with network surrogates",
        purpose=(
            "Branin and Hartmann-6 maximized with `LogExpectedImprovement` (BoTorch) on three surrogates: an "
            "`NTKGP` and an `SFR` on a small MLP, retrained every few iterations and only conditioned on each "
            "new point in between, and BoTorch's `SingleTaskGP`, refit at every iteration. Printed: the simple "
            "regret after several budgets (mean ± std over seeds) and the time per iteration; the figure shows "
            "the log regret per iteration."),
        program="python",
        argv=["examples/bayesian_optimization.py", "--quick"],
        full_command="python examples/bayesian_optimization.py",
        full_note="5 seeds and 40 iterations per problem and surrogate",
        figures=["bo_regret.png"],
    ),
    Entry(
        name="distributed_sfr",
        region="gallery-distributed-sfr",
        title="Data-parallel training and SFR over several processes",
        purpose=(
            "Algorithm 1 (KFAC evidence) and SFR with `distributed=True` over the ranks of `torch.distributed`: "
            "each rank holds a shard of a synthetic 3-class spiral data set, the gradients and the dual "
            "statistics are all-reduced, and every rank ends with the SFR model of all the data (the checksums "
            "printed by the ranks agree). Then each rank adds its shard of held-back data with `SFR.update`. "
            "See [scaling.md](../scaling.md). No figure."),
        program="torchrun",
        argv=["examples/distributed_sfr.py", "--num-train", "400", "--epochs", "60"],
        full_command="torchrun --standalone --nproc_per_node=2 examples/distributed_sfr.py",
        full_note="2000 points, 300 epochs; one GPU per rank with `--nproc_per_node=NUM_GPUS`",
    ),
    Entry(
        name="fsvi",
        region="gallery-fsvi",
        title="Function-space variational inference (FSVI) against MAP, NTKGP and SFR",
        purpose=(
            "FSVI of the whole network (`ntkgp.fsvi.train_fsvi`) compared with MAP, the Laplace GLM predictive "
            "(NTKGP) and SFR on a 1-D regression with a gap, on two moons and on scikit-learn's 8×8 digits "
            "(with out-of-distribution detection). The quick run takes a few steps of everything: it shows "
            "what the example prints and draws, not the results of [fsvi.md](../fsvi.md)."),
        program="python",
        argv=["examples/fsvi.py", "--quick"],
        full_command="python examples/fsvi.py",
        full_note="the settings of the table in [fsvi.md](../fsvi.md)",
        figures=["fsvi_gap_regression.png", "fsvi_two_moons.png"],
    ),
]
BY_NAME = {entry.name: entry for entry in ENTRIES}
INDEX_REGION = "gallery-index"
DEMO_TABLE_REGION = "demo-table"


def shown_command(entry: Entry, data_dir: str | None) -> str:
    """The command as a user types it from the repository root; the data folder, which is machine-specific,
    is written ``DATA`` (as in the footers, see ``ntkgp._doctable.PLACEHOLDERS``)."""
    data = ["--data-dir", "DATA"] if entry.uses_data and data_dir else []
    if entry.program == "python":
        return " ".join(["python", *entry.argv, *data])
    if entry.program == "ntkgp":
        return " ".join(["ntkgp", *entry.argv])
    return " ".join(["torchrun --standalone --nproc_per_node=2", *entry.argv])


def run_entry(entry: Entry, data_dir: str | None, output_dir: Path) -> tuple[str, float]:
    """Run the entry; its stdout and wall time. Exits with the entry's status when it fails."""
    data = ["--data-dir", data_dir] if entry.uses_data and data_dir else []
    if entry.program == "python":
        argv = [sys.executable, *entry.argv, *data, "--output-dir", str(output_dir)]
    elif entry.program == "ntkgp":
        argv = [sys.executable, "-m", "ntkgp", *entry.argv, "--output-dir", str(output_dir)]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *entry.argv]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if not (entry.uses_data and data_dir):
        env.pop("NTKGP_DATA_DIR", None)
    print(f"[gallery] {entry.name}: {' '.join(argv)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
        raise SystemExit(f"[gallery] {entry.name} exited with status {done.returncode}")
    notes = [line for line in done.stderr.splitlines() if line.startswith("note:")]
    output = "\n".join([*notes, done.stdout.rstrip()]) if notes else done.stdout.rstrip()
    return output.replace(str(output_dir), "OUTPUT_DIR"), seconds


def shrink_png(source: Path, target: Path) -> None:
    """Copy a figure as a palette PNG at most :data:`MAX_WIDTH` wide (a few hundred KiB at most)."""
    from PIL import Image

    with Image.open(source) as image:
        image = image.convert("RGB")
        if image.width > MAX_WIDTH:
            image = image.resize((MAX_WIDTH, round(image.height * MAX_WIDTH / image.width)), Image.LANCZOS)
        image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(target, optimize=True)


def figure_name(entry: Entry, figure: str) -> str:
    """The figure's file name in docs/gallery/ (prefixed with the page name when it is not already)."""
    return figure if figure.startswith(entry.name) else f"{entry.name}_{figure}"


def page_text(entry: Entry, data_dir: str | None) -> str:
    """The page around its (empty) generated region."""
    shown = shown_command(entry, data_dir)
    data_note = (", where `DATA` is the benchmark data folder (see [metrics_and_data.md](../metrics_and_data.md))"
                 if entry.uses_data else "")
    if entry.quick:
        run = f"""The full run ({entry.full_note}){data_note}:

```bash
# illustrative: the full run takes minutes
{entry.full_command}
```

The quick run shown below (`tests/test_examples.py` runs the examples with their quick settings):

```bash
# illustrative: the quick run; its output and figures follow
{shown}
```

## Output of the quick run
"""
    else:
        run = f"""The run shown below ({entry.full_note}):

```bash
# illustrative: its output and figures follow (the wall time of the run is the first line below)
{shown}
```

## Output
"""
    return f"""# {entry.title}

<!-- This page is written by scripts/gallery.py; do not edit it by hand: change the example or its entry in
scripts/gallery.py and rerun the script. -->

{textwrap.fill(entry.purpose, width=110, break_on_hyphens=False)}

{run}
<!-- generated: {entry.region} -->
<!-- end generated: {entry.region} -->
"""


def write_page(entry: Entry, data_dir: str | None, output: str, seconds: float, output_dir: Path,
               command: str) -> None:
    """Write ``docs/gallery/NAME.md`` and its figures."""
    images = []
    for figure in entry.figures:
        source = output_dir / figure
        if not source.is_file():
            raise SystemExit(f"[gallery] {entry.name} wrote no {figure} in {output_dir}")
        target = figure_name(entry, figure)
        shrink_png(source, GALLERY / target)
        images.append(f"![{entry.name}: {Path(figure).stem}]({target})")
    page = GALLERY / f"{entry.name}.md"
    page.write_text(page_text(entry, data_dir))
    body = [f"Wall time of the {'quick ' if entry.quick else ''}run: {seconds:.0f} s.", "", "```text", output, "```"]
    if images:
        body += ["", *[line for image in images for line in (image, "")]]
    write_block(page, entry.region, "\n".join(body), command)


def refresh_page(entry: Entry, data_dir: str | None) -> None:
    """Rewrite the page's text around its generated region, whose content (and footer) is kept."""
    page = GALLERY / f"{entry.name}.md"
    if not page.is_file():
        return
    match = block_pattern(entry.region).search(page.read_text())
    if match is None:
        return
    if data_dir is None:  # the data folder of the run shown (named in the region's footer)
        footer = re.search(r"Generated by `[^`]*--data-dir (\S+?)`", match.group(0))
        data_dir = footer.group(1) if footer else None
    region = match.group(0)
    if not entry.quick:  # pages written before the entry said which run it shows
        region = region.replace("Wall time of the quick run:", "Wall time of the run:")
    text = page_text(entry, data_dir)
    empty = f"<!-- generated: {entry.region} -->\n<!-- end generated: {entry.region} -->"
    page.write_text(text.replace(empty, region))


def wall_time(entry: Entry) -> str:
    """The wall time recorded on the entry's page, or '-' when the page has not been generated."""
    page = GALLERY / f"{entry.name}.md"
    if not page.is_file():
        return "-"
    match = block_pattern(entry.region).search(page.read_text())
    line = next((s for s in match["body"].splitlines() if s.startswith("Wall time")), "") if match else ""
    return line.split(": ", 1)[1].rstrip(".") if line else "-"


def write_index(command: str) -> None:
    """Write ``docs/gallery/index.md`` (a table of the pages and their quick-run wall times)."""
    index = GALLERY / "index.md"
    written = [entry for entry in ENTRIES if (GALLERY / f"{entry.name}.md").is_file()]  # linked pages must exist
    index.write_text(f"""# Examples gallery

<!-- This page is written by scripts/gallery.py; do not edit it by hand. -->

The demo (with its default settings) and each script of `examples/` (with quick settings), run by
`scripts/gallery.py`, which writes these pages: the purpose of each example, the commands of its full and
quick runs, its printed output and its figures. The wall times are those of the machine named on each page,
which was shared with other jobs: they vary several-fold with its load. The examples that read the benchmark
data folder (`--data-dir DATA` or `NTKGP_DATA_DIR`) fall back to a synthetic or bundled stand-in without it;
their output names the data they used. Regenerate everything with `python scripts/gallery.py` (add
`--data-dir DATA` for the benchmark data); `python scripts/gallery.py --pages-only` rewrites the text of the
pages and this index around their generated regions without running anything.

<!-- generated: {INDEX_REGION} -->
<!-- end generated: {INDEX_REGION} -->

```{{toctree}}
:hidden:

{chr(10).join(entry.name for entry in written)}
```
""")
    rows = [[f"[{entry.title}]({entry.name}.md)", "quick" if entry.quick else "default", wall_time(entry)]
            for entry in written]
    write_block(index, INDEX_REGION, markdown_table(["page", "settings shown", "wall time"], rows), command)


def write_demo_table(output: str, command: str) -> None:
    """The ``demo-table`` region of docs/cli_and_examples.md: the demo's printed table."""
    write_block(CLI_DOC, DEMO_TABLE_REGION, "\n".join(["```text", output, "```"]), command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(BY_NAME), metavar="NAME",
                        help=f"pages to regenerate (default: all of {', '.join(BY_NAME)})")
    parser.add_argument("--data-dir", default=os.environ.get("NTKGP_DATA_DIR") or None,
                        help="the benchmark data folder for the examples that read it (default: $NTKGP_DATA_DIR; "
                        "without it, their stand-ins)")
    parser.add_argument("--pages-only", action="store_true",
                        help="rewrite the text of the pages (or of --only's) and the index around their generated "
                        "regions, which are kept as they are (runs nothing)")
    args = parser.parse_args(argv)
    if args.pages_only:
        for entry in [BY_NAME[name] for name in args.only] if args.only else ENTRIES:
            refresh_page(entry, args.data_dir)
        write_index("python scripts/gallery.py --pages-only")
        return 0
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        parser.error(f"--data-dir {args.data_dir!r} is not a folder")
    entries = [BY_NAME[name] for name in args.only] if args.only else ENTRIES
    GALLERY.mkdir(parents=True, exist_ok=True)
    data_option = " --data-dir DATA" if args.data_dir else ""  # the folder is machine-specific: shown as DATA
    for entry in entries:
        command = f"python scripts/gallery.py --only {entry.name}{data_option if entry.uses_data else ''}"
        with tempfile.TemporaryDirectory() as folder:
            output_dir = Path(folder) / entry.name
            output, seconds = run_entry(entry, args.data_dir, output_dir)
            write_page(entry, args.data_dir, output, seconds, output_dir, command)
        if entry.name == "demo":
            write_demo_table(output, command)
        print(f"[gallery] {entry.name}: {seconds:.0f} s, docs/gallery/{entry.name}.md written", file=sys.stderr)
    write_index("python scripts/gallery.py" + data_option)
    return 0


if __name__ == "__main__":
    sys.exit(main())
