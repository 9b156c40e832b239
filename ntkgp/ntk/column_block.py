r"""The contracted columns of many chunks in one tensor per group, ``{group: (n, C, P_g)}`` (:class:`ColumnBlock`):
each chunk's multi-location blocks written in place by its feature pass (``chunk_features(..., into=)``), the other
pieces copied. The held columns of a :class:`~ntkgp.ntk.feature_pass.FeatureSet` and the windows of
:mod:`~ntkgp.ntk.feature_windows` are such blocks."""

from __future__ import annotations

import torch
from torch import Tensor

from .held_features import ChunkFeatures, Contracted
from .layer_plan import LayerPlan
from .network import NetworkCore

__all__ = ["ColumnBlock"]


def _block_offsets(plan: LayerPlan, group: dict[str, int], numel: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """``{layer: (group, start, d_out)}``: where each multi-location layer's blocks lie in its group's columns (they
    come first, in the plan's order: :func:`~ntkgp.ntk.feature_pass.chunk_features`); empty where a layer's weight and
    bias are in two groups."""
    out, start = {}, {}
    for layer in (la for la in plan.layers if la in plan.multi):
        groups = {group[k] for k in layer.parameter_names}
        if len(groups) != 1:
            return {}
        g = groups.pop()
        out[layer.name] = (g, start.get(g, 0), layer.d_out)
        start[g] = start.get(g, 0) + sum(numel[k] for k in layer.parameter_names)
    return out


def _group_widths(plan: LayerPlan, group: dict[str, int], numel: dict[str, int]) -> dict[int, int]:
    """``{group: P_g}``: the contracted columns of each group (multi-location layers, normalization layers' and
    generic parameters; no embedding tables)."""
    names = [*plan.generic, *(k for la in plan.multi for k in la.parameter_names),
             *(k for la in plan.elementwise for k in la.parameter_names)]
    widths: dict[int, int] = {}
    for name in names:
        widths[group[name]] = widths.get(group[name], 0) + numel[name]
    return dict(sorted(widths.items()))


def _block_targets(plan: LayerPlan, block: dict[int, Tensor], offsets: dict[str, tuple[int, int, int]], s: int,
                   e: int) -> dict[str, Tensor]:
    """Per multi-location layer, the ``(C, n, d_out, d_a)`` view of its columns in the rows ``s:e`` of ``block``
    (``{group: (N, C, P_g)}``), for :func:`~ntkgp.ntk.feature_pass.chunk_features` to write its blocks into."""
    out = {}
    for layer in (la for la in plan.layers if la in plan.multi and la.name in offsets):
        g, start, d_out = offsets[layer.name]
        rows = block[g][s:e].transpose(0, 1)  # (C, n, P_g)
        stop = start + (layer.fan_in + (layer.bias is not None)) * d_out
        out[layer.name] = rows[..., start:stop].unflatten(-1, (d_out, -1))
    return out


class ColumnBlock:
    """One tensor per group ``{group: (n, C, P_g)}`` for the contracted columns of ``n`` points, chunk after chunk:
    each chunk's multi-location blocks written in place by the pass (:meth:`targets`, where the block is in the
    network's dtype), the other pieces copied (:meth:`join`). The held columns of a
    :class:`~ntkgp.ntk.feature_pass.FeatureSet` and the windows of :mod:`~ntkgp.ntk.feature_windows`."""

    def __init__(self, core: NetworkCore, plan: LayerPlan, n: int, c: int, dtype: torch.dtype) -> None:
        group, numel = dict(zip(core.groups.names, core.groups.group_of)), dict(zip(core.names, core.numels))
        self.plan, self.n, self.c, self.dtype, self.device, self.checked = plan, n, c, dtype, core.device, False
        self.block = {g: torch.empty(n, c, width, dtype=dtype, device=core.device)
                      for g, width in _group_widths(plan, group, numel).items()}
        self.offsets = _block_offsets(plan, group, numel) if dtype == core.dtype else {}

    def targets(self, s: int, e: int) -> dict[str, Tensor] | None:
        """``chunk_features(..., into=)`` for the rows ``s:e``."""
        return _block_targets(self.plan, self.block, self.offsets, s, e) if self.offsets else None

    def join(self, f: ChunkFeatures, s: int) -> Contracted:
        """The chunk's columns in the rows ``s:s + n`` (views of the block, ``(n·C, P_g)``)."""
        if not self.checked:  # the widths checked at the first chunk
            widths = {g: sum(p.shape[-1] for p in parts) for g, parts in f.pieces.items()}
            if widths != {g: cols.shape[-1] for g, cols in self.block.items()}:  # copied, not in place
                self.block = {g: torch.empty(self.n, self.c, w, dtype=self.dtype, device=self.device)
                              for g, w in widths.items()}
                self.offsets = {}
            self.checked = True
        return f.join_into(self.block, s)

    def columns(self) -> Contracted:
        """All the block's columns, ``{group: (n·C, P_g)}`` (rows ``n·C + c``)."""
        return Contracted({g: cols.view(-1, cols.shape[-1]) for g, cols in self.block.items()})
