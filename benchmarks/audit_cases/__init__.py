"""The cases of ``benchmarks/audit.py``, one module per area (each registers its cases when imported)."""

from __future__ import annotations

import importlib

AREAS = ("ntkgp", "sfr", "fsvi", "marglik", "posteriors", "numerics", "likelihoods", "cli", "data")
MODULES = {"ntkgp": "ntkgp_model", "data": "data"}
#: the third round's cases, in several areas (their module is imported with any of them)
ROUND_THREE = ("ntkgp", "sfr", "fsvi", "marglik", "posteriors", "numerics")


def load(areas) -> None:
    """Import the case modules of ``areas``."""
    for area in areas:
        importlib.import_module(f"{__name__}.{MODULES.get(area, area)}")
    if any(area in ROUND_THREE for area in areas):
        importlib.import_module(f"{__name__}.round_three")
