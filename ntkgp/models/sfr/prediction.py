r"""SFR's predictive distribution at test points: the chunks of :mod:`~ntkgp.models.sfr.prediction_terms`
assembled into a GPyTorch distribution with the lazy :class:`~ntkgp.models.sfr.covariance.SparsePosteriorCovariance`.

Test points are processed ``chunk`` at a time; what is kept is the mean, the posterior ``C×C`` block of each
point and (when all points fit in one chunk) the low-rank factors :math:`V`, :math:`R^{-1}V` (docs/sfr.md,
"Memory"). The terms are computed in the statistics' dtype; the distribution is returned in the model's.
"""

from __future__ import annotations

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from torch import Tensor

from ...ntk.inputs import to as to_network
from .covariance import SparsePosteriorCovariance, per_batch_factors
from .prediction_terms import PredictiveTerms

__all__ = ["predictive_distribution"]


def predictive_distribution(
    terms: PredictiveTerms, x: Tensor, batch: torch.Size, chunk: int, dtype: torch.dtype
) -> MultivariateNormal:
    """The joint posterior over :math:`f(x)` of each batch element.

    Args:
        terms: the predictive's terms at the model's current state.
        x: prepared test inputs, flattened over the batch, ``(B·n, *example)``.
        batch: the batch shape ``B``.
        chunk: test points per chunk.
        dtype: of the result.

    Returns:
        ``MultivariateNormal`` ``(*batch, n)`` (``C = 1``) or ``MultitaskMultivariateNormal`` ``(*batch, n, C)``
        (interleaved).
    """
    parts = []
    for start in range(0, x.shape[0], chunk):
        part = terms.chunk(x[start : start + chunk])
        if start + chunk < x.shape[0] or parts:  # more than one chunk: keep only the per-point results
            part.low_rank_z = part.low_rank_s = None
        parts.append(part)
    count, c = x.shape[0] // max(1, batch.numel()), terms.num_outputs
    mean = torch.cat([p.mean for p in parts]).reshape(*batch, count, c).to(dtype)
    blocks = torch.cat([p.blocks for p in parts]).reshape(*batch, count, c, c).to(dtype)
    factors = [None, None]
    if len(parts) == 1:  # small enough to keep V and R⁻¹V (per batch element)
        factors = [per_batch_factors(f, batch) for f in (parts[0].low_rank_z, parts[0].low_rank_s)]
    points = to_network(x.reshape(*batch, count, *x.shape[1:]), dtype, x.device)  # exact: converted back for recomputations
    covariance = SparsePosteriorCovariance(points, blocks, *factors, terms=terms, chunk_size=chunk)
    if c == 1:
        return MultivariateNormal(mean.squeeze(-1), covariance)
    return MultitaskMultivariateNormal(mean, covariance, interleaved=True)
