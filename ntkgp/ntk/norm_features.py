r"""Normalization layers' affine parameters and ``nn.Embedding`` tables from the feature pass's own output
gradients: per-example gradients without a per-example backward pass.

**Normalization layers** (``nn.BatchNorm1d/2d/3d`` in eval mode with running statistics, ``nn.InstanceNorm1d/2d/3d``
in eval mode, ``nn.LayerNorm``, ``nn.RMSNorm`` (no :math:`\beta`), ``nn.GroupNorm``) compute :math:`z_{nt} = \gamma \odot \hat x_{nt} + \beta` elementwise over the affine
parameters' :math:`d` entries at each location :math:`t` (a spatial position, a sequence position), with
:math:`\hat x` the input normalized by the running statistics (BatchNorm in eval mode) or by the example's own
(LayerNorm, RMSNorm, GroupNorm; InstanceNorm without running statistics), which do not depend on :math:`\gamma, \beta`. So, with
:math:`\Gamma_{nmt} = \partial (u_{nm}^\top f_n) / \partial z_{nt}` from the same backward passes that serve the
``Linear`` / ``Conv2d`` layers,

.. math::
    J_n^\top u_{nm} \big|_\gamma = \sum_t \hat x_{nt} \odot \Gamma_{nmt}, \qquad
    J_n^\top u_{nm} \big|_\beta = \sum_t \Gamma_{nmt}

(``docs/curvature.md``, "Normalization and embedding layers"): :math:`2d` numbers per example and column, from
:math:`\hat x` (one normalization of the recorded input, by the module's own functional kernel without the affine
part) and :math:`\Gamma`.

**Embeddings** :math:`z_{nt} = E_{\mathrm{id}_{nt}}` (a row of the table :math:`E`, ``(V, D)``) have a one-hot
Jacobian: :math:`J_n^\top u_{nm} \big|_{E_v} = \sum_{t: \mathrm{id}_{nt} = v} \Gamma_{nmt}`, a scatter of the
output gradients by token id (``index_add``), never a dense ``(V, D)`` Jacobian per example; the token
``padding_idx`` gets no gradient (as autograd gives it).

Both are :class:`~ntkgp.ntk.features.Layer`\ s whose recorded "inputs" are :math:`\hat x` ``(n, d, T)`` or the
token ids ``(n, T)`` and whose gradients are :math:`\Gamma` ``(n, d, T)``; they are verified on a probe with the
layer plan's layers (:func:`~ntkgp.ntk.layer_plan.verify_layers`: structured per-example gradient equal to
autograd's, called on batched inputs) and are the plan's :attr:`~ntkgp.ntk.layer_plan.LayerPlan.elementwise` layers;
they take the generic per-example route otherwise. A module called several times per forward pass (an embedding
used for two sequences, weight sharing) sums its calls: its calls' locations are joined
(:attr:`~ntkgp.ntk.features.Layer.repeated`), :math:`T` the total over the calls. Which modules
qualify: the exact types above with a parameter in :math:`\theta` owned by no other module; not an
``nn.Embedding`` with ``max_norm`` (it renormalizes its table in the forward), ``scale_grad_by_freq`` or
``sparse`` gradients; not a BatchNorm in training mode or without running statistics (the examples of a batch
would interact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .features import Layer

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
#: The trailing normalized dimensions hold the parameters (the others: dimension 1, the channels).
TRAILING_NORMS = (nn.LayerNorm, nn.RMSNorm)
NORM_TYPES = (*BATCH_NORMS, *INSTANCE_NORMS, *TRAILING_NORMS, nn.GroupNorm)


@dataclass(frozen=True)
class ElementwiseLayer(Layer):
    r"""A layer whose per-example gradients are elementwise in the recorded features (module docstring): no
    Kronecker block, no bias folded into the inputs. :meth:`jacobians` gives the per-example rows,
    :meth:`squares` their squares summed over the examples."""

    repeated: ClassVar[bool] = True  # a sum over locations: several calls are more locations

    def fold(self, a: Tensor) -> Tensor:
        """The recorded features unchanged (there is no row of ones to fold in: the bias is not a column of a
        matrix product)."""
        return a

    def squares(self, inputs: Tensor, grads: Tensor, pairs: bool) -> dict[str, Tensor]:
        r""":math:`\sum_n (J_n^\top u_{na}) \odot (J_n^\top u_{nb})` per parameter, ``{name: (M^2 or M, numel)}``
        (all pairs with ``pairs``, else :math:`a = b`), for gradients ``(n, M, d, T)``."""
        out = {}
        for name, rows in self.jacobians(inputs, grads).items():  # (n, M, numel)
            out[name] = (torch.einsum("nap,nbp->abp", rows, rows).flatten(0, 1) if pairs
                         else rows.square().sum(dim=0))
        return out


@dataclass(frozen=True)
class NormLayer(ElementwiseLayer):
    r"""The affine parameters :math:`\gamma` (``weight``) and :math:`\beta` (``bias``) of a normalization layer;
    recorded inputs :math:`\hat x` ``(n, d, T)``, :math:`d` the parameters' number of entries."""

    @property
    def d_out(self) -> int:
        return (self.module.weight if self.module.weight is not None else self.module.bias).numel()

    def takes(self, inputs: object, n: int) -> bool:
        return torch.is_tensor(inputs) and inputs.dim() >= 2 and inputs.shape[0] == n and inputs.is_floating_point()

    def _layout(self, x: Tensor) -> Tensor:
        """``(n, d, T)`` from the input or output layout: channels in dimension 1 (BatchNorm, InstanceNorm,
        GroupNorm) or the trailing normalized dimensions (LayerNorm, RMSNorm)."""
        n = x.shape[0]
        if isinstance(self.module, TRAILING_NORMS):
            return x.reshape(n, -1, self.d_out).transpose(1, 2)
        return x.reshape(n, x.shape[1], -1)

    def recorded_inputs(self, inputs: Tensor) -> Tensor:
        r""":math:`\hat x` ``(n, d, T)``: the input normalized by the module's own kernel without the affine part."""
        m = self.module
        if isinstance(m, nn.LayerNorm):
            normalized = F.layer_norm(inputs, m.normalized_shape, None, None, m.eps)
        elif isinstance(m, nn.RMSNorm):
            normalized = F.rms_norm(inputs, m.normalized_shape, None, m.eps)
        elif isinstance(m, INSTANCE_NORMS):  # eval mode: the running statistics if tracked, else the example's
            tracked = m.track_running_stats
            normalized = F.instance_norm(inputs, m.running_mean if tracked else None, m.running_var if tracked else None,
                                         None, None, not tracked, 0.0, m.eps)
        elif isinstance(m, nn.GroupNorm):
            normalized = F.group_norm(inputs, m.num_groups, None, None, m.eps)
        else:
            normalized = F.batch_norm(inputs, m.running_mean, m.running_var, None, None, False, 0.0, m.eps)
        return self._layout(normalized)

    def recorded_gradients(self, grads: Tensor) -> Tensor:
        return self._layout(grads)

    def jacobians(self, inputs: Tensor, grads: Tensor) -> dict[str, Tensor]:
        r"""Per-example rows ``{name: (n, M, d)}`` for gradients ``(n, M, d, T)``: :math:`\gamma`:
        :math:`\sum_t \hat x_{nt} \odot \Gamma_{nmt}`, :math:`\beta`: :math:`\sum_t \Gamma_{nmt}`."""
        out = {}
        if self.weight is not None:
            out[self.weight] = torch.einsum("nmdt,ndt->nmd", grads, inputs)
        if self.bias is not None:
            out[self.bias] = grads.sum(dim=-1)
        return out


