r"""Scalable Laplace-GGN curvature structures and their log marginal likelihood, for large :math:`P` and :math:`N`.

:func:`compute_curvature` makes one pass over the data and returns a :class:`Curvature` whose
:meth:`~Curvature.log_det` and :meth:`~Curvature.log_marginal_likelihood` are cheap to re-evaluate for new prior
precisions, noise or temperature: ``"diag_ggn"`` (:class:`DiagonalGGN`), ``"diag_ef"`` (:class:`DiagonalEF`)
and ``"kfac"`` (:class:`KroneckerGGN`, no damping). The structure names are the members of
:class:`ntkgp.options.Structure`.
"""

import warnings

from .base import Curvature
from .compute import _STRUCTURES, compute_curvature
from .diagonal import DiagonalCurvature, DiagonalEF, DiagonalGGN, diagonal_ef, diagonal_ggn
from .kfac import KroneckerFactor, KroneckerFactors, KroneckerGGN, kfac_ggn
from .scaling import output_scale

__all__ = [
    "Curvature",
    "DiagonalCurvature",
    "DiagonalEF",
    "DiagonalGGN",
    "KroneckerFactor",
    "KroneckerFactors",
    "KroneckerGGN",
    "compute_curvature",
    "diagonal_ef",
    "diagonal_ggn",
    "kfac_ggn",
    "output_scale",
]


def __getattr__(name: str):
    if name == "STRUCTURES":  # removed from the public API: one release of deprecated access
        warnings.warn(
            "ntkgp.curvature.STRUCTURES is deprecated; the structure names are ntkgp.options.Structure",
            DeprecationWarning,
            stacklevel=2,
        )
        return {s.value: fn for s, fn in _STRUCTURES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
