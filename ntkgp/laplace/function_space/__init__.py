r"""Function-space Laplace: the Laplace-GGN log marginal likelihood, the site posterior and the GLM predictive,
as functions of the NTK kernel (``N·C × N·C`` objects; cheaper when ``N·C < P``).

It sits above the NTK kernel and the likelihoods and below the models and MLLs: everything here is a
function of a kernel, a likelihood and fixed data (the network outputs :math:`f(X;\theta^*)` and targets),
so that :class:`~ntkgp.NTKGP`, :class:`~ntkgp.mlls.LaplaceGGNMarginalLogLikelihood` and
:func:`~ntkgp.training.train_marglik` share one implementation.

* :func:`laplace_log_marginal_likelihood` — :math:`\log q(\mathcal D)` in function or weight space;
  :class:`TrainingEvidence` — the same, evaluated step after step on fixed training data (the MLL's use);
* :class:`SitePosterior`, :func:`fit_site_posterior` — the posterior under Gaussian sites, in function or weight
  space (:func:`posterior_space`), at the network's outputs or iterated to the mode (:func:`site_mode`);
* :class:`GLMPredictiveCovariance` — the predictive covariance, lazy and chunked over test points;
* :mod:`~ntkgp.laplace.function_space.algebra` — block-diagonal site factors, :math:`\log|I + L^\top K L|`;
* :mod:`~ntkgp.laplace.function_space.routes` — the routes of the evidence's log-determinant and their options
  (``docs/scaling.md``): dense Cholesky on the exact curvature built once per network state
  (:mod:`~ntkgp.laplace.function_space.evidence_curvature`), one eigendecomposition for one :math:`\delta`
  (:mod:`~ntkgp.laplace.function_space.eigen`), GPyTorch's CG + stochastic Lanczos quadrature
  (:mod:`~ntkgp.laplace.function_space.matrix_free`) on the matrix-free operators
  (:mod:`~ntkgp.laplace.function_space.ntk_operator`, :mod:`~ntkgp.laplace.function_space.site_operator`,
  :mod:`~ntkgp.laplace.function_space.nystrom`).
"""

from .eigen import spectral_log_det
from .evidence import TrainingEvidence, evidence_method, is_kernel_covariance, laplace_log_marginal_likelihood
from .glm_covariance import GLMPredictiveCovariance, PredictiveContext
from ...ntk.products import NTKProducts
from .matrix_free import matrix_free_log_det
from .nystrom import NystromPreconditioner
from .ntk_operator import MatrixFreeNTKOperator
from .routes import DENSE_MEMORY_LIMIT, EvidenceMethod, EvidenceOptions
from .site_operator import LaplaceSiteOperator
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
    "TrainingEvidence",
    "evidence_method",
    "fit_site_posterior",
    "is_kernel_covariance",
    "laplace_log_marginal_likelihood",
    "matrix_free_log_det",
    "posterior_space",
    "site_mode",
    "spectral_log_det",
]
