r"""Function-space variational inference (FSVI, Rudner et al. 2022) for a whole network.

A mean-field Gaussian over all the weights, trained on the expected log-likelihood minus the KL between the
variational and the prior distribution over functions at context points, both linearized Gaussians whose
covariances :math:`J \operatorname{diag}(s^2) J^\top` are computed in structured form (never :math:`J` for linear
layers). The result is a GPyTorch model (docs/fsvi.md).

* :func:`train_fsvi` — the one-call entry point; :class:`FSVIResult`.
* :class:`FSVI` — the model: ``model(x)`` is the linearized GP, :meth:`FSVI.predict` the MC or linearized
  predictive, :meth:`FSVI.condition_on` its exact posterior given new observations (Gaussian likelihoods);
  :class:`FunctionSpaceELBO` its objective (for your own training loop).
* :class:`MeanFieldGaussian`, :class:`GaussianParameterPrior` — :math:`q(\theta)` and :math:`p(\theta)`.
* :class:`VariationalNetworkMean`, :class:`MeanFieldNTKKernel` — the GP's mean and kernel.
* Context distributions: :class:`UniformBoxContext`, :class:`MonochromeContext`, :class:`DatasetContext`,
  :class:`SamplerContext`, :class:`BatchMixedContext` (base class :class:`ContextDistribution`).
* :func:`gaussian_kl` — closed-form KL between two multivariate Gaussians.
"""

from .context import (
    BatchMixedContext,
    ContextDistribution,
    DatasetContext,
    MonochromeContext,
    SamplerContext,
    UniformBoxContext,
)
from .kernel import MeanFieldNTKKernel
from .kl import gaussian_kl
from .linearized import LinearizedNetwork
from .mean import VariationalNetworkMean
from .model import FSVI
from .objective import ELBOTerms, FunctionSpaceELBO
from .prior import GaussianParameterPrior
from .training import FSVIResult, train_fsvi
from .training_options import FSVIOptimization, FSVIOptions
from .variational import MeanFieldGaussian

__all__ = [
    "FSVI",
    "BatchMixedContext",
    "ContextDistribution",
    "DatasetContext",
    "ELBOTerms",
    "FSVIOptimization",
    "FSVIOptions",
    "FSVIResult",
    "FunctionSpaceELBO",
    "GaussianParameterPrior",
    "LinearizedNetwork",
    "MeanFieldGaussian",
    "MeanFieldNTKKernel",
    "MonochromeContext",
    "SamplerContext",
    "UniformBoxContext",
    "VariationalNetworkMean",
    "gaussian_kl",
    "train_fsvi",
]
