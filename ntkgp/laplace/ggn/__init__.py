r"""The generalized Gauss–Newton (and empirical Fisher) that both spaces share: what function-space and
weight-space Laplace are built on, below both.

* :mod:`~ntkgp.laplace.ggn.scaling` — the likelihood's unit factors (:math:`\Lambda_n = s\,\tilde\Lambda_n`,
  :math:`g_n = s\,\tilde g_n`), its output scale and the data-fit statistics of the evidence;
* :mod:`~ntkgp.laplace.ggn.data_pass`, :mod:`~ntkgp.laplace.ggn.sampled_ggn` — the one pass over the data (tensors
  or batches) that every structure reads, with the sampled (Monte Carlo) GGN;
* :mod:`~ntkgp.laplace.ggn.curvature` — :class:`Curvature`, the base class of every curvature structure: its
  log-determinant and evidence for new prior precisions, noise or temperature;
* the exact full GGN / EF in either space: :class:`FullCurvature` (weight space, ``P × P``,
  :mod:`~ntkgp.laplace.ggn.full_curvature`; by layer blocks, :mod:`~ntkgp.laplace.ggn.layer_ggn`) and
  :class:`FunctionSpaceCurvature` (the Grams of the unit rows, ``R × R``, :mod:`~ntkgp.laplace.ggn.gram_curvature`),
  with :func:`exact_curvature` building the cheaper one, and their log-determinants
  (:mod:`~ntkgp.laplace.ggn.exact_log_det`, :mod:`~ntkgp.laplace.ggn.low_rank_groups`).

:mod:`ntkgp.laplace.function_space` and :mod:`ntkgp.laplace.weight_space` import from here, never from each other;
the names are documented where users import them (:mod:`ntkgp.laplace.weight_space`).
"""

from .curvature import Curvature
from .full_curvature import FullCurvature, exact_curvature, full_curvature, full_ef, full_ggn
from .gram_curvature import FunctionSpaceCurvature, function_space_curvature
from .scaling import output_scale

__all__ = [
    "Curvature",
    "FullCurvature",
    "FunctionSpaceCurvature",
    "exact_curvature",
    "full_curvature",
    "full_ef",
    "full_ggn",
    "function_space_curvature",
    "output_scale",
]
