"""The empirical-NTK engine: Jacobians, per-group Grams, diagonals and matrix-free products.

:class:`NTKEngine` is the front and composes the strategies over chunks (:mod:`~ntkgp.ntk.grams`: one
:mod:`~ntkgp.ntk.feature_pass` per chunk, the :mod:`~ntkgp.ntk.structured` terms and the
:mod:`~ntkgp.ntk.contraction`; the :mod:`~ntkgp.ntk.products`) over one :class:`~ntkgp.ntk.network.NetworkCore`
(the network at θ*, also used by the weight posteriors, the curvature passes and FSVI) and one layer plan
(:mod:`~ntkgp.ntk.layer_plan`, with the layer features of :mod:`~ntkgp.ntk.features`). Input validators are in
:mod:`ntkgp.ntk.checks`.
"""

from .engine import NTKEngine
from .groups import GroupSpec, ParameterGroups, PriorStructureSpec, resolve_groups
from .network import NetworkCore

__all__ = [
    "GroupSpec",
    "NTKEngine",
    "NetworkCore",
    "ParameterGroups",
    "PriorStructureSpec",
    "resolve_groups",
]
