r"""Layer features of ``nn.Linear`` and ``nn.Conv2d`` layers, shared by the NTK engine and the curvature.

For a layer :math:`z_{nt} = W a_{nt} + b` (a convolution on unfolded patches, :math:`t` the spatial location;
a linear layer with :math:`t` running over the extra input dimensions, one location for ``(N, d)`` inputs)
the Jacobian of the network's output :math:`f_c(x_n)` w.r.t. the layer's parameters is

.. math::
    \frac{\partial f_c(x_n)}{\partial W} = \sum_t \Gamma_{nct}\, a_{nt}^\top, \qquad
    \frac{\partial f_c(x_n)}{\partial b} = \sum_t \Gamma_{nct}, \qquad
    \Gamma_{nct} = \frac{\partial f_c(x_n)}{\partial z_{nt}}

(``docs/math.md``, "Structured form"), so Grams, curvatures and per-example products of these layers need
only the layer inputs :math:`a` and the back-propagated output gradients :math:`\Gamma`, never the Jacobian.
Both come from one batched forward pass with hooks (removed afterwards) and one backward pass per cotangent
column: the examples do not interact (eval mode).

One safety rule decides which layers take this form (:func:`candidate_layers`, :func:`verify_layers`): the
exact types ``nn.Linear`` / ``nn.Conv2d`` (``groups=1``, numeric or ``"valid"`` padding, zero padding mode;
any stride and dilation), whose parameters belong to no other module, called exactly once per forward pass
on batched inputs, and whose structured Jacobian equals autograd's on a probe example (this catches weights
used outside the layer's forward). Layers that fail take the generic per-example route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.functional import unfold

from .checks import check_outputs
from .functional import forward, per_example_jacobians

LAYER_TYPES = (nn.Linear, nn.Conv2d)


@dataclass(frozen=True)
class Layer:
    """A layer in structured form: its name in ``net.named_modules()``, the module, and the names of its
    trainable weight and bias (``None`` when absent or frozen)."""

    name: str
    module: nn.Module
    weight: str | None
    bias: str | None

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.weight, self.bias) if n is not None)


@dataclass
class LayerFeatures:
    r"""Features of one batch.

    Attributes:
        outputs: the network outputs :math:`f(x)`, ``(n, C)``.
        inputs: per layer, the inputs :math:`a` as ``(n, d_in, T)`` (unfolded patches for a convolution;
            no column of ones for the bias).
        grads: per layer, :math:`\Gamma` as ``(n, M, d_out, T)`` for ``M`` cotangent columns.
    """

    outputs: Tensor
    inputs: dict[str, Tensor]
    grads: dict[str, Tensor]


def _conv_unsupported(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv2d) and (
        module.groups != 1
        or (isinstance(module.padding, str) and module.padding != "valid")
        or module.padding_mode != "zeros"
    )


def candidate_layers(net: nn.Module, names: Sequence[str]) -> tuple[list[Layer], dict[str, Exception]]:
    """Every ``nn.Linear`` / ``nn.Conv2d`` (exact types) with a trainable weight or bias, in module order.

    Args:
        net: the network.
        names: the trainable parameter names (as in ``net.named_parameters()``).

    Returns:
        The candidate layers, and for the layers left out the reason: ``ValueError`` when a parameter is
        shared with another module (unsafe), ``NotImplementedError`` for a convolution with ``groups > 1``,
        ``padding="same"`` or a non-zero padding mode (unsupported).
    """
    trainable = set(names)
    owners: dict[int, int] = {}
    for module in net.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    layers, problems = [], {}
    for name, module in net.named_modules():
        if type(module) not in LAYER_TYPES:
            continue
        prefix = f"{name}." if name else ""
        weight = prefix + "weight" if prefix + "weight" in trainable else None
        bias = prefix + "bias" if prefix + "bias" in trainable else None
        if weight is None and bias is None:
            continue
        shared = [k for k in ("weight", "bias") if getattr(module, k) is not None and owners[id(getattr(module, k))] > 1]
        if shared:
            problems[name] = ValueError(f"the {shared[0]} of layer '{name}' is shared with another module")
        elif _conv_unsupported(module):
            problems[name] = NotImplementedError(
                f"the structured form supports Conv2d with groups=1, numeric or 'valid' padding and "
                f"padding_mode='zeros'; layer '{name}' has groups={module.groups}, padding={module.padding!r}, "
                f"padding_mode={module.padding_mode!r}"
            )
        else:
            layers.append(Layer(name, module, weight, bias))
    return layers, problems


def layer_inputs(module: nn.Module, inputs: Tensor) -> Tensor:
    """The layer's inputs ``a`` as ``(n, d_in, T)``: unfolded patches for a convolution, extra dimensions as
    locations for a linear layer."""
    n = inputs.shape[0]
    if isinstance(module, nn.Conv2d):
        padding = 0 if module.padding == "valid" else module.padding
        return unfold(inputs, module.kernel_size, module.dilation, padding, module.stride)
    return inputs.reshape(n, -1, inputs.shape[-1]).transpose(1, 2)


def layer_output_gradients(module: nn.Module, grads: Tensor) -> Tensor:
    r""":math:`\Gamma` as ``(n, d_out, T)`` from the gradient w.r.t. the layer's output."""
    n = grads.shape[0]
    if isinstance(module, nn.Conv2d):
        return grads.reshape(n, grads.shape[1], -1)
    return grads.reshape(n, -1, grads.shape[-1]).transpose(1, 2)


