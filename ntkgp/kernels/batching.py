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
from dataclasses import dataclass

import torch


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
    """Split ``x`` of shape ``(*batch, N, D)`` into its distinct slices (by value, unless a graph to ``x`` is needed)."""
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
    """``pieces[index]`` of shape ``(*index.shape, *pieces.shape[1:])``, without a copy when one piece serves all."""
    if pieces.shape[0] == 1:
        return pieces[0].expand(*index.shape, *pieces.shape[1:])
    return pieces[index.reshape(-1)].view(*index.shape, *pieces.shape[1:])


def slice_pairs(index1: torch.Tensor, index2: torch.Tensor, batch: torch.Size) -> tuple[list[tuple[int, int]], torch.Tensor]:
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
