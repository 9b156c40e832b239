"""The cases of ``benchmarks/audit.py``, one module per area (each registers its cases when imported)."""

from __future__ import annotations

import importlib

AREAS = ("ntkgp", "sfr", "fsvi", "marglik", "posteriors", "numerics", "likelihoods", "cli", "data", "networks",
         "threads")
MODULES = {"ntkgp": "ntkgp_model", "data": "data", "networks": "round_four_networks",
           "threads": "round_four_networks"}
#: the third round's cases, in several areas (their module is imported with any of them)
ROUND_THREE = ("ntkgp", "sfr", "fsvi", "marglik", "posteriors", "numerics")
#: the fourth round's (issue 38) cases of the older areas, in round_four (networks and threads have their own module)
ROUND_FOUR = ("ntkgp", "sfr", "fsvi", "marglik", "posteriors", "numerics")


def load(areas) -> None:
    """Import the case modules of ``areas``."""
    for area in areas:
        importlib.import_module(f"{__name__}.{MODULES.get(area, area)}")
    if any(area in ROUND_THREE for area in areas):
        importlib.import_module(f"{__name__}.round_three")
    if any(area in ROUND_FOUR for area in areas):
        importlib.import_module(f"{__name__}.round_four")
