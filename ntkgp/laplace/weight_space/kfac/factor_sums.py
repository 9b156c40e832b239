r"""Running sums of the KFAC factors over the data: one batch's layer features reduced as they come.

For a layer with inputs :math:`a_{nt}` (``(n, d_{in}, T)``: unfolded patches of a convolution) and output
gradients :math:`\Gamma_{nmt}` of the cotangent columns :math:`m`, the factors of
:mod:`~ntkgp.laplace.weight_space.kfac.curvature` are the sums

.. math::
    A = \begin{bmatrix} \sum a a^\top & \sum a \\ \sum a^\top & N T \end{bmatrix}, \qquad
    G_k = \sum_n \sum_{m \in k} \sum_t \Gamma_{nmt} \Gamma_{nmt}^\top

(the bias row and column only with a trainable bias). They are formed without the folded
:math:`\bar a = [a; 1]` nor the stacked :math:`\Gamma` of all columns: each column's gradient is reduced to
its ``(d_out, d_out)`` product as soon as the backward pass returns it (the ``reduce`` hook of
:func:`ntkgp.ntk.features.layer_features`), so a batch holds one column's gradients at a time; the inputs of a
layer with one location (``nn.Linear`` on ``(N, d)``) are gathered over batches into ``rows`` rows, so that
:math:`\sum a a^\top` is one product of ``rows`` rows, of which only the blocks on and above the diagonal are
computed for wide layers (a symmetric product, about :math:`(k + 1)/(2k)` of the multiply-adds with ``k``
blocks). Each batch's products are in the network's dtype; the running sums are in float64 (rounded to the
network's dtype once, at the end).

Cost per example: :math:`T d_{in}^2` for :math:`A` and :math:`M T d_{out}^2` for :math:`G` per layer, besides the
forward and :math:`M` backward passes; memory: the float64 sums :math:`O(\sum_l d_a^2 + K d_{out}^2)`, the
gathered rows ``rows · d_in`` per single-location layer, and one column's gradients of a batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ....ntk.features import Layer

#: Examples of a single-location layer's inputs gathered before one product :math:`X^\top X`.
ROWS = 1024


def _from_upper_blocks(d: int, k: int, block, like: Tensor) -> Tensor:
    """A symmetric ``(d, d)`` matrix from its ``k × k`` blocks on and above the diagonal, ``block(rows, cols)``
    (slices), the others mirrored."""
    if k == 1:
        return block(slice(None), slice(None))
    edges = [round(i * d / k) for i in range(k + 1)]
    out = torch.empty(d, d, dtype=like.dtype, device=like.device)
    for i in range(k):
        rows = slice(edges[i], edges[i + 1])
        for j in range(i, k):
            cols = slice(edges[j], edges[j + 1])
            part = block(rows, cols)
            out[rows, cols] = part
            if j > i:
                out[cols, rows] = part.T
    return out


def symmetric_gram(x: Tensor) -> Tensor:
    r""":math:`X^\top X` of ``x`` ``(K, d)``: the blocks on and above the diagonal by matrix products (up to 4
    blocks a side, ``d ≥ 1024``), the others mirrored."""
    d = x.shape[1]
    if d < 1024:  # one block
        return x.T @ x
    return _from_upper_blocks(d, min(4, d // 512), lambda rows, cols: x[:, rows].T @ x[:, cols], x)


def location_gram(x: Tensor, chunk: int = 64) -> Tensor:
    r""":math:`\sum_n \sum_t x_{nt} x_{nt}^\top` of ``x`` ``(n, d, T)``, ``(d, d)``: batched products of ``chunk``
    examples at a time (no transposed copy of ``x``); for ``d ≥ 256`` only the blocks on and above the diagonal
    (up to 4 a side, at least 128 rows each), the others mirrored."""

    def block(rows: slice, cols: slice) -> Tensor:
        out = None
        for part in x.split(chunk):
            gram = torch.bmm(part[:, rows], part[:, cols].mT).sum(dim=0)
            out = gram if out is None else out.add_(gram)
        return out

    d = x.shape[1]
    return _from_upper_blocks(d, max(1, min(4, d // 128)), block, x)


class FactorSums:
    r"""The float64 running sums :math:`A_l` and :math:`G_{lk}` of ``layers`` (module docstring).

    Args:
        layers: the structured layers (each with a weight).
        num_components: ``K``, the likelihood's number of output-scale components: 1 (one sum over the columns)
            or the number of cotangent columns (one sum per column).
        rows: examples gathered before the product of a single-location layer's inputs (:data:`ROWS`).
        reduce_locations: KFAC-reduce (Eschenhagen et al. 2023): each example's locations reduced before the
            products, :math:`a_n = T^{-1} \sum_t a_{nt}` and :math:`\Gamma_{nm} = \sum_t \Gamma_{nmt}` (one
            location per example); otherwise KFAC-expand (every location a term of the sums).
    """

    def __init__(self, layers: list[Layer], num_components: int, rows: int | None = None,
                 reduce_locations: bool = False) -> None:
        self.layers = layers
        self.reduce_locations = reduce_locations
        self.num_components = num_components
        self.rows = ROWS if rows is None else rows
        self.inputs: dict[str, Tensor] = {}  # A, (d_a, d_a): Σ a aᵀ, bordered by Σ a (and the count) with a bias
        self.outputs: dict[str, Tensor] = {}  # (K, d_out, d_out)
        self.locations: dict[str, int] = {layer.name: 0 for layer in layers}
        self.pending: dict[str, list[Tensor]] = {layer.name: [] for layer in layers}

    def _add_inputs(self, layer: Layer, gram: Tensor, total: Tensor) -> None:
        r""":math:`\sum a a^\top` ``gram`` and :math:`\sum a` ``total`` of some inputs added to the float64
        :math:`A` in place (a float32 product promoted as it is added: no float64 copy of it, nor of :math:`A`)."""
        d = gram.shape[0]
        if layer.name not in self.inputs:
            d_a = d + (layer.bias is not None)
            self.inputs[layer.name] = torch.zeros(d_a, d_a, dtype=torch.float64, device=gram.device)
        a = self.inputs[layer.name]
        a[:d, :d].add_(gram)
        if layer.bias is not None:
            a[:d, d].add_(total)
            a[d, :d].add_(total)

    def reduce(self, layer: Layer, a: Tensor, g: Tensor, m: int, count: int) -> None:
        r"""The ``reduce`` hook of the feature pass: column ``m`` of ``count``'s gradients ``g``
        ``(n, d_out, T)`` added to :math:`G` (kept by this object: returns ``None``)."""
        if self.reduce_locations and g.shape[-1] != 1:
            g = g.sum(dim=-1, keepdim=True)
        gram = g[..., 0].T @ g[..., 0] if g.shape[-1] == 1 else location_gram(g)
        k = m if self.num_components == count else 0
        if layer.name not in self.outputs:
            d = gram.shape[0]
            self.outputs[layer.name] = torch.zeros(self.num_components, d, d, dtype=torch.float64, device=g.device)
        self.outputs[layer.name][k].add_(gram)
        return None

    def add_inputs(self, inputs: dict[str, Tensor]) -> None:
        """One batch's layer inputs ``(n, d_in, T)`` (unfolded, without the row of ones) added to :math:`A`."""
        for layer in self.layers:
            a = inputs[layer.name]
            if self.reduce_locations and a.shape[2] != 1:
                a = a.mean(dim=2, keepdim=True)
            self.locations[layer.name] += a.shape[0] * a.shape[2]
            if a.shape[2] == 1:
                self.pending[layer.name].append(a[..., 0])
                if sum(p.shape[0] for p in self.pending[layer.name]) >= self.rows:
                    self._flush(layer)
            else:
                self._add_inputs(layer, location_gram(a), a.sum(dim=(0, 2)))

    def _flush(self, layer: Layer) -> None:
        pending = self.pending[layer.name]
        if not pending:
            return
        x = torch.cat(pending) if len(pending) > 1 else pending[0]
        pending.clear()
        self._add_inputs(layer, symmetric_gram(x), x.sum(dim=0))

    def factors(self) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, int]]:
        r"""Per layer :math:`A` ``(d_a, d_a)`` (with the bias row and column when the bias is trainable),
        :math:`\sum_n \sum_t` of :math:`G_k` ``(K, d_out, d_out)`` (not yet divided by the locations), in float64,
        and the number of locations :math:`N T_l`."""
        a_out, g_out = {}, {}
        for layer in self.layers:
            self._flush(layer)
            name = layer.name
            a = self.inputs[name]
            if layer.bias is not None:
                a[-1, -1] = float(self.locations[name])
            a_out[name], g_out[name] = a, self.outputs[name]
        return a_out, g_out, dict(self.locations)
