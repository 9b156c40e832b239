r"""Scalable Laplace-GGN curvature structures and their evidence, for large :math:`P` and :math:`N`.

:func:`compute_curvature` makes one pass over the data and returns a :class:`Curvature` whose
:meth:`~Curvature.log_det` and :meth:`~Curvature.log_evidence` are cheap to re-evaluate for new prior
precisions, noise or temperature: ``"diag_ggn"`` (:class:`DiagonalGGN`), ``"diag_ef"`` (:class:`DiagonalEF`)
and ``"kfac"`` (:class:`KroneckerGGN`, no damping).
"""

from .base import Curvature
from .compute import STRUCTURES, compute_curvature
from .diagonal import DiagonalCurvature, DiagonalEF, DiagonalGGN, diagonal_ef, diagonal_ggn
from .kfac import KroneckerFactors, KroneckerGGN, kfac_ggn
from .scaling import output_scale

__all__ = [
    "STRUCTURES",
    "Curvature",
    "DiagonalCurvature",
    "DiagonalEF",
    "DiagonalGGN",
    "KroneckerFactors",
    "KroneckerGGN",
    "compute_curvature",
    "diagonal_ef",
    "diagonal_ggn",
    "kfac_ggn",
    "output_scale",
]
