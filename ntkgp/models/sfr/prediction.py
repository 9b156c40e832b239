r"""SFR's predictive distribution at test points: the chunks of :mod:`~ntkgp.models.sfr.prediction_terms`
assembled into a GPyTorch distribution with the lazy :class:`~ntkgp.models.sfr.covariance.SparsePosteriorCovariance`.

Test points are processed ``chunk`` at a time; what is kept is the mean, the posterior ``C×C`` block of each
point and (when all points fit in one chunk) the low-rank factors :math:`V`, :math:`R^{-1}V` (docs/sfr.md,
"Memory"). The terms are computed in the statistics' dtype; the distribution is returned in the model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from linear_operator.operators import BlockDiagLinearOperator, DenseLinearOperator, DiagLinearOperator
from torch import Tensor

from ...ntk.inputs import to as to_network
from ...progress import Progress
from .covariance import SparsePosteriorCovariance, per_batch_factors
from .prediction_terms import PredictiveTerms, SharedPieces

__all__ = ["marginal_distributions", "predictive_distribution", "predictive_distributions"]


def predictive_distribution(
    terms: PredictiveTerms, x: Tensor, batch: torch.Size, chunk: int, dtype: torch.dtype,
    progress: bool | None = False,
) -> MultivariateNormal:
    """The joint posterior over :math:`f(x)` of each batch element.

    Args:
        terms: the predictive's terms at the model's current state.
        x: prepared test inputs, flattened over the batch, ``(B·n, *example)``.
        batch: the batch shape ``B``.
        chunk: test points per chunk.
        dtype: of the result.
        progress: the model's ``progress`` option (``None``: a bar on a terminal, a line otherwise, for a long pass).

    Returns:
        ``MultivariateNormal`` ``(*batch, n)`` (``C = 1``) or ``MultitaskMultivariateNormal`` ``(*batch, n, C)``
        (interleaved).
    """
    with Progress(x.shape[0], "SFR prediction", progress, unit="point") as bar:
        return predictive_distributions([terms], x, batch, chunk, dtype, bar.update)[0]


def predictive_distributions(
    terms: Sequence[PredictiveTerms], x: Tensor, batch: torch.Size, chunk: int, dtype: torch.dtype,
    progress: Callable[[int], None] | None = None,
) -> list[MultivariateNormal]:
    r"""The joint posteriors over :math:`f(x)` at several model states (e.g. prior precisions) that share their
    inducing inputs and network, in one pass over ``x``: each chunk's :math:`\delta`-free pieces (cross-Grams,
    prior blocks, network outputs: :meth:`~ntkgp.models.sfr.prediction_terms.PredictiveTerms.pieces`) are computed
    once and weighted by every state (on the route with a graph to ``x``, each state computes its own).

    Args:
        terms: the predictive's terms of each state (one engine, inducing inputs, coupling and means).
        x, batch, chunk, dtype: as :func:`predictive_distribution`.
        progress: called with the number of points of each finished chunk (or ``None``).

    Returns:
        One distribution per state, in the order of ``terms``.
    """
    parts = [[] for _ in terms]
    for start in range(0, x.shape[0], chunk):
        rows = x[start : start + chunk]
        shared = None if len(terms) == 1 or terms[0].with_graph(rows) else terms[0].pieces(rows)
        for state_parts, state_terms in zip(parts, terms):
            part = state_terms.chunk(rows, shared)
            if start + chunk < x.shape[0] or state_parts:  # more than one chunk: keep only the per-point results
                part.low_rank_z = part.low_rank_s = None
            state_parts.append(part)
        if progress is not None:
            progress(rows.shape[0])
    return [_assembled(t, p, x, batch, chunk, dtype) for t, p in zip(terms, parts)]


def _assembled(terms: PredictiveTerms, parts: list, x: Tensor, batch: torch.Size, chunk: int,
               dtype: torch.dtype) -> MultivariateNormal:
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


def marginal_distributions(
    makers: Sequence[Callable[[], PredictiveTerms]], x: Tensor, batch: torch.Size, chunk: int, dtype: torch.dtype,
    keep_states: bool, progress: Callable[[int], None] | None = None,
    views: Sequence[Callable[[SharedPieces], SharedPieces]] | None = None,
) -> list[MultivariateNormal]:
    r"""The per-point marginals of the posteriors over :math:`f(x)` at several model states, in one pass over ``x``:
    each chunk's :math:`\delta`-free pieces computed once (by the first state's terms) and weighted by every state,
    as :func:`predictive_distributions`, but only each point's mean and ``C×C`` block are kept, so that no state's
    factorization lives beyond the pass. ``makers[k]()``: the terms of state ``k`` (its factorization formed then);
    ``keep_states``: keep them from chunk to chunk (else formed once per chunk, one at a time: the memory of one
    factorization); ``views[k]``: the part of the pieces that state ``k`` reads (the leading inducing inputs of a
    nested model: :func:`~ntkgp.models.sfr.nested.nested_marginals`; default all). Returns distributions whose
    covariance is block-diagonal over the points (``C×C`` blocks; diagonal for ``C = 1``): the marginals, without
    the covariances between points."""
    count = len(makers)
    means, blocks = [[] for _ in range(count)], [[] for _ in range(count)]
    kept: dict[int, PredictiveTerms] = {}
    for start in range(0, x.shape[0], chunk):
        rows, shared = x[start : start + chunk], None
        for k in range(count):
            terms = kept[k] if k in kept else makers[k]()
            if shared is None and (count > 1 or views is not None) and not terms.with_graph(rows):
                shared = terms.pieces(rows)
            part = terms.chunk(rows, shared if views is None or shared is None else views[k](shared))
            means[k].append(part.mean)
            blocks[k].append(part.blocks)
            if keep_states:
                kept[k] = terms
            del part, terms
        if progress is not None:
            progress(rows.shape[0])
    return [_marginal(torch.cat(m), torch.cat(b), x, batch, dtype) for m, b in zip(means, blocks)]


def _marginal(mean: Tensor, blocks: Tensor, x: Tensor, batch: torch.Size, dtype: torch.dtype) -> MultivariateNormal:
    count, c = x.shape[0] // max(1, batch.numel()), mean.shape[-1]
    mean = mean.reshape(*batch, count, c).to(dtype)
    blocks = blocks.reshape(*batch, count, c, c).to(dtype)
    if c == 1:
        return MultivariateNormal(mean.squeeze(-1), DiagLinearOperator(blocks[..., 0, 0]))
    return MultitaskMultivariateNormal(mean, BlockDiagLinearOperator(DenseLinearOperator(blocks)), interleaved=True)
