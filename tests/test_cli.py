"""``ntkgp demo`` end to end on the tiny ``--quick`` configuration, the CSV path, its error messages and exit
codes, and the example scripts' command lines."""

from __future__ import annotations

import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ntkgp.demo.run
from ntkgp import plotting
from ntkgp.cli import main
from ntkgp.datasets import DATA_DIR_VARIABLE
from ntkgp.demo import format_table

pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")

QUICK = ["demo", "--quick", "--no-progress"]


def table_rows(out: str) -> list[list[str]]:
    """The data rows of the printed table, split into cells (the model names contain spaces)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("task")) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def assert_finite_numbers(rows: list[list[str]]) -> None:
    for row in rows:
        for cell in row:
            if cell.replace(".", "", 1).replace("-", "", 1).isdigit():
                assert math.isfinite(float(cell))
            assert cell.lower() not in ("nan", "inf", "-inf")


def test_demo_quick(tmp_path, capsys):
    assert main([*QUICK, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert {row[0] for row in rows} == {"gap_regression", "two_moons"}
    for model in ("network (MAP)", "NTKGP + new batch", "SFR (M=8)", "SFR + new batch"):
        assert sum(model in line for line in out.splitlines()) == 2
    # 5 rows per task, and the NTKGP with δ refit where it is less calibrated than the network (classification)
    moons = {" ".join(row[1:-10]): row for row in rows if row[0] == "two_moons"}
    less_calibrated = float(moons["NTKGP"][-5]) > float(moons["network (MAP)"][-5])
    assert len(rows) == 10 + less_calibrated and ("NTKGP, δ refit" in moons) == less_calibrated
    assert ("is above the network's" in out) == less_calibrated
    assert_finite_numbers(rows)
    header = out.splitlines()[0].split()
    assert header[-8:] == ["train", "s", "build", "s", "predict", "s", "update", "s"]
    for row in rows:  # the network has a training time and no build time; the built models the reverse
        name, train, build = " ".join(row[1:-10]), row[-4], row[-3]
        assert (train != "-") == (name == "network (MAP)")
        assert (build != "-") == (name != "network (MAP)" and not name.endswith("+ new batch"))
    for name in ("gap_regression_ntkgp", "gap_regression_sfr", "two_moons_ntkgp", "two_moons_sfr"):
        path = tmp_path / f"{name}.png"
        assert path.stat().st_size > 10_000
        assert str(path) in out


def test_python_m_ntkgp_reaches_the_cli_and_its_exit_codes(tmp_path):
    """``python -m ntkgp`` is the ``ntkgp`` command: a usage error exits 2 with argparse's message (no
    training; the full run through ``python -m`` is the slow test below)."""
    done = subprocess.run([sys.executable, "-m", "ntkgp", *QUICK, "--epochs", "0", "--output-dir", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "usage: ntkgp demo" in done.stderr and "--epochs must be positive" in done.stderr
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.slow
def test_python_m_ntkgp_demo(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ntkgp", *QUICK, "--epochs", "10", "--output-dir", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "evidence/N" in done.stdout and "two_moons" in done.stdout
    assert len(list(tmp_path.glob("*.png"))) == 4


@pytest.fixture
def csv_files(tmp_path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, size=(60, 2))
    regression = tmp_path / "my data.csv"
    lines = ["a,b,target"] + [f"{a:.4f},{b:.4f},{100 + 30 * np.sin(a) + b + rng.normal():.4f}" for a, b in x]
    regression.write_text("\n".join(lines) + "\n")
    classes = np.array(["setosa", "versicolor", "virginica"])[(x[:, 0] > -0.7).astype(int) + (x[:, 0] > 0.7)]
    classification = tmp_path / "flowers.csv"
    lines = ["x1,x2,species"] + [f"{a:.4f},{b:.4f},{c}" for (a, b), c in zip(x, classes)]
    classification.write_text("\n".join(lines) + "\n")
    return {"regression": regression, "classification": classification}


def test_csv_regression_one_input(csv_files, tmp_path, capsys):
    out_dir = tmp_path / "out"
    args = [*QUICK, "--csv", str(csv_files["regression"]), "--input-columns", "a", "--target-column", "target",
            "--output-dir", str(out_dir)]
    assert main(args) == 0
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 5 and all(row[0] == "my_data" for row in rows)
    assert_finite_numbers(rows)
    rmse = float(rows[1][5])  # NTKGP row: task, model, N, evidence, NLPD, RMSE
    assert rmse > 1.0  # reported in the original units (the target's std is about 20), not standardised ones
    assert sorted(p.name for p in out_dir.glob("*.png")) == ["my_data_ntkgp.png", "my_data_sfr.png"]


def test_csv_classification_three_classes_two_inputs(csv_files, tmp_path, capsys):
    args = [*QUICK, "--csv", str(csv_files["classification"]), "--input-columns", "x1", "x2",
            "--target-column", "species", "--task", "classification", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    rows = table_rows(capsys.readouterr().out)
    assert_finite_numbers(rows)
    accuracy = float(rows[1][-6])  # NTKGP row: ..., accuracy, ECE, train s, build s, predict s, update s
    assert 0.0 <= accuracy <= 1.0
    # the NTKGP with δ refit by the evidence appears exactly when NTKGP is less calibrated than the network
    less_calibrated = float(rows[1][-5]) > float(rows[0][-5])
    assert len(rows) == 5 + less_calibrated
    assert ("NTKGP, δ refit" in " ".join(" ".join(row) for row in rows)) == less_calibrated
    assert (tmp_path / "flowers_ntkgp.png").is_file() and (tmp_path / "flowers_sfr.png").is_file()


def test_csv_regression_many_inputs_makes_fallback_figure(csv_files, tmp_path):
    args = [*QUICK, "--csv", str(csv_files["regression"]), "--input-columns", "a", "b", "--target-column", "target",
            "--output-dir", str(tmp_path)]
    assert main(args) == 0
    assert (tmp_path / "my_data_sfr.png").stat().st_size > 10_000


@pytest.fixture
def no_training(monkeypatch):
    """Make any training fail loudly: input errors must be reported before the demo trains anything."""
    def fail(*args, **kwargs):
        raise AssertionError("training started before the inputs were checked")

    monkeypatch.setattr(ntkgp.demo.run, "train_marglik", fail)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def rows_text(cells: str, n: int = 12) -> str:
    """A header ``a,b,target`` and ``n`` good rows, with row 3 (file line 4) replaced by ``cells``."""
    lines = ["a,b,target"] + [f"{i},{2 * i},{i % 3}" for i in range(n)]
    lines[3] = cells
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--csv", "{missing}", "--input-columns", "a", "--target-column", "target"], "not found"),
        (["--csv", "{regression}", "--input-columns", "a", "nope", "--target-column", "target"], "'nope' not in the header"),
        (["--csv", "{regression}", "--input-columns", "a"], "--csv needs --input-columns and --target-column"),
        (["--input-columns", "a", "--target-column", "target"], "need --csv"),
        (["--epochs", "0"], "--epochs must be positive"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--csv", "{inf}", "--input-columns", "a", "b", "--target-column", "target"],
         "inf.csv, line 4, column 'b': 'inf' is not a finite number"),
        (["--csv", "{nan}", "--input-columns", "a", "b", "--target-column", "target"],
         "nan.csv, line 4, column 'a': missing value"),
        (["--csv", "{text}", "--input-columns", "a", "b", "--target-column", "target"],
         "text.csv, line 4, column 'target': cannot read 'x7' as a number"),
        (["--csv", "{inf_target}", "--input-columns", "a", "b", "--target-column", "target"],
         "inf_target.csv, line 4, column 'target': '-inf' is not a finite number"),
        (["--csv", "{infinity}", "--input-columns", "a", "b", "--target-column", "target"],
         "infinity.csv, line 4, column 'a': 'Infinity' is not a finite number"),
        (["--csv", "{overflow}", "--input-columns", "a", "b", "--target-column", "target"],
         "overflow.csv, line 4, column 'b': '1e999' is not a finite number"),
        (["--csv", "{huge}", "--input-columns", "a", "b", "--target-column", "target"],
         "column 'target' of {huge}: its values are too large to standardize"),
        (["--csv", "{inf}", "--input-columns", "a", "b", "--target-column", "target", "--task", "classification"],
         "inf.csv, line 4, column 'b': 'inf' is not a finite number"),
        (["--csv", "{duplicate}", "--input-columns", "a", "--target-column", "target"],
         "header name 'a' appears twice"),
        (["--csv", "{short}", "--input-columns", "a", "--target-column", "target"], "has 3 data rows"),
        (["--csv", "{latin1}", "--input-columns", "a", "--target-column", "target"], "is not UTF-8 text"),
        (["--output-dir", "{file}"], "exists and is not a folder"),
        (["--output-dir", "{file}/sub"], "--output-dir '{file}/sub' cannot be created or written to: Not a directory"),
        (["--csv", "{regression}", "--input-columns", "a", "--target-column", "target", "--output-dir", "{file}/sub"],
         "--output-dir '{file}/sub' cannot be created or written to"),
        (["--seed", "18446744073709551616"], "--seed must be >= 0 and <= 4294967294, got 18446744073709551616"),
        (["--seed", "4294967295"], "--seed must be >= 0 and <= 4294967294"),
        (["--csv", "{regression}", "--input-columns", "a", "--target-column", "target", "--seed", str(2**64)],
         "--seed must be >= 0 and <= 4294967294"),
    ],
)
def test_demo_user_errors_exit_2_before_training(csv_files, tmp_path, capsys, no_training, extra, message):
    (tmp_path / "latin1.csv").write_bytes("a,target\n\xe9,1\n".encode("latin-1"))
    paths = {"missing": str(tmp_path / "absent.csv"), "regression": str(csv_files["regression"]),
             "inf": write(tmp_path / "inf.csv", rows_text("3,inf,0")),
             "nan": write(tmp_path / "nan.csv", rows_text("NaN,6,0")),
             "text": write(tmp_path / "text.csv", rows_text("3,6,x7")),
             "inf_target": write(tmp_path / "inf_target.csv", rows_text("3,6,-inf")),
             "infinity": write(tmp_path / "infinity.csv", rows_text("Infinity,6,0")),
             "overflow": write(tmp_path / "overflow.csv", rows_text("3, 1e999 ,0")),
             "huge": write(tmp_path / "huge.csv", "a,b,target\n" + "".join(f"{i},{i},{i % 2}e308\n" for i in range(12))),
             "duplicate": write(tmp_path / "duplicate.csv", "a,a,target\n" + rows_text("3,6,0").split("\n", 1)[1]),
             "short": write(tmp_path / "short.csv", "a,target\n1,2\n3,4\n5,6\n"),
             "latin1": str(tmp_path / "latin1.csv"),
             "file": write(tmp_path / "a_file", "")}
    output = [] if "--output-dir" in extra else ["--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main([*QUICK, *output, *[arg.format(**paths) for arg in extra]])
    assert exit_info.value.code == 2
    assert message.format(**paths) in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.png"))


def test_output_dir_is_created_before_training(csv_files, tmp_path, no_training):
    """The folder (and its parents) exists, and was checked to be writable, when training starts."""
    out_dir = tmp_path / "new" / "figures"
    args = [*QUICK, "--csv", str(csv_files["regression"]), "--input-columns", "a", "--target-column", "target",
            "--output-dir", str(out_dir), "--seed", "4294967294"]
    with pytest.raises(AssertionError, match="training started"):
        main(args)
    assert out_dir.is_dir() and not list(out_dir.iterdir())


def test_output_dir_error_is_one_line_with_exit_status_2(tmp_path):
    """Through the console entry point: status 2, argparse's usage and one error line, no traceback."""
    (tmp_path / "afile").write_text("")
    done = subprocess.run([sys.executable, "-m", "ntkgp", *QUICK, "--output-dir", str(tmp_path / "afile" / "sub")],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == [f"ntkgp demo: error: --output-dir {str(tmp_path / 'afile' / 'sub')!r} cannot be created or "
                      "written to: Not a directory"]


def test_csv_with_byte_order_mark_and_task_name(tmp_path, capsys):
    """A UTF-8 BOM (as written by spreadsheet programs) is not part of the first column's name."""
    path = tmp_path / "bom.csv"
    path.write_bytes(("\ufeff" + rows_text("3,6,0", n=20)).encode())
    args = [*QUICK, "--epochs", "5", "--csv", str(path), "--input-columns", "a", "--target-column", "target",
            "--output-dir", str(tmp_path / "out")]
    assert main(args) == 0
    assert len(table_rows(capsys.readouterr().out)) == 5


def test_cli_and_demo_are_separate_modules():
    """ntkgp.cli parses arguments only; the demo's tasks, training and report live in ntkgp.demo."""
    import ntkgp.cli

    assert set(ntkgp.cli.__all__) == {"build_parser", "main"}
    assert not hasattr(ntkgp.cli, "run_task") and not hasattr(ntkgp.cli, "mlp")


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_example_runs_from_the_repository_root_and_reports_a_missing_data_folder(tmp_path):
    """``python examples/NAME.py`` finds its helpers (examples/_common.py); with a data folder that does not
    exist it names --data-dir and the environment variable and exits with status 1 (with no folder given at
    all it runs on a stand-in: tests/test_examples.py)."""
    env = {k: v for k, v in os.environ.items() if k != DATA_DIR_VARIABLE}
    done = subprocess.run([sys.executable, "examples/snelson_regression.py", "--data-dir", str(tmp_path / "absent"),
                           "--output-dir", str(tmp_path)],
                          cwd=EXAMPLES.parent, env=env, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "--data-dir" in done.stderr and DATA_DIR_VARIABLE in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["snelson_regression", "banana_classification", "sequential_updates"])
def test_examples_name_the_missing_data_folder(name, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(DATA_DIR_VARIABLE, raising=False)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(sys, "argv", [name, "--data-dir", str(tmp_path / "absent"), "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    assert exit_info.value.code == 1
    assert f"data folder {str(tmp_path / 'absent')!r} not found" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'ntkgp\[examples\]'"):
        plotting.new_figure(1, 1)


def test_format_table():
    table = format_table(["name", "value", "other"], [["a", 1.23456, None], ["long name", 2.0, 3]])
    assert table.splitlines() == [
        "name       value  other",
        "---------  -----  -----",
        "a          1.235      -",
        "long name  2.000      3",
    ]
    with pytest.raises(ValueError, match=r"rows\[0\] has 2 cells but there are 3 headers"):
        format_table(["a", "b", "c"], [[1, 2]])


def test_public_api_names_resolve_and_old_names_are_gone():
    """``ntkgp.__all__`` lists what users need, every name resolves; the pre-0.1 names are gone."""
    import ntkgp

    for name in ntkgp.__all__:
        assert getattr(ntkgp, name) is not None, name
    assert {"NTKGP", "SFR", "NTKKernel", "LaplaceGGNMarginalLogLikelihood", "SparseLaplaceMarginalLogLikelihood",
            "LinearizedNetworkMean", "likelihoods", "training", "laplace", "options", "metrics",
            "datasets"} <= set(ntkgp.__all__)
    for old in ("LinearisedNetworkMean", "SparseLaplaceEvidence", "curvature", "posteriors", "predictive"):
        assert not hasattr(ntkgp, old), old


DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli_and_examples.md"


def documented_demo_table() -> list[list[str]]:
    """The rows of the table under "Measured output" in docs/cli_and_examples.md."""
    text = DOCS.read_text()
    block = text.split("### Measured output", 1)[1].split("```", 2)[1]
    return table_rows(block.strip("\n"))


@pytest.mark.slow
def test_documented_demo_table_matches_a_run(tmp_path, capsys):
    """The demo table in the docs (written by ``scripts/gallery.py --only demo``) is the output of
    ``ntkgp demo --no-progress``: every column but the timings agrees with a fresh run (to the 3 printed
    decimals, ±0.002 for rounding across platforms), and the claims of the paragraph under it hold."""
    import warnings

    from ntkgp.linalg import JitterWarning, NumericalWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["demo", "--no-progress", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    ran, documented = table_rows(out), documented_demo_table()
    # "The run emits no JitterWarning and no NumericalWarning"
    assert not [w for w in caught if issubclass(w.category, (JitterWarning, NumericalWarning))]
    # cells: task, model words..., N, evidence, NLPD, RMSE, accuracy, ECE, train, build, predict, update
    named = {(row[0], " ".join(row[1:-10])): row for row in ran}
    nlpd = {key: float(row[-8]) for key, row in named.items()}
    rmse = {key: float(row[-7]) for key, row in named.items() if row[-7] != "-"}
    accuracy = {key: float(row[-6]) for key, row in named.items() if row[-6] != "-"}
    evidence = {key: float(row[-9]) for key, row in named.items() if row[-9] != "-"}
    gap, moons = "gap_regression", "two_moons"
    sfr = {task: next(name for t, name in named if t == task and name.startswith("SFR (")) for task in (gap, moons)}
    train_s = float(named[gap, "network (MAP)"][-4])
    # regression: the GP predictives beat the network's own on the test set
    assert max(nlpd[gap, "NTKGP"], nlpd[gap, sfr[gap]]) < nlpd[gap, "network (MAP)"]
    # conditioning on the gap batch lowers test NLPD and RMSE of both models, in < 1/10 of the training time
    for before, after in (("NTKGP", "NTKGP + new batch"), (sfr[gap], "SFR + new batch")):
        assert nlpd[gap, after] < nlpd[gap, before] and rmse[gap, after] < rmse[gap, before]
        assert float(named[gap, after][-1]) < 0.1 * train_s
    # SFR with a quarter of the points as inducing inputs matches NTKGP's test NLPD to within 0.05
    assert abs(nlpd[gap, sfr[gap]] - nlpd[gap, "NTKGP"]) < 0.05
    # NTKGP's evidence falls after the update (and the table says why)
    assert evidence[gap, "NTKGP + new batch"] < evidence[gap, "NTKGP"] and "[gap_regression] NTKGP's evidence" in out
    # two moons: NTKGP beats the network that never saw the tip, and its update improves NLPD and accuracy
    assert nlpd[moons, "NTKGP"] < nlpd[moons, "network (MAP)"]
    assert nlpd[moons, "NTKGP + new batch"] < nlpd[moons, "NTKGP"]
    assert accuracy[moons, "NTKGP + new batch"] > accuracy[moons, "NTKGP"] >= accuracy[moons, "network (MAP)"]
    # SFR's update, which iterates only the new sites, does worse than NTKGP's, and the table says why
    assert nlpd[moons, "SFR + new batch"] > nlpd[moons, "NTKGP + new batch"]
    assert ("[two_moons] SFR's test NLPD rises" in out) == (nlpd[moons, "SFR + new batch"] > nlpd[moons, sfr[moons]])
    # "When NTKGP's ECE is above the network's (not in the run above)": no refit row
    ece = {key: float(row[-5]) for key, row in named.items() if row[-5] != "-"}
    assert ece[moons, "NTKGP"] <= ece[moons, "network (MAP)"] and (moons, "NTKGP, δ refit") not in named
    assert len(ran) == len(documented)
    for got, want in zip(ran, documented):
        got_cells, want_cells = got[-10:-4], want[-10:-4]
        assert got[: len(got) - 10] == want[: len(want) - 10]
        for a, b in zip(got_cells, want_cells):
            if b == "-":
                assert a == "-"
            else:
                assert float(a) == pytest.approx(float(b), abs=2e-3), (got, want)
