"""ntkgp: turn a trained PyTorch network into a Gaussian process on GPyTorch.

The empirical NTK as a kernel (:class:`NTKKernel`), the Laplace-GGN log marginal likelihood as a GPyTorch
MLL (:class:`LaplaceGGNMarginalLogLikelihood`), the GLM predictive as a model that conditions on new data
(:class:`NTKGP`), the sparse function-space representation (:class:`SFR`) and online training of the
hyperparameters (:func:`ntkgp.training.train_marglik`). The mathematics is in ``docs/math.md``.

Subpackages: :mod:`~ntkgp.likelihoods`, :mod:`~ntkgp.laplace` (function-space and weight-space Laplace:
evidence, curvature structures, weight posteriors and their predictives), :mod:`~ntkgp.training`,
:mod:`~ntkgp.fsvi` (function-space variational inference, :class:`FSVI`), :mod:`~ntkgp.options` (every option
string), :mod:`~ntkgp.metrics`, :mod:`~ntkgp.datasets`.
"""

from . import datasets, fsvi, laplace, likelihoods, metrics, options, training
from .fsvi import FSVI
from .kernels import NTKKernel
from .laplace import laplace_log_marginal_likelihood
from .means import LinearizedNetworkMean, NetworkMean
from .mlls import LaplaceGGNMarginalLogLikelihood, SparseLaplaceMarginalLogLikelihood
from .models import NTKGP, SFR, ExactNTKGP, LaplaceNTKGP
from .ntk import NTKEngine


__version__ = "0.1.0"

__all__ = [
    "FSVI",
    "NTKGP",
    "SFR",
    "ExactNTKGP",
    "LaplaceGGNMarginalLogLikelihood",
    "LaplaceNTKGP",
    "LinearizedNetworkMean",
    "NTKEngine",
    "NTKKernel",
    "NetworkMean",
    "SparseLaplaceMarginalLogLikelihood",
    "__version__",
    "datasets",
    "fsvi",
    "laplace",
    "laplace_log_marginal_likelihood",
    "likelihoods",
    "metrics",
    "options",
    "training",
]
