"""GPyTorch marginal log likelihoods of trained networks."""

from .laplace_ggn_evidence import laplace_ggn_evidence
from .laplace_ggn_marginal_log_likelihood import LaplaceGGNMarginalLogLikelihood
from .sparse_evidence import SparseLaplaceEvidence

try:  # provided with the SFR package (mlls/sparse_evidence.py)
    from .sparse_evidence import SparseLaplaceMarginalLogLikelihood
except ImportError:  # pragma: no cover - until it lands
    SparseLaplaceMarginalLogLikelihood = None

__all__ = [
    "LaplaceGGNMarginalLogLikelihood",
    "SparseLaplaceEvidence",
    "SparseLaplaceMarginalLogLikelihood",
    "laplace_ggn_evidence",
]
