"""Evidences (marginal likelihoods) of trained networks."""

from .laplace_ggn_evidence import laplace_ggn_evidence
from .laplace_ggn_marginal_log_likelihood import LaplaceGGNMarginalLogLikelihood
from .sparse_evidence import SparseLaplaceEvidence

__all__ = ["LaplaceGGNMarginalLogLikelihood", "SparseLaplaceEvidence", "laplace_ggn_evidence"]
