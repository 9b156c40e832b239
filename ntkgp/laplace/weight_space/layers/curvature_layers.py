r"""The curvature's layers: ntkgp's one layer plan (:mod:`ntkgp.ntk.layer_plan`) with the bias folded into the
input, :math:`\bar a = [a; 1]`.

For a layer :math:`z_{nt} = \Theta \bar a_{nt}`, :math:`\Theta = [W \mid b]` (convolution: on unfolded patches,
:math:`t` the spatial location; linear layer: :math:`t` the extra input dimensions, one location for
``(N, d)`` inputs), the per-example vector-Jacobian product is

.. math::
    J_n^\top u_{nm} \big|_\Theta = \sum_t \Gamma_{nmt} \bar a_{nt}^\top, \qquad
    \Gamma_{nmt} = \partial (u_{nm}^\top f_n) / \partial z_{nt},

so the layer's curvature needs :math:`\bar a` and :math:`\Gamma` only, never the Jacobian. Which layers take
this form is decided by the one safety rule (the NTK engine uses the same); the curvature additionally needs
a trainable weight (a layer with only a trainable bias takes the per-example route) and, for KFAC, weight and
bias in one prior group.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from ....ntk import ParameterGroups
from ....ntk.features import Layer
from ....ntk.layer_plan import candidate_layers
from ....ntk.network import NetworkCore
from ...ggn.data_pass import DataPass

__all__ = ["Layer", "layer_features", "structured_layers", "usable_layers"]


def structured_layers(net: nn.Module, groups: ParameterGroups, strict: bool) -> list[Layer]:
    """Every ``nn.Linear`` / ``nn.Conv2d`` (exact types) with a trainable weight, in module order.

    With ``strict`` (KFAC) an unsupported layer raises: ``ValueError`` when its weight is shared with another
    module or its weight and bias are in different prior groups, ``NotImplementedError`` for convolutions with
    ``groups > 1``. Otherwise such layers are left out (their
    parameters take the generic per-example route).
    """
    layers, problems = candidate_layers(net, groups.names)
    if strict and problems:
        problem = next(iter(problems.values()))
        raise type(problem)(f"KFAC: {problem}")
    index = dict(zip(groups.names, groups.group_of))
    keep = []
    for layer in layers:
        if layer.weight is None:
            continue
        if strict and layer.bias is not None and index[layer.bias] != index[layer.weight]:
            raise ValueError(
                f"KFAC treats the weight and bias of layer '{layer.name}' as one Kronecker block, so they need one "
                f"prior precision: they are in groups '{groups.group_names[index[layer.weight]]}' and "
                f"'{groups.group_names[index[layer.bias]]}'. Use prior_structure='layer' or 'network'"
            )
        keep.append(layer)
    return keep


def layer_features(
    data: DataPass, layers: list[Layer], x: Tensor, cotangents: Tensor
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    r"""One batch's layer inputs :math:`\bar a` ``(n, d_a, T)`` and output gradients :math:`\Gamma`
    ``(n, M, d_out, T)`` for the cotangents :math:`u_{nm}` ``(n, C, M)``: one forward pass with hooks (removed
    afterwards) and :math:`M` backward passes (:meth:`ntkgp.ntk.network.NetworkCore.features`)."""
    features = data.core.features(x, layers, cotangents)
    return {layer.name: layer.fold(features.inputs[layer.name]) for layer in layers}, features.grads


def usable_layers(core: NetworkCore, layers: Sequence[Layer] | None, x: Tensor, strict: bool) -> list[Layer]:
    """The ``layers`` (``None``: every layer of the plan) that pass the safety rule on the probe ``x[:1]`` (the
    layer plan of ``x``'s shape: called exactly once, batched inputs, structured Jacobian equal to autograd's), as
    the curvature's pass checks its :func:`structured_layers` on its first batch and a posterior its layers at its
    first prediction; with ``strict`` any other raises ``ValueError``."""
    plan = core.layer_plan(x, modules=None if layers is None else [layer.name for layer in layers])
    if strict and plan.problems:
        raise ValueError("KFAC: " + "; ".join(str(p) for p in plan.problems.values()))
    if layers is None:
        return list(plan.layers)
    return [layer for layer in layers if layer.name in plan.names]
