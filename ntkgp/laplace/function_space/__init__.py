r"""Function-space Laplace: the Laplace-GGN log marginal likelihood, the site posterior and the GLM predictive,
as functions of the NTK kernel (``N·C × N·C`` objects; cheaper when ``N·C < P``).

It sits above the NTK kernel and the likelihoods and below the models and MLLs: everything here is a
function of a kernel, a likelihood and fixed data (the network outputs :math:`f(X;\theta^*)` and targets),
so that :class:`~ntkgp.NTKGP`, :class:`~ntkgp.mlls.LaplaceGGNMarginalLogLikelihood` and
:func:`~ntkgp.training.train_marglik` share one implementation.

* :func:`laplace_log_marginal_likelihood` — :math:`\log q(\mathcal D)` in function or weight space;
* :class:`SitePosterior`, :func:`fit_site_posterior` — the posterior under Gaussian sites, in function or weight
  space (:func:`posterior_space`), at the network's outputs or iterated to the mode (:func:`site_mode`);
* :class:`GLMPredictiveCovariance` — the predictive covariance, lazy and chunked over test points;
* :mod:`~ntkgp.laplace.function_space.algebra` — block-diagonal site factors, :math:`\log|I + L^\top K L|`;
* :mod:`~ntkgp.laplace.function_space.routes`, :mod:`~ntkgp.laplace.function_space.eigen`, :mod:`~ntkgp.laplace.function_space.matrix_free` — the routes of
  the evidence's log-determinant (dense Cholesky, one eigendecomposition for one :math:`\delta`, GPyTorch's
  CG + stochastic Lanczos quadrature on a matrix-free kernel) and their options (``docs/scaling.md``).
"""

from ...ntk.products import NTKProducts
from .algebra import block_apply, block_sandwich, low_rank_log_det, site_cholesky
from .eigen import spectral_log_det
from .evidence import (
    column_weights,
    curvature_factor,
    evidence_method,
    laplace_log_marginal_likelihood,
    log_det_term,
    prior_term,
)
from .matrix_free import (
    LaplaceSiteOperator,
    MatrixFreeNTKOperator,
    NystromPreconditioner,
    matrix_free_log_det,
)
from .glm_covariance import GLMPredictiveCovariance, PredictiveContext
from .routes import DENSE_MEMORY_LIMIT, EvidenceMethod, EvidenceOptions
from .site_posterior import (
    SiteIterationWarning,
    SitePosterior,
    fit_site_posterior,
    posterior_space,
    site_mode,
)

__all__ = [
    "DENSE_MEMORY_LIMIT",
    "EvidenceMethod",
    "EvidenceOptions",
    "GLMPredictiveCovariance",
    "LaplaceSiteOperator",
    "MatrixFreeNTKOperator",
    "NTKProducts",
    "NystromPreconditioner",
    "PredictiveContext",
    "SiteIterationWarning",
    "SitePosterior",
    "block_apply",
    "block_sandwich",
    "column_weights",
    "curvature_factor",
    "evidence_method",
    "fit_site_posterior",
    "laplace_log_marginal_likelihood",
    "log_det_term",
    "low_rank_log_det",
    "matrix_free_log_det",
    "posterior_space",
    "prior_term",
    "site_cholesky",
    "site_mode",
    "spectral_log_det",
]