def _batched(module: nn.Module, inputs: object, n: int) -> bool:
    if not torch.is_tensor(inputs) or inputs.shape[0] != n:
        return False
    return inputs.dim() == 4 if isinstance(module, nn.Conv2d) else inputs.dim() >= 2


def _record(net, params, layers, x, cotangents, graph) -> tuple[LayerFeatures, dict[str, Exception]]:
    """One forward pass with hooks and one backward pass per cotangent column; layers called other than once
    or on unbatched inputs are returned as problems (no features)."""
    seen: dict[str, list[tuple[object, Tensor]]] = {layer.name: [] for layer in layers}

    def recorder(name: str):
        def hook(module, args, output):
            seen[name].append((args[0] if args else None, output))

        return hook

    handles = [layer.module.register_forward_hook(recorder(layer.name)) for layer in layers]
    n = x.shape[0]
    try:
        with torch.enable_grad():
            # parameters that require grad keep their graph when ``graph`` (differentiating w.r.t. θ, e.g. FSVI)
            local = {k: p if graph and p.requires_grad else p.detach().requires_grad_(True) for k, p in params.items()}
            f = forward(net, local, x)
            check_outputs(f, n)
            problems: dict[str, Exception] = {}
            for layer in layers:
                calls = seen[layer.name]
                if len(calls) != 1:
                    how = "more than once" if calls else "never"
                    problems[layer.name] = ValueError(
                        f"layer '{layer.name}' is called {how} per forward pass ({len(calls)} calls; the "
                        "structured form needs exactly one)"
                    )
                elif not _batched(layer.module, calls[0][0], n):
                    problems[layer.name] = ValueError(f"layer '{layer.name}' is not applied to batched inputs")
            good = [layer for layer in layers if layer.name not in problems]
            outs = [seen[layer.name][0][1] for layer in good]
            grads: dict[str, list[Tensor]] = {layer.name: [] for layer in good}
            if good:
                columns = f.shape[1] if cotangents is None else cotangents.shape[-1]
                for m in range(columns):
                    if cotangents is None:
                        cot = torch.zeros_like(f)
                        cot[:, m] = 1.0
                    else:
                        cot = cotangents[:, :, m].to(f)
                    gs = torch.autograd.grad(
                        f, outs, cot, retain_graph=graph or m + 1 < columns, create_graph=graph, allow_unused=True
                    )
                    for layer, g, z in zip(good, gs, outs):
                        g = torch.zeros_like(z) if g is None else g
                        grads[layer.name].append(layer_output_gradients(layer.module, g if graph else g.detach()))
    finally:
        for handle in handles:
            handle.remove()
    with torch.set_grad_enabled(graph and torch.is_grad_enabled()):
        inputs = {}
        for layer in good:
            a = seen[layer.name][0][0]
            inputs[layer.name] = layer_inputs(layer.module, a if graph else a.detach())
    stacked = {name: torch.stack(g, dim=1) for name, g in grads.items() if g}
    return LayerFeatures(outputs=f if graph else f.detach(), inputs=inputs, grads=stacked), problems


