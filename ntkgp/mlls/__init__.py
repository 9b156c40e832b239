"""GPyTorch marginal log likelihoods of trained networks.

* :class:`LaplaceGGNMarginalLogLikelihood` — the Laplace-GGN log marginal likelihood of an :class:`~ntkgp.NTKGP`;
* :class:`SparseLaplaceMarginalLogLikelihood` — SFR's collapsed sparse bound.

Deprecated names kept for one release: :class:`SparseLaplaceEvidence`, :func:`laplace_ggn_evidence` (now
:func:`ntkgp.laplace.laplace_log_marginal_likelihood`).
"""

from .laplace_ggn_evidence import laplace_ggn_evidence
from .laplace_ggn_marginal_log_likelihood import LaplaceGGNMarginalLogLikelihood
from .sparse_evidence import SparseLaplaceEvidence, SparseLaplaceMarginalLogLikelihood

__all__ = [
    "LaplaceGGNMarginalLogLikelihood",
    "SparseLaplaceEvidence",
    "SparseLaplaceMarginalLogLikelihood",
    "laplace_ggn_evidence",
]
