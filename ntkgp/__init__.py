"""ntkgp: turn a trained PyTorch network into a Gaussian process (empirical NTK, Laplace-GGN evidence, GLM predictive, SFR)."""

from . import curvature, likelihoods, training
from .kernels import NTKKernel
from .means import LinearisedNetworkMean, NetworkMean
from .mlls import LaplaceGGNMarginalLogLikelihood
from .models import NTKGP, ExactNTKGP, LaplaceNTKGP
from .ntk import NTKEngine

__version__ = "0.1.0"

__all__ = [
    "NTKKernel",
    "NTKEngine",
    "NTKGP",
    "ExactNTKGP",
    "LaplaceNTKGP",
    "LaplaceGGNMarginalLogLikelihood",
    "LinearisedNetworkMean",
    "NetworkMean",
    "likelihoods",
    "curvature",
    "training",
    "__version__",
]
