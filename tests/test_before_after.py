"""``scripts/before_after.py`` (the before / after benchmark driver): its command list and how it reads a printed
output into times and values, on outputs written by hand here (no benchmark is run)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "before_after.py"
_spec = importlib.util.spec_from_file_location("before_after", SCRIPT)
before_after = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("before_after", before_after)  # dataclasses look their module up
_spec.loader.exec_module(before_after)


def test_commands_same_or_own_arguments_and_write_docs_refused():
    commands = before_after.parse_commands(["# a comment", "", "a | benchmarks/x.py --n 3",
                                            "b | -m benchmarks.y --new 1 | -m benchmarks.y --old 1"])
    assert [(c.name, c.after, c.before) for c in commands] == [
        ("a", ["benchmarks/x.py", "--n", "3"], ["benchmarks/x.py", "--n", "3"]),
        ("b", ["-m", "benchmarks.y", "--new", "1"], ["-m", "benchmarks.y", "--old", "1"])]
    with pytest.raises(ValueError, match="--write-docs"):
        before_after.parse_commands(["a | benchmarks/x.py --write-docs"])
    with pytest.raises(ValueError, match="names repeat"):
        before_after.parse_commands(["a | x.py", "a | y.py"])


def test_times_and_values_are_told_apart():
    text = ("| case | N | fit s | NLL | speed-up |\n|---|---|---|---|---|\n"
            "| mlp | 1,000 | 2.5 | 0.4026 | 3.1× |\n| cnn | 200 | 31 ms | -1.5e-03 | 0.5× |\n"
            "Ran 12 s in all on 2026-12-06 15:01 UTC (load average 2.9); accuracy 0.853.\n")
    times, values = before_after.read_output(text)
    # times in seconds: the "fit s" column, "31 ms", "12 s" on the line; the × ratios kept apart
    assert sorted(v for k, v in times.items() if not k.endswith("(× ratio)")) == [0.031, 2.5, 12.0]
    assert sorted(v for k, v in times.items() if k.endswith("(× ratio)")) == [0.5, 3.1]
    # values: N and NLL per row, the accuracy on the line; the date and the load average are neither
    assert sorted(sum(values.values(), [])) == sorted(["1,000", "0.4026", "200", "-1.5e-03", "0.853"])


def test_fixed_width_table():
    text = ("N, M, C         setting             build s     predict s\n" + "-" * 60 + "\n"
            "10000, 512, 1   comparable (1 δ)    0.41        0.10\n")
    times, values = before_after.read_output(text)
    assert sorted(times.values()) == [0.10, 0.41]
    assert sorted(sum(values.values(), [])) == sorted(["10000", "512", "1", "1"])
