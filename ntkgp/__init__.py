"""ntkgp: turn a trained PyTorch network into a Gaussian process (empirical NTK, Laplace-GGN evidence, GLM predictive, SFR)."""

from . import curvature, likelihoods, training
from .kernels import NTKKernel
from .means import LinearisedNetworkMean, NetworkMean
from .mlls import LaplaceGGNMarginalLogLikelihood, SparseLaplaceEvidence
from .models import NTKGP, SFR, ExactNTKGP, LaplaceNTKGP
from .ntk import NTKEngine

__version__ = "0.1.0"

__all__ = [
    "NTKGP",
    "SFR",
    "ExactNTKGP",
    "LaplaceGGNMarginalLogLikelihood",
    "LaplaceNTKGP",
    "LinearisedNetworkMean",
    "NTKEngine",
    "NTKKernel",
    "NetworkMean",
    "SparseLaplaceEvidence",
    "__version__",
    "curvature",
    "likelihoods",
    "training",
]
