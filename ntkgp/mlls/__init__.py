"""Evidences (marginal likelihoods) of trained networks."""

from .laplace_ggn_evidence import laplace_ggn_evidence
from .laplace_ggn_marginal_log_likelihood import LaplaceGGNMarginalLogLikelihood

__all__ = ["LaplaceGGNMarginalLogLikelihood", "laplace_ggn_evidence"]
