"""Batch bookkeeping for :class:`~ntkgp.kernels.NTKKernel`: compute each distinct input slice once.

GPyTorch hands a kernel inputs ``(*batch, N, D)`` whose batch slices are often identical: the training
inputs expanded against a batch of test points, or a whole covariance re-evaluated on a repeated input
when per-point blocks are read. The NTK's per-group pieces (Jacobians, Grams, per-point blocks) are
computed once per *distinct* slice (or pair of slices) on the flattened union of their rows and then
gathered back to the batch shape, with ``expand`` (no copy) when a single slice serves the whole batch.

Slices are compared by value, except when a graph to the input is being recorded (it requires grad and
grad mode is on): then every slice is kept, so that each batch element's rows carry their own graph to
the user's tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..memory import STACKED_GRAM_BYTES, chunk_rows


@dataclass(frozen=True)
class Slices:
    """The distinct ``(N, D)`` slices of an input ``(*batch, N, D)``.

    Attributes:
        values: the distinct slices, shape ``(U, N, D)``.
        index: for every batch element, the slice it holds: a ``long`` tensor of shape ``batch``.
    """

    values: torch.Tensor
    index: torch.Tensor

    @property
    def rows(self) -> torch.Tensor:
        """All rows of the distinct slices, ``(U·N, D)``: what the engine is called on."""
        return self.values.reshape(-1, self.values.shape[-1])


def tracks_grad(x: torch.Tensor) -> bool:
    """Whether results computed from ``x`` must carry a graph to it."""
    return x.requires_grad and torch.is_grad_enabled()


def distinct_slices(x: torch.Tensor) -> Slices:
    """Split ``x`` ``(*batch, N, D)`` into distinct slices (by value, unless a graph to ``x`` is needed)."""
    batch = x.shape[:-2]
    n, d = x.shape[-2:]
    count = math.prod(batch)
    device = x.device
    if count <= 1 or tracks_grad(x):
        return Slices(x.reshape(count, n, d), torch.arange(count, device=device).view(batch))
    if all(stride == 0 or size == 1 for stride, size in zip(x.stride()[:-2], batch)):
        # an expanded input (the training inputs broadcast against a batch): one slice, no copy
        return Slices(x[(0,) * len(batch)].unsqueeze(0), torch.zeros(batch, dtype=torch.long, device=device))
    values, inverse = torch.unique(x.reshape(count, n * d), dim=0, return_inverse=True)
    return Slices(values.view(-1, n, d), inverse.view(batch))


def gather(pieces: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``pieces[index]``, shape ``(*index.shape, *pieces.shape[1:])``; no copy when one piece serves all."""
    if pieces.shape[0] == 1:
        return pieces[0].expand(*index.shape, *pieces.shape[1:])
    return pieces[index.reshape(-1)].view(*index.shape, *pieces.shape[1:])


def slice_pairs(
    index1: torch.Tensor, index2: torch.Tensor, batch: torch.Size
) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The distinct pairs ``(slice of x1, slice of x2)`` met over the broadcast ``batch``.

    Returns:
        The pairs, and for every batch element the position of its pair in that list (shape ``batch``).
    """
    i1 = index1.expand(batch).reshape(-1)
    i2 = index2.expand(batch).reshape(-1)
    width = int(i2.max()) + 1
    codes, inverse = torch.unique(i1 * width + i2, return_inverse=True)
    pairs = [(code // width, code % width) for code in codes.tolist()]
    return pairs, inverse.view(batch)


def group_pairs(pairs: list[tuple[int, int]]) -> tuple[int, dict[int, list[int]]]:
    """Group the pairs by the side with fewer distinct slices, so that one engine call serves each group.

    Returns:
        ``(side, groups)``: ``side`` is 1 or 2, the side held fixed; ``groups`` maps each slice of that side
        to the partner slices of the other side (every row of the stacked partners is needed against it).
    """
    firsts = {a for a, _ in pairs}
    seconds = {b for _, b in pairs}
    side = 2 if len(seconds) <= len(firsts) else 1
    groups: dict[int, list[int]] = {}
    for a, b in pairs:
        fixed, partner = (b, a) if side == 2 else (a, b)
        groups.setdefault(fixed, []).append(partner)
    return side, groups


def _stack(pieces: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack``, without copying a single piece (a Gram can be most of the memory in use)."""
    return pieces[0].unsqueeze(0) if len(pieces) == 1 else torch.stack(pieces)