@dataclass(frozen=True)
class EmbeddingLayer(ElementwiseLayer):
    r"""The table :math:`E` ``(V, D)`` of an ``nn.Embedding``; recorded inputs: the token ids ``(n, T)``
    (``padding_idx`` replaced by ``-1``: no gradient), gradients :math:`\Gamma` ``(n, D, T)``."""

    def takes(self, inputs: object, n: int) -> bool:
        return torch.is_tensor(inputs) and inputs.dim() >= 1 and inputs.shape[0] == n and not (
            inputs.is_floating_point() or inputs.is_complex())

    def recorded_inputs(self, inputs: Tensor) -> Tensor:
        ids = inputs.reshape(inputs.shape[0], -1)
        padding = self.module.padding_idx
        return ids if padding is None else ids.masked_fill(ids == padding, -1)

    def recorded_gradients(self, grads: Tensor) -> Tensor:
        return grads.reshape(grads.shape[0], -1, grads.shape[-1]).transpose(1, 2)

    def _token_sums(self, ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
        r"""The distinct (example, token) pairs present, as token ids ``(U,)``, and
        :math:`\sum_{t: \mathrm{id}_{nt} = v} \Gamma_{nmt}` for each, ``(U, M, D)``: one ``index_add`` over the
        :math:`nT` locations (padding tokens dropped)."""
        n, m, d, t = grads.shape
        vocab = self.module.num_embeddings
        keep = (ids >= 0).reshape(-1)
        keys = (torch.arange(n, device=ids.device)[:, None] * vocab + ids).reshape(-1)[keep]
        unique, inverse = torch.unique(keys, return_inverse=True)
        values = grads.permute(0, 3, 1, 2).reshape(n * t, m, d)[keep]
        sums = torch.zeros(unique.shape[0], m, d, dtype=grads.dtype, device=grads.device).index_add_(0, inverse, values)
        return unique % vocab, sums

    def jacobians(self, inputs: Tensor, grads: Tensor) -> dict[str, Tensor]:
        r"""Per-example rows ``{weight: (n, M, V·D)}`` (dense: for the probe's check of one example only)."""
        n, m, d, _ = grads.shape
        vocab = self.module.num_embeddings
        out = torch.zeros(n, vocab, m, d, dtype=grads.dtype, device=grads.device)
        keep = inputs >= 0
        values = grads.permute(0, 3, 1, 2) * keep[..., None, None]  # (n, T, M, D)
        out.scatter_add_(1, inputs.clamp_min(0)[..., None, None].expand_as(values), values)
        return {self.weight: out.permute(0, 2, 1, 3).reshape(n, m, vocab * d)}

    def squares(self, inputs: Tensor, grads: Tensor, pairs: bool) -> dict[str, Tensor]:
        r""":math:`\sum_n \big(\sum_{t: \mathrm{id}_{nt} = v} \Gamma_{nat}\big) \odot
        \big(\sum_{t: \mathrm{id}_{nt} = v} \Gamma_{nbt}\big)` row by row of the table, ``(M^2 or M, V·D)``:
        memory :math:`O(n T M D)` (:math:`O(n T M^2 D)` with ``pairs``), never a per-example table."""
        tokens, sums = self._token_sums(inputs, grads)  # (U,), (U, M, D)
        d, vocab = sums.shape[2], self.module.num_embeddings
        products = torch.einsum("uad,ubd->uabd", sums, sums).flatten(1, 2) if pairs else sums.square()
        table = torch.zeros(vocab, products.shape[1], d, dtype=sums.dtype, device=sums.device)
        table.index_add_(0, tokens, products)
        return {self.weight: table.permute(1, 0, 2).reshape(products.shape[1], vocab * d)}


def _owned_once(net: nn.Module) -> dict[int, int]:
    owners: dict[int, int] = {}
    for module in net.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    return owners


def elementwise_candidates(net: nn.Module, names: Sequence[str]) -> list[ElementwiseLayer]:
    """Every normalization layer and ``nn.Embedding`` (exact types, module docstring) with a parameter in
    ``names`` owned by no other module, in module order."""
    chosen, owners = set(names), _owned_once(net)
    out: list[ElementwiseLayer] = []
    for name, module in net.named_modules():
        kind = type(module)
        if kind in NORM_TYPES:
            if kind in BATCH_NORMS and (module.training or module.running_mean is None or module.running_var is None):
                continue
            if kind in INSTANCE_NORMS and module.training:  # would update its running statistics
                continue
            cls, keys = NormLayer, ("weight",) if kind is nn.RMSNorm else ("weight", "bias")
        elif kind is nn.Embedding:
            if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
                continue
            cls, keys = EmbeddingLayer, ("weight",)
        else:
            continue
        prefix = f"{name}." if name else ""
        found = {k: prefix + k for k in keys if prefix + k in chosen}
        if not found or any(owners[id(getattr(module, k))] > 1 for k in keys if getattr(module, k) is not None):
            continue
        out.append(cls(name, module, found.get("weight"), found.get("bias")))
    return out


def elementwise_layers(core, names: Sequence[str], probe: Tensor) -> list[ElementwiseLayer]:
    """The candidates among ``names`` (:func:`elementwise_candidates`) whose structured per-example gradient
    equals autograd's on ``probe`` (one prepared example): the layer plan's elementwise layers
    (:meth:`NetworkCore.layer_plan <ntkgp.ntk.network.NetworkCore.layer_plan>`, verified once per architecture of the
    network and input signature), restricted to the parameters ``names``.

    Args:
        core: the :class:`~ntkgp.ntk.network.NetworkCore` (its network, private copy and parameters).
        names: the parameters that may take this route.
        probe: ``(1, ...)``.
    """
    chosen = set(names)
    out = []
    for layer in core.layer_plan(probe).elementwise:
        weight = layer.weight if layer.weight in chosen else None
        bias = layer.bias if layer.bias in chosen else None
        if weight is not None or bias is not None:
            out.append(type(layer)(layer.name, layer.module, weight, bias))
    return out
