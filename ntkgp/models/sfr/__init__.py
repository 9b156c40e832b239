r"""SFR: a trained network as a sparse function-space GP (Scannell et al.), as a package.

* :mod:`.model` — :class:`SFR`, the GPyTorch model (options, construction, update, prediction, evidence);
* :mod:`.validation` — argument checks (inputs, their layout, integer and boolean options);
* :mod:`.inducing_points` — random and greedy-variance (pivoted Cholesky) choice of :math:`Z`, in one process
  or across the ranks of ``torch.distributed`` (``distributed=True``);
* :mod:`.system_grams` — the per-group Grams arranged as SFR's systems (joint or independent outputs);
* :mod:`.statistics` — :class:`DualStatistics`, the streamed sums over the data, per parameter group (or for
  the combined kernel at a fixed :math:`\delta`, ``statistics="combined"``), in float64;
* :mod:`.streaming` — the pass over the data into the statistics;
* :mod:`.guard` — what the statistics were computed at (weights, :math:`Z`), saved with the ``state_dict``;
* :mod:`.whitening` — the whitened ("SGPR") linear algebra on :math:`K_{ZZ}`, :math:`B_u` (no NTK in it);
* :mod:`.factorization` — the posterior's factors at the current hyperparameters, and their cache;
* :mod:`.prediction_terms` — the predictive's terms at test points, chunk by chunk, with or without input
  gradients; :mod:`.prediction` — their assembly into a distribution;
* :mod:`.covariance` — :class:`SparsePosteriorCovariance`, the lazy posterior covariance (never densified
  by products);
* :mod:`.evidence` — the collapsed evidence lower bound;
* :mod:`.updates` — ``update``: the new data's statistics, summed aside; :mod:`.iterated` — with
  ``iterate=True``, new classification sites at the mode (damped Newton).
* :mod:`.subset` — ``select_inducing``: the model on a subset of its inducing inputs, from sub-blocks of the
  statistics (no pass over the data); :mod:`.nested` — ``nested_marginals``: models on nested inducing inputs
  predicted from one pass.
"""

from .covariance import SparsePosteriorCovariance
from .inducing_points import greedy_variance, uniform_subset
from .model import SFR
from .nested import nested_marginals
from .options import SFRInducingOptions, SFRMemoryOptions
from .statistics import DualStatistics
from .system_grams import system_grams
from .whitening import InducingFactors, WhitenedFactors, Whitening, inducing_factors, whitened_factors

__all__ = [
    "SFR",
    "SFRInducingOptions",
    "SFRMemoryOptions",
    "DualStatistics",
    "InducingFactors",
    "SparsePosteriorCovariance",
    "WhitenedFactors",
    "Whitening",
    "greedy_variance",
    "inducing_factors",
    "nested_marginals",
    "system_grams",
    "uniform_subset",
    "whitened_factors",
]