def pair_grams(
    grams: Callable[..., torch.Tensor], s1: Slices, s2: Slices, square: bool, entries_per_point_pair: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group Grams of each distinct pair of slices, ``(pairs, G, N1·C, N2·C)``, and each batch
    element's pair.

    Two ways to batch the calls of ``grams`` (``grams(x)``: the symmetric ``(G, N·C, N·C)``;
    ``grams(x1, x2)``: ``(G, N1·C, N2·C)``), whichever makes fewer calls: group the pairs by the side with
    fewer distinct slices (one call per slice of that side against all its partners stacked: nothing
    computed in vain), or stack ``k`` pairs on both sides and keep the diagonal blocks of one Gram (``k``
    times the work, at most :data:`ntkgp.memory.STACKED_GRAM_BYTES` per call: many small slices, such as
    BoTorch's ``(b, q, d)`` candidates, then cost one call instead of ``b``).

    Args:
        grams: the (cached) engine Gram.
        s1, s2: the distinct slices of ``x1`` and ``x2`` (the same object when ``square``).
        square: ``x1`` is ``x2``: every pair is a slice with itself.
        entries_per_point_pair: ``G·C²``, the Gram entries one pair of points costs.
    """
    if square:
        pairs, pair_index = [(u, u) for u in range(s1.values.shape[0])], s1.index
    else:
        pairs, pair_index = slice_pairs(
            s1.index, s2.index, torch.broadcast_shapes(s1.index.shape, s2.index.shape)
        )
    n1, n2 = s1.values.shape[1], s2.values.shape[1]
    side, groups = group_pairs(pairs)
    dtype = s1.values.dtype if s1.values.is_floating_point() else torch.float64  # the Grams' dtype
    k = math.isqrt(chunk_rows(STACKED_GRAM_BYTES, entries_per_point_pair * n1 * n2, dtype))  # k² pairs
    if -(-len(pairs) // k) < len(groups):
        return _stack(_stacked_pair_grams(grams, pairs, s1, s2, square, k)), pair_index
    d = s1.values.shape[-1]
    found: dict[tuple[int, int], torch.Tensor] = {}
    for fixed, partners in groups.items():
        if square:  # (u, u): the symmetric Gram of one slice
            found[(fixed, fixed)] = grams(s1.values[fixed])
        elif side == 2:
            g = grams(s1.values[partners].reshape(-1, d), s2.values[fixed])  # (G, k·N1·C, N2·C)
            g = g.view(g.shape[0], len(partners), -1, g.shape[-1])
            for i, partner in enumerate(partners):
                found[(partner, fixed)] = g[:, i]
        else:
            g = grams(s1.values[fixed], s2.values[partners].reshape(-1, d))  # (G, N1·C, k·N2·C)
            g = g.view(*g.shape[:2], len(partners), -1)
            for i, partner in enumerate(partners):
                found[(fixed, partner)] = g[:, :, i]
    return _stack([found[p] for p in pairs]), pair_index


def _stacked_pair_grams(
    grams: Callable[..., torch.Tensor],
    pairs: list[tuple[int, int]],
    s1: Slices,
    s2: Slices,
    square: bool,
    k: int,
) -> list[torch.Tensor]:
    """The pairs' Grams as diagonal blocks of Grams of ``k`` stacked pairs at a time."""
    d = s1.values.shape[-1]
    out: list[torch.Tensor] = []
    for start in range(0, len(pairs), k):
        chunk = pairs[start : start + k]
        rows1 = s1.values[[a for a, _ in chunk]].reshape(-1, d)
        g = grams(rows1) if square else grams(rows1, s2.values[[b for _, b in chunk]].reshape(-1, d))
        g = g.view(g.shape[0], len(chunk), g.shape[1] // len(chunk), len(chunk), g.shape[2] // len(chunk))
        out.extend(g.diagonal(dim1=1, dim2=3).movedim(-1, 0).unbind(0))  # each (G, N1·C, N2·C)
    return out
