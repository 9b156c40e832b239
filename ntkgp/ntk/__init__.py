"""The empirical-NTK engine: Jacobians, per-group Grams, diagonals and matrix-free products."""

from .checks import check_eval_mode, check_inputs, check_outputs
from .engine import STRATEGIES, NTKEngine
from .groups import GroupSpec, ParameterGroups, resolve_groups

__all__ = [
    "STRATEGIES",
    "GroupSpec",
    "NTKEngine",
    "ParameterGroups",
    "check_eval_mode",
    "check_inputs",
    "check_outputs",
    "resolve_groups",
]
