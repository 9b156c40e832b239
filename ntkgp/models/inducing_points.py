r"""Choosing SFR's inducing inputs :math:`Z` from the training inputs, in one pass over the data.

* ``"random"`` (default): a seeded uniform subset without replacement. Every point gets an independent
  uniform key from a generator seeded with ``seed`` and the ``M`` smallest keys are kept (a bottom-``k``
  sample), so a stream of mini-batches needs one pass and memory ``O(M)``; it is the public SFR code's
  choice and is unbiased for the data distribution.
* ``"greedy_variance"``: greedy conditional variance (pivoted Cholesky, Burt, Rasmussen & van der Wilk
  2020), deterministic. Starting from the point of largest prior variance, it repeatedly adds the point whose
  variance given the chosen ones, :math:`\operatorname{tr}(K_{nn} - Q_{nn})`, is largest. It greedily
  minimises the Nyström error :math:`\operatorname{tr}(K_{XX} - Q_{XX})`, the term that separates the
  collapsed bound from the exact evidence and the sparse from the full posterior. On clustered data it
  places inducing inputs in every cluster (an uncovered cluster keeps a large conditional variance),
  whereas a uniform subset spends them in proportion to cluster mass and can miss small clusters. The
  kernel is the NTK's output trace :math:`\sum_c K_{cc}` at the current :math:`\delta`. The candidates are the
  training inputs if there are at most ``pool_size`` of them, otherwise a seeded uniform subset of
  ``pool_size`` (the pool's Gram is ``pool_size²``); cost ``O(pool_size² C P_layer + pool_size M²)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ..ntk import NTKEngine
from .sfr_statistics import system_grams

INDUCING_METHODS = ("random", "greedy_variance")


def uniform_subset(batches: Iterable[Tensor], size: int, seed: int) -> tuple[Tensor, int]:
    """A seeded uniform subset of ``min(size, N)`` rows of the concatenated ``batches``, and ``N``.

    Rows are returned in the order of the data; when ``N <= size`` all rows are returned.
    """
    generator = torch.Generator().manual_seed(int(seed))
    kept: Tensor | None = None
    keys = torch.empty(0, dtype=torch.float64)
    order = torch.empty(0, dtype=torch.long)
    total = 0
    for x in batches:
        batch_keys = torch.rand(x.shape[0], generator=generator, dtype=torch.float64)
        candidates = x if kept is None else torch.cat([kept, x.to(kept)])
        keys = torch.cat([keys, batch_keys])
        order = torch.cat([order, torch.arange(total, total + x.shape[0])])
        total += x.shape[0]
        if keys.numel() > size:
            chosen = torch.topk(keys, size, largest=False).indices
            candidates, keys, order = candidates[chosen], keys[chosen], order[chosen]
        kept = candidates
    if kept is None:
        raise ValueError("no training inputs to choose inducing inputs from")
    return kept[torch.argsort(order)], total


def greedy_variance(engine: NTKEngine, pool: Tensor, size: int, weights: Tensor, max_elements: int = 2**25) -> Tensor:
    r"""Greedy conditional variance selection of ``size`` rows of ``pool`` (deterministic; ties: lowest index).

    Args:
        engine: the NTK engine of the network.
        pool: candidate inputs ``(P, ...)``.
        size: ``M``.
        weights: group weights :math:`1/\delta`, ``(G,)``.
        max_elements: bound on the temporary per-group Gram block.
    Returns:
        Indices into ``pool``, shape ``(M,)``, in the order they were chosen.
    """
    n = pool.shape[0]
    if n < size:
        raise ValueError(f"cannot choose {size} inducing inputs from {n} candidates (num_inducing > N)")
    weights = weights.detach()
    c = engine.num_outputs(pool)
    rows = max(1, max_elements // max(1, engine.num_groups * c * n))
    gram = torch.cat(
        [
            torch.einsum("g,gcij->ij", weights, system_grams(engine, pool[s : s + rows], pool, "independent"))
            for s in range(0, n, rows)
        ]
    )
    residual = gram.diagonal().clone()
    factor = torch.zeros(n, size, dtype=gram.dtype, device=gram.device)
    chosen = torch.empty(size, dtype=torch.long)
    available = torch.ones(n, dtype=torch.bool, device=gram.device)
    for i in range(size):
        scores = torch.where(available, residual, torch.full_like(residual, -torch.inf))
        j = int(torch.argmax(scores))
        chosen[i] = j
        available[j] = False
        pivot = residual[j].clamp_min(torch.finfo(gram.dtype).tiny).sqrt()
        column = (gram[:, j] - factor[:, :i] @ factor[j, :i]) / pivot
        factor[:, i] = column
        residual = (residual - column.square()).clamp_min(0)
    return chosen
