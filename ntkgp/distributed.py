r"""Data parallelism over ``torch.distributed``: small helpers, no communication of ntkgp's own.

Every quantity ntkgp streams over the data is a **sum over the data** (SFR's dual statistics, the KFAC
factors, the diagonal and weight-space GGN, the MAP gradient of Algorithm 1). With the data split into
shards, one per process ("rank"), each rank sums over its shard and one ``all_reduce`` (sum) gives every
rank the sums over all the data: the same numbers as one process on all the data, up to the order of the
floating-point additions. The network is replicated, as in ``DistributedDataParallel``: the same weights on
every rank. Only ``torch.distributed`` collectives are used (``all_reduce``, ``all_gather``,
``broadcast``), so any backend works: ``gloo`` on CPUs, ``nccl`` on GPUs. See docs/scaling.md,
"Several processes and GPUs".

The public entry points take ``distributed=True`` (default ``False``: an explicit opt-in, so a model built
on one rank only, e.g. for evaluation inside a DDP script, never waits for the others). With
``distributed=True`` **every rank must make the same call**, each with its own shard.

Helpers:

* :func:`is_distributed`, :func:`world_size`, :func:`rank`: the process group's state (one process without
  an initialized group: ``False``, 1, 0);
* :func:`all_reduce_sum`: in-place sums of tensors across ranks (a no-op in one process);
* :func:`all_gather_rows`: the concatenation, in rank order, of tensors with different row counts;
* :func:`broadcast_`, :func:`check_replicated`: one set of values on every rank; :func:`check_layout`: the same
  number, shapes and dtypes of tensors on every rank, checked before a collective over them;
* :func:`shard_range`, :func:`shard`: this rank's contiguous part of ``N`` rows (rank order = data order);
* :func:`together`: a failure on one rank raises on every rank instead of leaving them waiting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_gather_rows",
    "all_reduce_max",
    "all_reduce_sum",
    "broadcast_",
    "check_distributed",
    "check_layout",
    "check_replicated",
    "is_distributed",
    "rank",
    "shard",
    "shard_range",
    "together",
    "world_size",
]

# tensors with at most this many numbers are summed in one flattened buffer (one collective for all of them)
_SMALL = 1 << 16


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialized (in any world size)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """The number of ranks; 1 without an initialized process group."""
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's rank; 0 without an initialized process group."""
    return dist.get_rank() if is_distributed() else 0


def check_distributed(value: object, argument: str = "distributed") -> bool:
    """Validate a ``distributed=`` argument: a ``bool``; ``True`` needs an initialized process group.

    Raises:
        TypeError: if ``value`` is not a ``bool``.
        ValueError: ``True`` without ``torch.distributed.init_process_group`` (e.g. a script not started by
            ``torchrun``).
    """
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, got {value!r}")
    if value and not is_distributed():
        raise ValueError(
            f"{argument}=True needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (e.g. in a script started by torchrun)"
        )
    return value


def _active(enabled: bool = True) -> bool:
    return enabled and is_distributed() and dist.get_world_size() > 1


