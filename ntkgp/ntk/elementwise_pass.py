r"""The NTK feature pass's part for the layer plan's elementwise layers (:attr:`LayerPlan.elementwise
<ntkgp.ntk.layer_plan.LayerPlan.elementwise>`: normalization layers' affine parameters and ``nn.Embedding`` tables,
:mod:`ntkgp.ntk.norm_features`), from the same forward pass and ``C`` backward passes as the ``Linear`` /
``Conv2d`` layers' features, with no per-example Jacobian of their own:

* a normalization layer's rows :math:`J_n^\top e_c` are :math:`\sum_t \hat x_{nt} \odot \Gamma_{nct}` for
  :math:`\gamma` and :math:`\sum_t \Gamma_{nct}` for :math:`\beta`, ``d`` numbers each: written per output column
  into ``(C, n, d)`` blocks and contracted as columns with the generic parameters (:mod:`ntkgp.ntk.contraction`);
  cost :math:`O(n d T)` per column;
* an embedding table's features are the sums of :math:`\Gamma_{nct}` per distinct (example, token) pair,
  :class:`~ntkgp.ntk.token_grams.TokenSums` ``(U, C, D)`` with :math:`U \le nT` (one ``index_add`` per column), whose
  Grams are Grams of equal tokens (:mod:`ntkgp.ntk.token_grams`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .features import Layer
from .norm_features import EmbeddingLayer
from .token_grams import TokenSums, token_keys


class ElementwiseReducer:
    """The ``reduce`` of the feature pass for elementwise layers (module docstring): keeps their results itself (the
    pass keeps nothing for them). With ``graph`` everything stays differentiable (out-of-place, stacked at the
    end).

    Args:
        group: each parameter's prior group.
        graph: keep the autograd graph.
    """

    def __init__(self, group: dict[str, int], graph: bool) -> None:
        self.group, self.graph = group, graph
        self.rows: dict[str, Tensor | list[Tensor]] = {}  # per parameter of a norm layer: (C, n, d) or its columns
        self.sums: dict[str, Tensor | list[Tensor]] = {}  # per table: (C, U, D) or its columns
        self.keys: dict[str, tuple[Tensor, ...]] = {}

    def __call__(self, layer: Layer, a: Tensor, g: Tensor, m: int, count: int) -> None:
        """Column ``m`` of ``count``: ``a`` the recorded inputs (:math:`\\hat x` ``(n, d, T)`` or token ids
        ``(n, T)``), ``g`` the gradients ``(n, d, T)``."""
        if isinstance(layer, EmbeddingLayer):
            if m == 0:
                self.keys[layer.weight] = token_keys(a, layer.module.num_embeddings)
            _, _, keep, inverse = self.keys[layer.weight]
            unique = self.keys[layer.weight][0].shape[0]
            values = g.transpose(1, 2).reshape(-1, g.shape[1])[keep]  # (n·T kept, D)
            if self.graph:
                self.sums.setdefault(layer.weight, []).append(
                    values.new_zeros(unique, values.shape[1]).index_add(0, inverse, values))
            else:
                if m == 0:
                    self.sums[layer.weight] = values.new_zeros(count, unique, values.shape[1])
                self.sums[layer.weight][m].index_add_(0, inverse, values)
            return
        for name, rows in layer.jacobians(a, g[:, None]).items():  # (n, 1, d)
            if self.graph:
                self.rows.setdefault(name, []).append(rows[:, 0])
            else:
                if m == 0:
                    self.rows[name] = rows.new_empty(count, rows.shape[0], rows.shape[2])
                self.rows[name][m] = rows[:, 0]
        return

    def pieces(self) -> dict[str, Tensor]:
        """The normalization layers' columns ``{name: (C, n, d)}``."""
        return {name: torch.stack(r) if isinstance(r, list) else r for name, r in self.rows.items()}

    def tokens(self) -> list[TokenSums]:
        """The tables' :class:`~ntkgp.ntk.token_grams.TokenSums`, in the order of the layers."""
        out = []
        for name, sums in self.sums.items():
            sums = torch.stack(sums) if isinstance(sums, list) else sums  # (C, U, D)
            examples, tokens, _, _ = self.keys[name]
            out.append(TokenSums(self.group[name], name, examples, tokens, sums.transpose(0, 1).contiguous()))
        return out


def token_numbers(layer: Layer, locations: int) -> int:
    """The numbers per example and output of an embedding layer's token sums, at most ``T·D`` (``T`` its
    locations); of a normalization layer's columns, its parameters' entries."""
    if isinstance(layer, EmbeddingLayer):
        return locations * layer.module.embedding_dim
    return sum(getattr(layer.module, k).numel() for k, n in (("weight", layer.weight), ("bias", layer.bias))
               if n is not None)