def layer_features(
    net: nn.Module, params: dict[str, Tensor], layers: Sequence[Layer], x: Tensor, cotangents: Tensor | None = None,
    graph: bool = False,
) -> LayerFeatures:
    r"""Layer inputs :math:`a` and output gradients :math:`\Gamma` of one batch.

    Args:
        net: the network (not modified; the hooks are removed afterwards).
        params: every trainable parameter (detached, or requiring grad with ``graph``: see below).
        layers: verified layers (:func:`verify_layers`).
        x: prepared inputs ``(n, ...)``.
        cotangents: :math:`u_{nm}` as ``(n, C, M)``: :math:`\Gamma_{nm} = \partial(u_{nm}^\top f_n)/\partial z`;
            ``None`` for the unit vectors (``M = C``, :math:`\Gamma_{nc} = \partial f_c / \partial z`).
        graph: keep the autograd graph to ``x`` and to the entries of ``params`` that require grad
            (second-order autograd through :math:`\Gamma`); otherwise every result is detached.

    Returns:
        :class:`LayerFeatures`. Cost: one forward and ``M`` backward passes.

    Raises:
        ValueError: when a layer is called other than once (the network's control flow changed since the
            layers were verified).
    """
    features, problems = _record(net, params, layers, x, cotangents, graph)
    if problems:
        raise ValueError("; ".join(str(p) for p in problems.values()))
    return features


def layer_jacobians(layer: Layer, inputs: Tensor, grads: Tensor) -> dict[str, Tensor]:
    r"""Per-example Jacobian blocks of the layer's parameters from its features, ``{name: (n, M, numel)}``:
    weight :math:`\sum_t \Gamma_{nmt} a_{nt}^\top`, bias :math:`\sum_t \Gamma_{nmt}`."""
    n, m = grads.shape[:2]
    out = {}
    if layer.weight is not None:
        out[layer.weight] = torch.einsum("nmot,nit->nmoi", grads, inputs).reshape(n, m, -1)
    if layer.bias is not None:
        out[layer.bias] = grads.sum(dim=-1)
    return out


def verify_layers(
    net: nn.Module, params: dict[str, Tensor], layers: Sequence[Layer], probe: Tensor
) -> tuple[list[Layer], dict[str, int], dict[str, Exception]]:
    """Keep the layers whose structured Jacobian equals autograd's on the probe (one example).

    Args:
        net: the network.
        params: every trainable parameter, detached.
        layers: candidates (:func:`candidate_layers`).
        probe: one prepared example ``(1, ...)``.

    Returns:
        The verified layers; their number of locations ``T`` on the probe; and, for the others, a
        ``ValueError`` saying why (called other than once, unbatched inputs, a Jacobian that differs, e.g.
        because the weight is also used outside the layer's forward).
    """
    if not layers:
        return [], {}, {}
    probe = probe.detach()
    features, problems = _record(net, params, layers, probe, None, graph=False)
    good = [layer for layer in layers if layer.name not in problems]
    if not good:
        return [], {}, problems
    names = [n for layer in good for n in layer.parameter_names]
    exact = per_example_jacobians(net, params, probe, names)
    keep, locations = [], {}
    for layer in good:
        approx = layer_jacobians(layer, features.inputs[layer.name], features.grads[layer.name])
        ok = True
        for name, value in approx.items():
            ref = exact[name]
            tol = 1e-4 if ref.dtype == torch.float32 else 1e-9
            ok &= value.shape == ref.shape and torch.allclose(
                value, ref, rtol=tol, atol=tol * (1 + ref.abs().max().item())
            )
        if ok:
            keep.append(layer)
            locations[layer.name] = features.inputs[layer.name].shape[-1]
        else:
            problems[layer.name] = ValueError(
                f"the Jacobian of layer '{layer.name}' is not that of a layer applied once (is its weight also "
                "used outside its forward?)"
            )
    return keep, locations, problems
