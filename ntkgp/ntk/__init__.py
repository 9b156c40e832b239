"""The empirical-NTK engine: Jacobians, per-group Grams, diagonals and matrix-free products.

:class:`NTKEngine` is the front; :mod:`~ntkgp.ntk.features` holds the layer features (Linear, Conv2d) and
:mod:`~ntkgp.ntk.functional` the functional passes shared with :mod:`ntkgp.laplace.weight_space`.
"""

from .checks import check_eval_mode, check_inputs, check_outputs
from .engine import STRATEGIES, NTKEngine
from .groups import GroupSpec, ParameterGroups, PriorStructureSpec, resolve_groups

__all__ = [
    "STRATEGIES",
    "GroupSpec",
    "NTKEngine",
    "ParameterGroups",
    "PriorStructureSpec",
    "check_eval_mode",
    "check_inputs",
    "check_outputs",
    "resolve_groups",
]
