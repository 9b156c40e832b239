r"""SFR over several processes: inducing inputs chosen from every rank's shard, the same as one process.

With ``distributed=True`` each rank of a ``torch.distributed`` process group passes its shard of the training
data; the shards, concatenated in rank order, are the data set (:func:`ntkgp.distributed.shard`). The dual
statistics are sums over the data (:mod:`~ntkgp.models.sfr.statistics`), all-reduced after each rank's pass.

Choosing ``Z`` from the data (``num_inducing=``) must give every rank the same ``Z``, and the same ``Z`` as one
process on all the data. The uniform subset of :func:`~ntkgp.models.sfr.inducing_points.uniform_subset`
gives point ``i`` (global order) the ``i``-th key of one seeded stream and keeps the smallest; here rank ``r``
counts its rows first, skips the keys of the ranks before it, keeps its own smallest keys, and the ranks
exchange those (``all_gather``, ``O(W·M)`` rows): the global smallest keys are among them. The greedy
method then runs on that common candidate pool on every rank, and ``Z`` is broadcast from rank 0 (so that
a GPU's non-deterministic reductions cannot make ranks disagree).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from ...distributed import all_gather_rows, broadcast_, rank, together, world_size
from ...ntk import NTKEngine
from ...options import InducingMethod
from .inducing_points import greedy_variance, smallest_keys

__all__ = ["choose_inducing_inputs_distributed"]


def choose_inducing_inputs_distributed(
    engine: NTKEngine,
    count: Callable[[], int],
    batches: Callable[[], Iterable[Tensor]],
    size: int,
    method: InducingMethod,
    seed: int,
    pool_size: int,
    weights: Tensor,
) -> Tensor:
    r"""``M`` inducing inputs from the training inputs of every rank, identical on every rank.

    Equal to :func:`~ntkgp.models.sfr.inducing_points.choose_inducing_inputs` on the concatenation of the
    shards in rank order (module docstring).

    Args:
        engine: the NTK engine (the same network on every rank).
        count: returns the number of rows of this rank's shard (a pass over a loader).
        batches: returns a fresh iterable over this rank's checked input batches.
        size: ``M``.
        method: ``"random"`` or ``"greedy_variance"``.
        seed: seed of the keys.
        pool_size: candidates for ``"greedy_variance"``.
        weights: group weights :math:`1/\delta`.

    Returns:
        ``Z``, ``(M, *example)``, prepared for the network, the same tensor on every rank.

    Raises:
        ValueError: on every rank, if all the shards together hold fewer than ``M`` rows.
    """
    keep = size if method is InducingMethod.RANDOM else max(size, pool_size)
    with together("counting train_x"):
        local = int(count())
    device = weights.device
    counts = all_gather_rows(torch.tensor([local], dtype=torch.long, device=device)).cpu()
    offset, total = int(counts[: rank()].sum()), int(counts.sum())
    if total < size:
        raise ValueError(f"cannot choose {size} inducing inputs from {total} training inputs (num_inducing > N)")
    with together("choosing inducing inputs"):
        empty = "this rank's shard of train_x holds no data"
        rows, keys, index, _ = smallest_keys(batches(), keep, seed, offset, empty)
        rows = engine.prepare(rows, "train_x").detach()
    rows = all_gather_rows(rows.contiguous())
    keys = all_gather_rows(keys.to(device)).cpu()
    index = all_gather_rows(index.to(device)).cpu()
    if keys.numel() > keep:
        chosen = torch.topk(keys, keep, largest=False).indices
        rows, index = rows[chosen.to(rows.device)], index[chosen]
    candidates = rows[torch.argsort(index).to(rows.device)].clone()
    if method is InducingMethod.GREEDY_VARIANCE:
        candidates = candidates[greedy_variance(engine, candidates, size, weights).to(candidates.device)]
    candidates = candidates.contiguous()
    if world_size() > 1:
        broadcast_([candidates])
    return candidates
