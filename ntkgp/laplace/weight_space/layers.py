r"""Layer features for the curvature: the engine's shared machinery (:mod:`ntkgp.ntk.features`) with the
bias folded into the input, :math:`\bar a = [a; 1]`.

For a layer :math:`z_{nt} = \Theta \bar a_{nt}`, :math:`\Theta = [W \mid b]` (convolution: on unfolded patches,
:math:`t` the spatial location; linear layer: :math:`t` the extra input dimensions, one location for
``(N, d)`` inputs), the per-example vector-Jacobian product is

.. math::
    J_n^\top u_{nm} \big|_\Theta = \sum_t \Gamma_{nmt} \bar a_{nt}^\top, \qquad
    \Gamma_{nmt} = \partial (u_{nm}^\top f_n) / \partial z_{nt},

so the layer's curvature needs :math:`\bar a` and :math:`\Gamma` only, never the Jacobian. Which layers take
this form is decided by the one safety rule of :mod:`ntkgp.ntk.features` (the NTK engine uses the same); the
curvature additionally needs a trainable weight (a layer with only a trainable bias takes the per-example
route) and, for KFAC, weight and bias in one prior group.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...ntk import ParameterGroups
from ...ntk.features import LAYER_TYPES, Layer, candidate_layers, layer_inputs, layer_output_gradients, verify_layers
from ...ntk.features import layer_features as shared_layer_features
from .data_pass import DataPass

__all__ = [
    "LAYER_TYPES",
    "Layer",
    "layer_features",
    "layer_output_gradients",
    "layer_patches",
    "structured_layers",
    "usable_layers",
]


def structured_layers(net: nn.Module, groups: ParameterGroups, strict: bool) -> list[Layer]:
    """Every ``nn.Linear`` / ``nn.Conv2d`` (exact types) with a trainable weight, in module order.

    With ``strict`` (KFAC) an unsupported layer raises: ``ValueError`` when its weight is shared with another
    module or its weight and bias are in different prior groups, ``NotImplementedError`` for convolutions with
    ``groups > 1``, ``padding="same"`` or a non-zero padding mode. Otherwise such layers are left out (their
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


def layer_patches(module: nn.Module, inputs: Tensor, with_bias: bool) -> Tensor:
    r"""The layer's inputs :math:`\bar a_{nt}` as ``(n, d_a, T)``: unfolded patches for a convolution, extra
    dimensions as locations for a linear layer; a row of ones appended when ``with_bias``."""
    a = layer_inputs(module, inputs)
    return torch.cat([a, torch.ones_like(a[:, :1])], dim=1) if with_bias else a


def layer_features(
    data: DataPass, layers: list[Layer], x: Tensor, cotangents: Tensor
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    r"""One batch's layer inputs :math:`\bar a` ``(n, d_a, T)`` and output gradients :math:`\Gamma`
    ``(n, M, d_out, T)`` for the cotangents :math:`u_{nm}` ``(n, C, M)``: one forward pass with hooks (removed
    afterwards) and :math:`M` backward passes (:func:`ntkgp.ntk.features.layer_features`)."""
    features = shared_layer_features(data.net, data.params, layers, x, cotangents)
    inputs = {}
    for layer in layers:
        a = features.inputs[layer.name]
        inputs[layer.name] = torch.cat([a, torch.ones_like(a[:, :1])], dim=1) if layer.bias is not None else a
    return inputs, features.grads


def usable_layers(data: DataPass, layers: list[Layer], x: Tensor, strict: bool) -> list[Layer]:
    """The ``layers`` that pass the safety rule on the probe ``x`` (:func:`ntkgp.ntk.features.verify_layers`:
    called exactly once, batched inputs, structured Jacobian equal to autograd's); with ``strict`` any other
    raises ``ValueError``."""
    keep, _, problems = verify_layers(data.net, data.params, layers, x)
    if problems and strict:
        raise ValueError("KFAC: " + "; ".join(str(p) for p in problems.values()))
    return keep
