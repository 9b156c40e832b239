r"""Layer features of ``nn.Linear`` and ``nn.Conv2d`` layers: inputs :math:`\bar a_{nt}` and back-propagated
output gradients :math:`\Gamma_{nmt}`, from one batched forward pass with hooks.

For a layer :math:`z_{nt} = \Theta \bar a_{nt}`, :math:`\Theta = [W \mid b]` (convolution: on unfolded patches,
:math:`t` the spatial location; linear layer: :math:`t` the extra input dimensions, one location for
``(N, d)`` inputs), the per-example vector-Jacobian product is

.. math::
    J_n^\top u_{nm} \big|_\Theta = \sum_t \Gamma_{nmt} \bar a_{nt}^\top, \qquad
    \Gamma_{nmt} = \partial (u_{nm}^\top f_n) / \partial z_{nt},

so the layer's curvature needs :math:`\bar a` and :math:`\Gamma` only, never the Jacobian. Since the examples
do not interact (eval mode), one backward pass of :math:`\sum_n u_{nm}^\top f_n` gives all :math:`\Gamma_{nm}`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.functional import unfold

from ..ntk import ParameterGroups
from .data_pass import DataPass

LAYER_TYPES = (nn.Linear, nn.Conv2d)


@dataclass(frozen=True)
class Layer:
    """A layer in structured form: its name, module, and the names of its weight and (trainable) bias."""

    name: str
    module: nn.Module
    weight: str
    bias: str | None


def structured_layers(net: nn.Module, groups: ParameterGroups, strict: bool) -> list[Layer]:
    """Every ``nn.Linear`` / ``nn.Conv2d`` (exact types) with a trainable weight, in module order.

    With ``strict`` (KFAC) an unsupported layer raises: ``ValueError`` when its weight is shared with another
    module or its weight and bias are in different prior groups, ``NotImplementedError`` for convolutions with
    ``groups > 1``, ``padding="same"`` or a non-zero padding mode. Otherwise such layers are left out (their
    parameters take the generic per-example route).
    """
    index = dict(zip(groups.names, groups.group_of))
    owners: dict[int, int] = {}
    for module in net.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    layers = []
    for name, module in net.named_modules():
        prefix = f"{name}." if name else ""
        weight, bias = prefix + "weight", prefix + "bias"
        if type(module) not in LAYER_TYPES or weight not in index:
            continue
        bias = bias if bias in index else None
        problem = None
        if owners[id(module.weight)] > 1:
            problem = ValueError(f"the weight of layer '{name}' is shared with another module")
        elif isinstance(module, nn.Conv2d) and (
            module.groups != 1
            or (isinstance(module.padding, str) and module.padding != "valid")
            or module.padding_mode != "zeros"
        ):
            problem = NotImplementedError(
                f"KFAC supports Conv2d with groups=1, numeric or 'valid' padding and padding_mode='zeros'; "
                f"layer '{name}' has groups={module.groups}, padding={module.padding!r}, "
                f"padding_mode={module.padding_mode!r}"
            )
        elif strict and bias is not None and index[bias] != index[weight]:
            problem = ValueError(
                f"KFAC treats the weight and bias of layer '{name}' as one Kronecker block, so they need one "
                f"prior precision: they are in groups '{groups.group_names[index[weight]]}' and "
                f"'{groups.group_names[index[bias]]}'. Use groups='layer' or 'network'"
            )
        if problem is not None and strict:
            raise problem
        if problem is None:
            layers.append(Layer(name, module, weight, bias))
    return layers


def layer_patches(module: nn.Module, inputs: Tensor, with_bias: bool) -> Tensor:
    r"""The layer's inputs :math:`\bar a_{nt}` as ``(n, d_a, T)``: unfolded patches for a convolution, extra
    dimensions as locations for a linear layer; a row of ones appended when ``with_bias``."""
    n = inputs.shape[0]
    if isinstance(module, nn.Conv2d):
        padding = 0 if module.padding == "valid" else module.padding
        a = unfold(inputs, module.kernel_size, module.dilation, padding, module.stride)
    else:
        a = inputs.reshape(n, -1, inputs.shape[-1]).transpose(1, 2)
    if with_bias:
        a = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
    return a


def layer_output_gradients(module: nn.Module, grads: Tensor) -> Tensor:
    r""":math:`\Gamma_{nt}` as ``(n, d_out, T)`` from the gradient w.r.t. the layer's output."""
    n = grads.shape[0]
    if isinstance(module, nn.Conv2d):
        return grads.reshape(n, grads.shape[1], -1)
    return grads.reshape(n, -1, grads.shape[-1]).transpose(1, 2)


def layer_call_counts(data: DataPass, layers: list[Layer], x: Tensor) -> dict[str, int]:
    """How often each layer is called in one forward pass of ``x`` (structured form needs exactly once)."""
    counts = {layer.name: 0 for layer in layers}

    def counter(name: str):
        def hook(module, args, output):
            counts[name] += 1

        return hook

    handles = [layer.module.register_forward_hook(counter(layer.name)) for layer in layers]
    try:
        with torch.no_grad():
            data.forward(x)
    finally:
        for handle in handles:
            handle.remove()
    return counts


def layer_features(
    data: DataPass, layers: list[Layer], x: Tensor, cotangents: Tensor
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    r"""One batch's layer inputs :math:`\bar a` ``(n, d_a, T)`` and output gradients :math:`\Gamma`
    ``(n, M, d_out, T)`` for the cotangents :math:`u_{nm}` ``(n, C, M)``: one forward pass with hooks (removed
    afterwards) and :math:`M` backward passes."""
    seen: dict[str, list[tuple[Tensor, Tensor]]] = {layer.name: [] for layer in layers}

    def recorder(name: str):
        def hook(module, args, output):
            seen[name].append((args[0], output))

        return hook

    handles = [layer.module.register_forward_hook(recorder(layer.name)) for layer in layers]
    try:
        with torch.enable_grad():
            params = {k: p.detach().requires_grad_(True) for k, p in data.params.items()}
            f = data.forward(x, params)
            twice = [name for name, calls in seen.items() if len(calls) != 1]
            if twice:
                raise ValueError(f"layers {twice} are called more than once per forward pass")
            outputs = [seen[layer.name][0][1] for layer in layers]
            grads: dict[str, list[Tensor]] = {layer.name: [] for layer in layers}
            for m in range(cotangents.shape[-1]):
                gs = torch.autograd.grad(f, outputs, cotangents[:, :, m], retain_graph=True, allow_unused=True)
                for layer, g, z in zip(layers, gs, outputs):
                    g = torch.zeros_like(z) if g is None else g
                    grads[layer.name].append(layer_output_gradients(layer.module, g))
    finally:
        for handle in handles:
            handle.remove()
    inputs = {
        layer.name: layer_patches(layer.module, seen[layer.name][0][0].detach(), layer.bias is not None)
        for layer in layers
    }
    return inputs, {name: torch.stack(g, dim=1) for name, g in grads.items()}


def usable_layers(data: DataPass, layers: list[Layer], x: Tensor, strict: bool) -> list[Layer]:
    """The ``layers`` called exactly once in a forward pass of the probe ``x``; with ``strict`` any other
    raises ``ValueError``."""
    counts = layer_call_counts(data, layers, x)
    bad = [name for name, count in counts.items() if count != 1]
    if bad and strict:
        raise ValueError(f"KFAC: layers {bad} are called more than once per forward pass (or never)")
    return [layer for layer in layers if counts[layer.name] == 1]