def _device() -> torch.device:
    """Where the collectives' own small tensors live: the current CUDA device for ``nccl``, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensors: Tensor | Sequence[Tensor], enabled: bool = True) -> Tensor | Sequence[Tensor]:
    """Replace every tensor by its sum over the ranks, in place; a no-op in one process or if not ``enabled``.

    Small tensors of one dtype and device go through one flattened buffer (one collective); large ones are
    reduced in place one by one (no second copy of a large statistic). Every rank must pass tensors of the
    same shapes, dtypes and order.

    Args:
        tensors: a tensor or a sequence of tensors (contiguous; no gradient is tracked).
        enabled: ``False`` skips the reduction (for callers with a ``distributed=`` switch).

    Returns:
        ``tensors`` (the same objects).
    """
    items = [tensors] if torch.is_tensor(tensors) else list(tensors)
    if not _active(enabled) or not items:
        return tensors
    small: dict[tuple, list[Tensor]] = {}
    with torch.no_grad():
        for t in items:
            if t.numel() > _SMALL:
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
            else:
                small.setdefault((t.dtype, t.device), []).append(t)
        for group in small.values():
            buffer = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
            offset = 0
            for t in group:
                t.copy_(buffer[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
    return tensors


def all_reduce_max(value: int | float, enabled: bool = True) -> int | float:
    """The largest ``value`` over the ranks (``value`` itself in one process)."""
    if not _active(enabled):
        return value
    t = torch.tensor([value], dtype=torch.float64 if isinstance(value, float) else torch.long, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return type(value)(t.item())


def _same_everywhere(description: str) -> bool:
    """Whether every rank passes the same ``description`` (a 56-bit digest compared by one ``MAX`` and one
    ``MIN`` all-reduce; every rank gets the same answer)."""
    code = int.from_bytes(hashlib.sha256(description.encode()).digest()[:7], "big")
    high = torch.tensor([code], dtype=torch.long, device=_device())
    low = high.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return high.item() == low.item()


def _layout(tensors: Iterable[Tensor], skip_rows: bool = False) -> str:
    """Dtype, shape and whether it is trainable (``requires_grad``), per tensor: ranks that freeze different
    parameters have different sets of θ* and groups, whose statistics must not be summed."""
    return ";".join(f"{t.dtype}:{tuple(t.shape[1:] if skip_rows else t.shape)}:{t.requires_grad}" for t in tensors)


def all_gather_rows(tensor: Tensor, enabled: bool = True) -> Tensor:
    """The concatenation along dimension 0 of every rank's ``tensor``, in rank order, on every rank.

    The ranks may hold different numbers of rows (the trailing shape and dtype must agree, or ``ValueError`` is
    raised on every rank, before any data are exchanged: a collective of mismatched sizes would abort the
    process or return garbage); ``bool`` tensors travel as ``uint8``. ``tensor`` itself in one process.
    """
    if not _active(enabled):
        return tensor
    if not _same_everywhere(_layout([tensor.detach()], skip_rows=True)):
        raise ValueError(
            f"a tensor gathered across ranks has dtype {tensor.dtype} and rows of shape {tuple(tensor.shape[1:])} "
            "here but not on every rank (e.g. float32 targets on one rank, float64 on another): every rank must "
            "pass data of the same dtype and shape per row"
        )
    sizes = torch.zeros(dist.get_world_size(), dtype=torch.long, device=_device())
    sizes[dist.get_rank()] = tensor.shape[0]
    all_reduce_sum(sizes)
    largest = int(sizes.max())
    send = tensor.detach().to(torch.uint8) if tensor.dtype == torch.bool else tensor.detach()
    padded = send.new_zeros((largest, *send.shape[1:]))
    padded[: send.shape[0]] = send
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, padded.contiguous())
    out = torch.cat([p[: int(s)] for p, s in zip(parts, sizes.tolist())])
    return out.to(torch.bool) if tensor.dtype == torch.bool else out


def broadcast_(tensors: Iterable[Tensor], source: int = 0, enabled: bool = True) -> None:
    """Overwrite every tensor, in place, with rank ``source``'s values (no-op in one process)."""
    if not _active(enabled):
        return
    with torch.no_grad():
        for t in tensors:
            if t.is_contiguous():
                dist.broadcast(t, src=source)
            else:
                tmp = t.contiguous()
                dist.broadcast(tmp, src=source)
                t.copy_(tmp)


