"""The verdict rule of the reproduction tables (benchmarks/reproduce/_common.py: ``compare``)."""

import importlib.util
import math
from pathlib import Path

import pytest

# Loaded under its own name: examples/ has a module called _common too, and neither may shadow the other.
_SPEC = importlib.util.spec_from_file_location(
    "reproduce_common", Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce" / "_common.py")
_common = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_common)


@pytest.mark.parametrize(
    "ours, published, runs, expected",
    [
        ((1.0, 0.1, 5), (1.5, 0.1), None, "better"),  # |Δ| = 0.5 > 2·sqrt(0.02) = 0.283
        ((1.0, 0.1, 5), (1.2, 0.1), None, "within"),  # 0.2 < 0.283
        ((1.3, 0.1, 5), (1.0, 0.1), None, "worse"),
        # one run: without the paper's run count only its SE counts, 0.25 > 2·0.1
        ((1.25, math.nan, 1), (1.0, 0.1), None, "worse"),
        # with 10 paper runs, one run spreads as SE·sqrt(10) = 0.316: bound 2·sqrt(0.1 + 0.01) = 0.663
        ((1.6, math.nan, 1), (1.0, 0.1), 10, "within"),
        ((1.7, math.nan, 1), (1.0, 0.1), 10, "worse"),
        ((0.3, math.nan, 1), (1.0, 0.1), 10, "better"),
        ((0.3, math.nan, 0), (1.0, 0.1), 10, "n/a"),
        # three runs with a tiny spread of their own: their SE is at least 0.1·sqrt(10/3) = 0.183,
        # bound 2·sqrt(0.0333 + 0.01) = 0.416
        ((0.6, 0.01, 3), (1.0, 0.1), 10, "within"),
        ((0.55, 0.01, 3), (1.0, 0.1), 10, "better"),
        # their own SE when it is larger than the floor
        ((1.6, 0.3, 3), (1.0, 0.1), 10, "within"),
        # as many runs as the paper: their own SE only (bound 2·sqrt(0.0001 + 0.01) = 0.201)
        ((1.25, 0.01, 10), (1.0, 0.1), 10, "worse"),
        ((0.3, 0.1, 3), None, 10, "n/a"),
    ],
)
def test_compare(ours, published, runs, expected):
    assert _common.compare(ours, published, runs) == expected
