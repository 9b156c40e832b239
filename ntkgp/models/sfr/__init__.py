r"""SFR: a trained network as a sparse function-space GP (Scannell et al.), as a package.

* :mod:`.model` — :class:`SFR`, the GPyTorch model (construction, update, prediction, evidence);
* :mod:`.statistics` — :class:`DualStatistics`, the streamed sums over the data, per parameter group (or for
  the combined kernel at a fixed :math:`\delta`, ``statistics="combined"``);
* :mod:`.whitening` — the whitened ("SGPR") linear algebra on :math:`K_{ZZ}`, :math:`B_u` (no NTK in it);
* :mod:`.inducing_points` — random and greedy-variance (pivoted Cholesky) choice of :math:`Z`;
* :mod:`.predictive` — the predictive's terms at test points, chunk by chunk, with or without input gradients;
* :mod:`.covariance` — :class:`SparsePosteriorCovariance`, the lazy posterior covariance (never densified
  by products);
* :mod:`.data` — argument validation and streaming of the data into the statistics;
* :mod:`.iterated` — ``update(iterate=True)``: new classification sites at the mode (damped Newton);
* :mod:`.distributed` — ``distributed=True``: each rank's shard, statistics all-reduced.
"""

from .covariance import SparsePosteriorCovariance
from .inducing_points import greedy_variance, uniform_subset
from .model import SFR
from .statistics import DualStatistics, system_grams
from .whitening import InducingFactors, WhitenedFactors, Whitening, inducing_factors, whitened_factors

__all__ = [
    "SFR",
    "DualStatistics",
    "InducingFactors",
    "SparsePosteriorCovariance",
    "WhitenedFactors",
    "Whitening",
    "greedy_variance",
    "inducing_factors",
    "system_grams",
    "uniform_subset",
    "whitened_factors",
]
