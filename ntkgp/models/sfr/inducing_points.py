r"""Choosing SFR's inducing inputs :math:`Z` from the training inputs, in one pass over the data.

* ``"random"`` (default): a seeded uniform subset without replacement. Every point gets an independent
  uniform key from a generator seeded with ``seed`` and the ``M`` smallest keys are kept (a bottom-``k``
  sample), so a stream of mini-batches needs one pass and memory ``O(M)``; it is the public SFR code's
  choice and is unbiased for the data distribution.
* ``"greedy_variance"``: greedy conditional variance (pivoted Cholesky, Burt, Rasmussen & van der Wilk
  2020), deterministic. Starting from the point of largest prior variance, it repeatedly adds the point whose
  variance given the chosen ones, :math:`K_{nn} - Q_{nn}`, is largest. It greedily minimizes the Nyström
  error :math:`\operatorname{tr}(K_{XX} - Q_{XX})`, the term that separates the collapsed bound from the
  exact evidence and the sparse from the full posterior. On clustered data it places inducing inputs in
  every cluster (an uncovered cluster keeps a large conditional variance), whereas a uniform subset spends
  them in proportion to cluster mass and can miss small clusters. The kernel is the NTK's output trace
  :math:`\sum_c K_{cc}` at the current :math:`\delta`; the pivots come from
  :func:`linear_operator.functions.pivoted_cholesky`. The candidates are the training inputs if there are
  at most ``pool_size`` of them, otherwise a seeded uniform subset of ``pool_size`` (the pool's Gram is
  ``pool_size²``); cost ``O(pool_size² C P_layer + pool_size M²)``.

Both passes follow the model's ``progress`` option (:mod:`ntkgp.progress`): the read of the training inputs is
``"SFR choosing Z (train_x)"`` (points), the pool's Gram ``"SFR choosing Z (pool Gram)"`` (pool rows).

**Over several processes** (:func:`choose_inducing_inputs_distributed`, ``SFR(..., distributed=True)``).
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
from linear_operator.functions import pivoted_cholesky
from torch import Tensor

from ...distributed import all_gather_rows, broadcast_, rank, together, world_size
from ...memory import INDUCING_POOL_BYTES, chunk_rows, renamed_budget
from ...ntk import NTKEngine
from ...options import InducingMethod, OutputCoupling
from ...progress import Progress, reporting
from .streaming import CountedBatches, counted
from .system_grams import system_grams
from .validation import InputLayout, training_batches

__all__ = [
    "choose_inducing_inputs",
    "choose_inducing_inputs_distributed",
    "greedy_variance",
    "inducing_inputs_from_data",
    "model_dtype",
    "smallest_keys",
    "uniform_subset",
]


_SKIP_CHUNK = 1 << 20


def smallest_keys(
    batches: Iterable[Tensor],
    size: int,
    seed: int,
    offset: int = 0,
    empty: str = "train_x holds no data",
    progress: bool | None = False,
) -> tuple[Tensor, Tensor, Tensor, int]:
    """The rows of ``batches`` with the ``size`` smallest keys, their keys, their indices and the row count.

    Row ``i`` of the batches gets the key number ``offset + i`` of one stream of ``torch.rand`` (float64)
    seeded with ``seed``: with ``offset`` a rank skips the keys of the rows before its shard, so that every row keeps
    the key one process gives it on all the data.

    Args:
        batches: input batches ``(n_b, ...)``.
        size: how many rows to keep.
        seed: seed of the keys.
        offset: number of keys to skip (rows before these batches).
        empty: the message of the error for no rows.
        progress: over the rows (``"SFR choosing Z (train_x)"``, :mod:`ntkgp.progress`; the estimate needs their
            number, ``batches.num_points``: :func:`~ntkgp.models.sfr.streaming.counted`).

    Returns:
        The kept rows (in key order), their keys, their indices ``offset + i`` and the number of rows seen.

    Raises:
        ValueError: with ``empty`` if ``batches`` is empty.
    """
    generator = torch.Generator().manual_seed(int(seed))
    for start in range(0, offset, _SKIP_CHUNK):
        torch.rand(min(_SKIP_CHUNK, offset - start), generator=generator, dtype=torch.float64)
    kept: Tensor | None = None
    keys = torch.empty(0, dtype=torch.float64)
    index = torch.empty(0, dtype=torch.long)
    position = offset
    with Progress(getattr(batches, "num_points", None), "SFR choosing Z (train_x)", progress, unit="point") as bar:
        for x in batches:
            batch_keys = torch.rand(x.shape[0], generator=generator, dtype=torch.float64)
            candidates = x if kept is None else torch.cat([kept, x.to(kept)])
            keys = torch.cat([keys, batch_keys])
            index = torch.cat([index, torch.arange(position, position + x.shape[0])])
            position += x.shape[0]
            if keys.numel() > size:
                chosen = torch.topk(keys, size, largest=False).indices
                candidates, keys, index = candidates[chosen], keys[chosen], index[chosen]
            kept = candidates
            bar.update(x.shape[0])
    if kept is None:
        raise ValueError(empty)
    return kept, keys, index, position - offset


def uniform_subset(batches: Iterable[Tensor], size: int, seed: int, progress: bool | None = False) -> tuple[Tensor, int]:
    """A seeded uniform subset of ``min(size, N)`` rows of the concatenated ``batches``, and ``N``.

    Args:
        batches: input batches ``(n_b, ...)``.
        size: how many rows to keep.
        seed: seed of the keys.
        progress: over the rows (as :func:`smallest_keys`).

    Returns:
        The rows, in the order of the data (all rows when ``N <= size``), and ``N``.

    Raises:
        ValueError: if ``batches`` is empty.
    """
    empty = "train_x holds no data to choose inducing inputs from"
    kept, _, index, total = smallest_keys(batches, size, seed, empty=empty, progress=progress)
    return kept[torch.argsort(index)], total


def pool_gram(engine: NTKEngine, pool: Tensor, weights: Tensor, max_bytes: int = INDUCING_POOL_BYTES,
              progress: bool | None = False) -> Tensor:
    r"""The output trace of the NTK on ``pool``, :math:`\sum_g w_g \sum_c [K_g]_{cc}`, ``(P, P)``, in row blocks
    that keep the per-group temporary ``rows·G·C·P`` (float64) under ``max_bytes``; ``progress`` over the rows
    (``"SFR choosing Z (pool Gram)"``, :mod:`ntkgp.progress`; the engine's own chunk passes are silent)."""
    n = pool.shape[0]
    weights = weights.detach()
    rows = chunk_rows(max_bytes, engine.num_groups * engine.num_outputs(pool) * n, torch.float64)
    blocks = []
    name = "SFR choosing Z (pool Gram)"
    with Progress(n, name, progress, unit="point") as bar, reporting(engine.core, False, name):
        for s in range(0, n, rows):
            grams = system_grams(engine, pool[s : s + rows], pool, OutputCoupling.INDEPENDENT)
            blocks.append(torch.einsum("g,gcij->ij", weights, grams))
            bar.update(min(rows, n - s))
    return torch.cat(blocks)


def greedy_variance(engine: NTKEngine, pool: Tensor, size: int, weights: Tensor, max_bytes: int = INDUCING_POOL_BYTES,
                    *, max_elements: int | None = None, progress: bool | None = False) -> Tensor:
    r"""Greedy conditional-variance selection of ``size`` rows of ``pool`` (deterministic).

    The pivots of a partial pivoted Cholesky factorization of the pool's Gram (:func:`pool_gram`), which at
    each step takes the candidate of largest conditional variance. When the Gram's numerical rank is
    exhausted before ``size`` pivots (duplicate candidates, ``M·C > P``), the remaining candidates add
    nothing to the Nyström approximation and are taken in the factorization's order.

    Args:
        engine: the NTK engine of the network.
        pool: candidate inputs ``(P, ...)``.
        size: ``M``.
        weights: group weights :math:`1/\delta`, ``(G,)``.
        max_bytes: bound on the temporary per-group Gram block, in bytes (:data:`ntkgp.memory.INDUCING_POOL_BYTES`).
        max_elements: deprecated, the same bound in float64 numbers (``8·max_elements`` bytes).
        progress: over the pool's Gram (:func:`pool_gram`).

    Returns:
        Indices into ``pool``, shape ``(M,)``, in the order they were chosen.

    Raises:
        ValueError: if ``pool`` has fewer than ``size`` rows.
    """
    max_bytes = renamed_budget(max_bytes, max_elements, "max_bytes", "max_elements")
    n = pool.shape[0]
    if n < size:
        raise ValueError(f"cannot choose {size} inducing inputs from {n} candidates (num_inducing > N)")
    with torch.no_grad():
        gram = pool_gram(engine, pool, weights, max_bytes, progress)
        # stop once the residual trace is at rounding level: further pivots would divide by noise
        tolerance = 10 * n * torch.finfo(gram.dtype).eps
        factor, pivots = pivoted_cholesky(gram, rank=size, error_tol=tolerance, return_pivots=True)
    return pivots[:size].to(torch.long).cpu()


def choose_inducing_inputs(
    engine: NTKEngine,
    batches: Iterable[Tensor],
    size: int,
    method: InducingMethod,
    seed: int,
    pool_size: int,
    weights: Tensor,
    progress: bool | None = False,
) -> Tensor:
    r"""``M`` inducing inputs from the training inputs, in one pass over ``batches``.

    Args:
        engine: the NTK engine.
        batches: the (checked) training inputs, batch by batch.
        size: ``M``.
        method: ``"random"`` or ``"greedy_variance"``.
        seed: seed of the uniform subset (and of the greedy method's candidate pool).
        pool_size: candidates for ``"greedy_variance"``.
        weights: group weights :math:`1/\delta`.
        progress: the model's option, over the read of ``batches`` and the greedy method's pool Gram.

    Returns:
        ``Z``, ``(M, *example)``, prepared for the network (a new tensor).

    Raises:
        ValueError: if there are fewer than ``M`` training inputs.
    """
    keep = size if method is InducingMethod.RANDOM else max(size, pool_size)
    candidates, total = uniform_subset(batches, keep, seed, progress)
    if total < size:
        raise ValueError(f"cannot choose {size} inducing inputs from {total} training inputs (num_inducing > N)")
    candidates = engine.prepare(candidates, "train_x").detach().clone()
    if method is InducingMethod.GREEDY_VARIANCE:
        candidates = candidates[greedy_variance(engine, candidates, size, weights, progress=progress)]
    return candidates


def choose_inducing_inputs_distributed(
    engine: NTKEngine,
    count: Callable[[], int],
    batches: Callable[[], Iterable[Tensor]],
    size: int,
    method: InducingMethod,
    seed: int,
    pool_size: int,
    weights: Tensor,
    progress: bool | None = False,
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
        progress: the model's option, over this rank's read of its shard and the greedy method's pool Gram.

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
        rows, keys, index, _ = smallest_keys(CountedBatches(batches(), local), keep, seed, offset, empty, progress)
        rows = engine.prepare(rows, "train_x").detach()
    rows = all_gather_rows(rows.contiguous())
    keys = all_gather_rows(keys.to(device)).cpu()
    index = all_gather_rows(index.to(device)).cpu()
    if keys.numel() > keep:
        chosen = torch.topk(keys, keep, largest=False).indices
        rows, index = rows[chosen.to(rows.device)], index[chosen]
    candidates = rows[torch.argsort(index).to(rows.device)].clone()
    if method is InducingMethod.GREEDY_VARIANCE:
        candidates = candidates[greedy_variance(engine, candidates, size, weights, progress=progress).to(candidates.device)]
    candidates = candidates.contiguous()
    if world_size() > 1:
        broadcast_([candidates])
    return candidates


def inducing_inputs_from_data(
    engine: NTKEngine,
    train_x: object,
    train_y: object,
    layout: InputLayout,
    size: int,
    method: InducingMethod,
    seed: int,
    pool_size: int,
    weights: Tensor,
    distributed: bool,
    progress: bool | None = False,
) -> Tensor:
    r"""``Z`` chosen from the training data as :class:`~ntkgp.models.sfr.SFR` does: one pass over ``train_x``
    (tensors or a loader, checked batch by batch against ``layout``), over every rank's shard when ``distributed``;
    ``progress``: the model's option (module docstring).

    Returns:
        ``Z``, ``(M, *example)``, prepared for the network, a new tensor (the same on every rank).
    """
    def batches():
        return (layout.check(bx, "train_x")[0] for bx, _ in training_batches(train_x, train_y, "train"))

    if distributed:
        def count() -> int:
            return train_x.shape[0] if torch.is_tensor(train_x) else sum(bx.shape[0] for bx in batches())

        z = choose_inducing_inputs_distributed(engine, count, batches, size, method, seed, pool_size, weights.detach(),
                                               progress)
    else:
        z = choose_inducing_inputs(engine, counted(train_x, batches()), size, method, seed, pool_size, weights,
                                   progress)
    return z.detach().clone()


def model_dtype(inducing_points: Tensor, reference: Tensor) -> torch.dtype:
    """The dtype of SFR's results: that of the inducing inputs (the network's, unless the model was converted),
    or ``reference``'s (the kernel's prior precision, converted with the model) when they are integer token ids."""
    return inducing_points.dtype if inducing_points.is_floating_point() else reference.dtype
