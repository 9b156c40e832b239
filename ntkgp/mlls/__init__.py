"""GPyTorch marginal log likelihoods of trained networks.

* :class:`LaplaceGGNMarginalLogLikelihood` — the Laplace-GGN log marginal likelihood of an :class:`~ntkgp.NTKGP`;
* :class:`SparseLaplaceMarginalLogLikelihood` — SFR's collapsed sparse bound.

Both are thin adapters over :mod:`ntkgp.laplace` (the evidence as a function:
:func:`ntkgp.laplace.laplace_log_marginal_likelihood`).
"""

from .laplace_ggn_marginal_log_likelihood import LaplaceGGNMarginalLogLikelihood
from .sparse_evidence import SparseLaplaceMarginalLogLikelihood

__all__ = ["LaplaceGGNMarginalLogLikelihood", "SparseLaplaceMarginalLogLikelihood"]
