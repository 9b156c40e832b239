"""ntkgp: turn a trained PyTorch network into a Gaussian process (empirical NTK, Laplace-GGN evidence, GLM predictive, SFR)."""

from .kernels import NTKKernel
from .ntk import NTKEngine

__version__ = "0.1.0"

__all__ = ["NTKKernel", "NTKEngine", "__version__"]
