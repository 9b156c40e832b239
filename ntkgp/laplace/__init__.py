r"""Laplace approximations of a trained network, organized by the space they work in.

The Laplace-GGN posterior :math:`N(\theta^*, (H + P_0)^{-1})`, :math:`H = \sum_n J_n^\top \Lambda_n J_n`, and its
log marginal likelihood have two exact representations (``docs/math.md``):

* :mod:`ntkgp.laplace.function_space` — through the NTK :math:`K = J P_0^{-1} J^\top` (``N·C × N·C``): the evidence
  (:func:`laplace_log_marginal_likelihood`, dense Cholesky, one-δ eigen or matrix-free routes), the site posterior
  and the GLM predictive covariance. This is what :class:`~ntkgp.NTKGP`, the MLL and
  :func:`~ntkgp.training.train_marglik` use when ``N·C < P``.
* :mod:`ntkgp.laplace.weight_space` — through :math:`H` (``P × P``) or its KFAC / diagonal approximations:
  :func:`compute_curvature`, the posteriors of :func:`laplace_posterior` and the estimators of :func:`predict`.

Both stand on :mod:`ntkgp.laplace.ggn` (the likelihood's unit factors, the data pass, the curvature base class and
the exact full GGN / EF in either space, :func:`~ntkgp.laplace.weight_space.exact_curvature`) and never import each
other; which space an exact computation takes is decided in one place, :mod:`ntkgp.laplace.ggn.space`. Both evaluate
an evidence whose spectrum is known (KFAC, the diagonal, the full GGN with one δ) through one node of the graph,
:mod:`ntkgp.laplace.spectral_evidence`.

The GPyTorch-role packages (:mod:`ntkgp.kernels`, :mod:`ntkgp.means`, :mod:`ntkgp.mlls`, :mod:`ntkgp.models`)
are thin adapters over these two.
"""

from . import function_space, weight_space
from .function_space import (
    EvidenceMethod,
    EvidenceOptions,
    GLMPredictiveCovariance,
    SiteIterationWarning,
    SitePosterior,
    fit_site_posterior,
    laplace_log_marginal_likelihood,
)
from .weight_space import (
    Curvature,
    DiagLaplace,
    FullLaplace,
    KFACLaplace,
    LastLayerDiagLaplace,
    LastLayerKFACLaplace,
    LastLayerLaplace,
    PassOptions,
    Prediction,
    SubnetLaplace,
    WeightPosterior,
    compute_curvature,
    laplace_posterior,
    predict,
)

__all__ = [
    "Curvature",
    "DiagLaplace",
    "EvidenceMethod",
    "EvidenceOptions",
    "FullLaplace",
    "GLMPredictiveCovariance",
    "KFACLaplace",
    "LastLayerDiagLaplace",
    "LastLayerKFACLaplace",
    "LastLayerLaplace",
    "PassOptions",
    "Prediction",
    "SiteIterationWarning",
    "SitePosterior",
    "SubnetLaplace",
    "WeightPosterior",
    "compute_curvature",
    "fit_site_posterior",
    "function_space",
    "laplace_log_marginal_likelihood",
    "laplace_posterior",
    "predict",
    "weight_space",
]