def check_layout(tensors: Iterable[Tensor], what: str, enabled: bool = True) -> None:
    """Raise ``ValueError`` on every rank unless every rank passes tensors of the same number, shapes, dtypes and
    ``requires_grad`` flags (a digest compared by two ``all_reduce`` of one number). Call it before a
    ``broadcast`` or ``all_reduce`` of tensors that could differ: a collective of mismatched sizes aborts the
    process (gloo) or returns garbage."""
    if _active(enabled) and not _same_everywhere(_layout(list(tensors))):
        raise ValueError(
            f"{what} differ between ranks in number, shape, dtype or requires_grad; with distributed=True every "
            "rank must pass the same ones (as DistributedDataParallel needs): load the same checkpoint, in the "
            "same dtype and with the same parameters frozen, everywhere"
        )


def check_replicated(tensors: Iterable[Tensor], what: str, enabled: bool = True) -> None:
    """Raise on every rank unless every rank holds the same values (compared exactly with rank 0's).

    Args:
        tensors: e.g. the network's parameters and buffers.
        what: how errors name them (``"the network's weights"``).

    Raises:
        ValueError: on every rank, if any rank's values, shapes, dtypes or number of tensors differ from rank 0's
            (the layout is compared first, so that no collective of mismatched sizes is started).
    """
    if not _active(enabled):
        return
    tensors = list(tensors)
    check_layout(tensors, what)  # before detaching: which parameters are trainable is part of the layout
    tensors = [t.detach() for t in tensors]
    reference = [t.clone() for t in tensors]
    broadcast_(reference)
    differs = any(not torch.equal(a, b) for a, b in zip(tensors, reference))
    flag = torch.tensor([float(differs)], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        raise ValueError(
            f"{what} differ between ranks; with distributed=True every rank must hold the same network (as in "
            "DistributedDataParallel): load the same checkpoint or broadcast the weights from rank 0"
        )


def _any_failed(failed: bool) -> bool:
    flag = torch.tensor([float(failed)], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


@contextmanager
def together(what: str, enabled: bool = True) -> Iterator[None]:
    """Run a rank-local step (validation, a pass over the shard) so that a failure raises on **every** rank.

    A rank whose block raises tells the others (one small ``all_reduce``) and re-raises its error; the others
    raise ``RuntimeError`` naming ``what`` instead of waiting in the next collective forever. Every rank
    must enter the same ``together`` blocks in the same order.

    Raises:
        RuntimeError: on a rank whose own block succeeded when another rank's failed.
    """
    if not _active(enabled):
        yield
        return
    try:
        yield
    except Exception:
        _any_failed(True)
        raise
    if _any_failed(False):
        raise RuntimeError(f"{what} failed on another rank (its error is in that rank's output)")


def shard_range(num_rows: int, rank_: int | None = None, world: int | None = None) -> range:
    """The rows ``[start, stop)`` of ``num_rows`` that rank ``rank_`` (default: this rank) holds.

    Contiguous, in rank order, sizes differing by at most one: concatenated in rank order the shards are
    the data in their original order (so sums and gathered outputs match one process on all the data).
    """
    world = world_size() if world is None else world
    rank_ = rank() if rank_ is None else rank_
    if not (0 <= rank_ < world):
        raise ValueError(f"rank must be in [0, {world}), got {rank_}")
    base, extra = divmod(int(num_rows), world)
    start = rank_ * base + min(rank_, extra)
    return range(start, start + base + (rank_ < extra))


def shard(*tensors: Tensor, rank_: int | None = None, world: int | None = None) -> tuple[Tensor, ...] | Tensor:
    """This rank's rows (:func:`shard_range`) of each tensor (views; all must have the same row count).

    Example:
        >>> x_local, y_local = shard(x, y)   # under torchrun: rank r gets its contiguous part
    """
    if not tensors:
        raise ValueError("shard needs at least one tensor")
    n = tensors[0].shape[0]
    if any(t.shape[0] != n for t in tensors):
        raise ValueError(f"the tensors must have the same number of rows, got {[t.shape[0] for t in tensors]}")
    rows = shard_range(n, rank_, world)
    parts = tuple(t[rows.start : rows.stop] for t in tensors)
    return parts[0] if len(parts) == 1 else parts
