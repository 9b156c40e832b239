"""``ntkgp demo`` end to end on the tiny ``--quick`` configuration, the CSV path and its error messages."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ntkgp import plotting
from ntkgp.cli import format_table, main, resolve_data_dir

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
    assert len(rows) == 10
    assert {row[0] for row in rows} == {"gap_regression", "two_moons"}
    for model in ("network (MAP)", "NTKGP + new batch", "SFR (M=8)", "SFR + new batch"):
        assert sum(model in line for line in out.splitlines()) == 2
    assert_finite_numbers(rows)
    for name in ("gap_regression_ntkgp", "gap_regression_sfr", "two_moons_ntkgp", "two_moons_sfr"):
        path = tmp_path / f"{name}.png"
        assert path.stat().st_size > 10_000
        assert str(path) in out


def test_python_m_ntkgp_demo(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ntkgp", *QUICK, "--epochs", "10", "--output-dir", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=120)
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
    rmse = float(rows[1][4])  # NTKGP row: task, model, N, evidence, NLPD, RMSE
    assert rmse > 1.0  # reported in the original units (the target's std is about 20), not standardised ones
    assert sorted(p.name for p in out_dir.glob("*.png")) == ["my_data_ntkgp.png", "my_data_sfr.png"]


def test_csv_classification_three_classes_two_inputs(csv_files, tmp_path, capsys):
    args = [*QUICK, "--csv", str(csv_files["classification"]), "--input-columns", "x1", "x2",
            "--target-column", "species", "--task", "classification", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 5
    assert_finite_numbers(rows)
    accuracy = float(rows[1][-5])  # NTKGP row: ..., accuracy, ECE, build s, predict s, update s
    assert 0.0 <= accuracy <= 1.0
    assert (tmp_path / "flowers_ntkgp.png").is_file() and (tmp_path / "flowers_sfr.png").is_file()


def test_csv_regression_many_inputs_makes_fallback_figure(csv_files, tmp_path):
    args = [*QUICK, "--csv", str(csv_files["regression"]), "--input-columns", "a", "b", "--target-column", "target",
            "--output-dir", str(tmp_path)]
    assert main(args) == 0
    assert (tmp_path / "my_data_sfr.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--csv", "{missing}", "--input-columns", "a", "--target-column", "target"], "not found"),
        (["--csv", "{regression}", "--input-columns", "a", "nope", "--target-column", "target"], "'nope' not in the header"),
        (["--csv", "{regression}", "--input-columns", "a"], "--csv needs --input-columns and --target-column"),
        (["--input-columns", "a", "--target-column", "target"], "need --csv"),
        (["--epochs", "0"], "--epochs must be positive"),
    ],
)
def test_demo_user_errors(csv_files, tmp_path, capsys, extra, message):
    paths = {"missing": str(tmp_path / "absent.csv"), "regression": str(csv_files["regression"])}
    with pytest.raises(SystemExit) as exit_info:
        main([*QUICK, "--output-dir", str(tmp_path), *[arg.format(**paths) for arg in extra]])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'ntkgp\[examples\]'"):
        plotting.new_figure(1, 1)


def test_format_table_and_data_dir(tmp_path):
    table = format_table(["name", "value", "other"], [["a", 1.23456, None], ["long name", 2.0, 3]])
    assert table.splitlines() == [
        "name       value  other",
        "---------  -----  -----",
        "a          1.235      -",
        "long name  2.000      3",
    ]
    assert resolve_data_dir(tmp_path) == tmp_path.resolve()
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        resolve_data_dir(tmp_path / "missing")
