r"""The exact GGN diagonal of normalization layers' affine parameters and embedding tables from the curvature
pass's own output gradients (:mod:`ntkgp.ntk.norm_features`): no per-example backward pass for them.

For such a layer the per-example rows :math:`J_n^\top u_{nm}` are elementwise in the recorded features
(:math:`\sum_t \hat x_{nt} \odot \Gamma_{nmt}` and :math:`\sum_t \Gamma_{nmt}` for :math:`\gamma, \beta`; a scatter
of :math:`\Gamma_{nmt}` by token id for a table), so the diagonal
:math:`\sum_n \sum_m (J_n^\top u_{nm})^{\odot 2}` is formed from the same forward pass and :math:`M` backward passes
that give the ``Linear`` / ``Conv2d`` layers' features (KFAC's factors, the diagonal GGN's rows). Cost per example
and column: :math:`O(d T)` for a normalization layer (:math:`d` channels, :math:`T` locations), :math:`O(T D)` for
an embedding; memory: the float64 sums, :math:`K P_{\text{layer}}`. Layers that fail the probe's check take the
per-example route.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ....ntk.norm_features import ElementwiseLayer, elementwise_layers
from ...ggn.data_pass import DataPass

__all__ = ["DiagonalSums", "diagonal_layers"]


def diagonal_layers(data: DataPass, names: list[str], probe: Tensor) -> list[ElementwiseLayer]:
    """The normalization and embedding layers whose parameters (all in ``names``) take the structured route,
    verified on ``probe`` (one prepared example, :func:`~ntkgp.ntk.norm_features.elementwise_layers`)."""
    if not names:
        return []
    return elementwise_layers(data.core, names, probe)


class DiagonalSums:
    r"""Float64 running sums :math:`D_k = \sum_n \sum_{m \in k} (J_n^\top u_{nm})^{\odot 2}` of elementwise layers,
    filled by the feature pass's ``reduce`` hook one cotangent column at a time (module docstring).

    Args:
        num_components: ``K``: 1 (one sum over the columns) or the number of columns (one sum per column).
    """

    def __init__(self, num_components: int) -> None:
        self.num_components = num_components
        self.layers: list[ElementwiseLayer] = []
        self.sums: dict[str, Tensor] = {}

    @property
    def names(self) -> set[str]:
        """The parameters of :attr:`layers`."""
        return {n for layer in self.layers for n in layer.parameter_names}

    def reduce(self, layer: ElementwiseLayer, a: Tensor, g: Tensor, m: int, count: int) -> None:
        """Column ``m`` of ``count``'s gradients ``g`` ``(n, d, T)`` of ``layer`` added to the sums (returns
        ``None``: nothing is kept by the feature pass)."""
        k = m if self.num_components == count else 0
        for name, values in layer.squares(a, g.unsqueeze(1), pairs=False).items():  # (1, numel)
            if name not in self.sums:
                self.sums[name] = torch.zeros(self.num_components, values.shape[-1], dtype=torch.float64,
                                              device=values.device)
            self.sums[name][k].add_(values[0])
        return None

    def routed(self, reduce):
        """A ``reduce`` hook that sends the elementwise layers here and every other layer to ``reduce``."""

        def hook(layer, a, g, m, count):
            if isinstance(layer, ElementwiseLayer):
                return self.reduce(layer, a, g, m, count)
            return reduce(layer, a, g, m, count)

        return hook

    def merge(self, data: DataPass, names: list[str], generic: list[str], generic_total: Tensor | int) -> Tensor:
        r"""The components ``(K, P_names)`` in the order of ``names``: these sums for :attr:`names`, the columns
        of ``generic_total`` ``(K, P_generic)`` (``generic`` in their order) for the others."""
        numels = {n: data.params[n].numel() for n in names}
        own = self.names
        parts, start = [], 0
        for name in names:
            if name in own:
                value = self.sums.get(name)
                parts.append(torch.zeros(self.num_components, numels[name], dtype=torch.float64,
                                         device=data.core.device) if value is None else value)
            else:
                parts.append(generic_total[:, start : start + numels[name]].to(torch.float64))
                start += numels[name]
        if start != sum(numels[n] for n in generic):
            raise RuntimeError("internal error: the generic parameters and their diagonal do not match")
        out = torch.cat(parts, dim=1) if parts else torch.zeros(self.num_components, 0, dtype=torch.float64)
        return out.to(dtype=data.core.dtype)
