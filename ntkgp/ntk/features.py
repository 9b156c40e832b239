r"""Layer features of ``nn.Linear`` and ``nn.Conv2d`` layers: one forward pass with hooks, back-propagated
output gradients, and the per-layer quantities built from them.

For a layer :math:`z_{nt} = W a_{nt} + b` (a convolution on unfolded patches, :math:`t` the spatial location;
a linear layer with :math:`t` running over the extra input dimensions, one location for ``(N, d)`` inputs)
the Jacobian of the network's output :math:`f_c(x_n)` w.r.t. the layer's parameters is

.. math::
    \frac{\partial f_c(x_n)}{\partial W} = \sum_t \Gamma_{nct}\, a_{nt}^\top, \qquad
    \frac{\partial f_c(x_n)}{\partial b} = \sum_t \Gamma_{nct}, \qquad
    \Gamma_{nct} = \frac{\partial f_c(x_n)}{\partial z_{nt}}

(``docs/math.md``, "Structured form"), so Grams, curvatures and per-example products of these layers need
only the layer inputs :math:`a` and the back-propagated output gradients :math:`\Gamma`, never the Jacobian.
Both come from one batched forward pass with hooks (on ntkgp's private copy of the network, removed afterwards)
and one backward pass per cotangent
column (the examples do not interact: eval mode). Which layers take this form is decided once by the layer
plan (:mod:`ntkgp.ntk.layer_plan`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn.functional import pad, unfold

from .checks import check_outputs
from .functional import call, forward
from .inputs import num_rows

LAYER_TYPES = (nn.Linear, nn.Conv2d)


@dataclass(frozen=True)
class Layer:
    """A layer in structured form: its name in ``net.named_modules()``, the module, and the names of its
    weight and bias in :math:`\\theta` (``None`` when absent or not in :math:`\\theta`)."""

    name: str
    module: nn.Module
    weight: str | None
    bias: str | None

    #: Whether the layer may be called several times per forward pass (weight sharing): its recorded inputs and
    #: gradients are then those of its calls joined along the locations (:func:`record`). Only layers whose
    #: per-example gradient is a sum over locations of a product of the two take this (the elementwise layers of
    #: :mod:`ntkgp.ntk.norm_features`).
    repeated: ClassVar[bool] = False

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.weight, self.bias) if n is not None)

    @property
    def fan_in(self) -> int:
        """The number of weight columns (``in_features`` or ``in_channels · kh · kw``); 0 without a weight."""
        return self.module.weight[0].numel() if self.weight is not None else 0

    @property
    def d_out(self) -> int:
        return (self.module.weight if self.weight is not None else self.module.bias).shape[0]

    def fold(self, a: Tensor) -> Tensor:
        r"""The input of :math:`\Theta = [W \mid b]`, :math:`\bar a = [a; 1]` ``(n, d_a, T)`` from :math:`a`
        ``(n, d_in, T)``: the weight's rows when it is in :math:`\theta`, a row of ones when the bias is."""
        parts = [a] if self.weight is not None else []
        if self.bias is not None:
            parts.append(torch.ones_like(a[:, :1]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def index(self, offset: Callable[[str], int], device: torch.device | None = None) -> Tensor:
        r"""The position in the flat :math:`\theta` of each entry of :math:`\Theta = [W \mid b]`,
        ``(d_out, d_a)`` (weight row-major, then the bias column); ``offset(name)`` is a parameter's start."""
        rows = torch.arange(self.d_out, device=device)[:, None]
        parts = []
        if self.weight is not None:
            parts.append(offset(self.weight) + rows * self.fan_in + torch.arange(self.fan_in, device=device))
        if self.bias is not None:
            parts.append(offset(self.bias) + rows)
        return torch.cat(parts, dim=1)

    def blocks(self, inputs: Tensor, grads: Tensor, out: Tensor | None = None) -> Tensor:
        r"""Per-example Jacobian blocks of :math:`\Theta = [W \mid b]` from the features,
        :math:`\sum_t \Gamma_{n\cdot t} \bar a_{nt}^\top`: ``(n, *lead, d_out, d_a)`` from the inputs ``a``
        ``(n, d_in, T)`` and gradients ``(n, *lead, d_out, T)`` (one batched matrix product).

        With ``out`` (contiguous ``(n, d_out, d_a)``, no ``lead``) ``inputs`` must be the folded :math:`\bar a`
        (:meth:`fold`, ``(n, d_a, T)``) and the blocks are written into ``out`` by one product (weight and bias
        together, no copy; not differentiable)."""
        if out is not None:
            return torch.bmm(grads, inputs.transpose(1, 2), out=out)
        parts = []
        if self.weight is not None:
            n, t = inputs.shape[0], inputs.shape[-1]
            weight = torch.bmm(grads.reshape(n, -1, t), inputs.transpose(1, 2))
            parts.append(weight.view(*grads.shape[:-1], inputs.shape[1]))
        if self.bias is not None:
            parts.append(grads.sum(dim=-1, keepdim=True))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def attach(self, net: nn.Module, recorder: Callable):
        """Start recording the layer's ``(module, (input,), output)`` on ``net`` (ntkgp's private copy) with
        ``recorder``; returns a handle with ``remove()``. A forward hook on the module of the layer's name."""
        return net.get_submodule(self.name).register_forward_hook(recorder)

    def requires_grad(self) -> bool:
        """Whether a parameter of the layer in :math:`\theta` requires grad (:func:`own_graph`)."""
        return any(getattr(self.module, k).requires_grad for k, n in (("weight", self.weight), ("bias", self.bias))
                   if n is not None)

    def takes(self, inputs: object, n: int) -> bool:
        """Whether the layer's recorded input is a batch of ``n`` examples it can be structured on."""
        return _batched(self.module, inputs, n)

    def recorded_inputs(self, inputs: Tensor) -> Tensor:
        """The features kept from the layer's input (:func:`layer_inputs`: ``a`` as ``(n, d_in, T)``)."""
        return layer_inputs(self.module, inputs)

    def recorded_gradients(self, grads: Tensor) -> Tensor:
        r""":math:`\Gamma` as ``(n, d_out, T)`` from the gradient w.r.t. the layer's output
        (:func:`layer_output_gradients`)."""
        return layer_output_gradients(self.module, grads)

    def jacobians(self, inputs: Tensor, grads: Tensor) -> dict[str, Tensor]:
        r"""Per-example Jacobian blocks from the features, ``{name: (n, M, numel)}`` for gradients
        ``(n, M, d_out, T)``: weight :math:`\sum_t \Gamma_{nmt} a_{nt}^\top`, bias :math:`\sum_t \Gamma_{nmt}`."""
        n, m = grads.shape[:2]
        out = {}
        if self.weight is not None:
            t = inputs.shape[-1]
            out[self.weight] = torch.bmm(grads.reshape(n, -1, t), inputs.transpose(1, 2)).view(n, m, -1)
        if self.bias is not None:
            out[self.bias] = grads.sum(dim=-1)
        return out


@dataclass
class LayerFeatures:
    r"""Features of one batch.

    Attributes:
        outputs: the network outputs :math:`f(x)`, ``(n, C)``.
        inputs: per layer, the inputs :math:`a` as ``(n, d_in, T)`` (unfolded patches for a convolution;
            no row of ones for the bias).
        grads: per layer, :math:`\Gamma` as ``(n, M, d_out, T)`` for ``M`` cotangent columns.
    """

    outputs: Tensor
    inputs: dict[str, Tensor]
    grads: dict[str, Tensor]


def conv_padding(module: nn.Conv2d) -> tuple[int, int, int, int]:
    """The convolution's padding as ``F.pad`` takes it, ``(left, right, top, bottom)``: numeric padding on both
    sides, none for ``"valid"``, and for ``"same"`` a total of ``dilation · (kernel - 1)`` per dimension, the
    larger half after (as ``nn.Conv2d`` pads)."""
    if module.padding == "valid":
        return (0, 0, 0, 0)
    if module.padding == "same":
        pads = []
        for d, k in zip(reversed(module.dilation), reversed(module.kernel_size)):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)
    (ph, pw) = module.padding
    return (pw, pw, ph, ph)


def layer_inputs(module: nn.Module, inputs: Tensor) -> Tensor:
    """The layer's inputs ``a`` as ``(n, d_in, T)``: unfolded patches for a convolution (padded as the layer pads:
    zeros, or its ``padding_mode``), extra dimensions as locations for a linear layer."""
    n = inputs.shape[0]
    if isinstance(module, nn.Conv2d):
        left, right, top, bottom = conv_padding(module)
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        if tuple(module.dilation) == (1, 1):  # strided views of the padded input, one copy (faster than im2col)
            padded = pad(inputs, (left, right, top, bottom), mode=mode) if any((left, right, top, bottom)) else inputs
            (kh, kw), (sh, sw) = module.kernel_size, module.stride
            patches = padded.unfold(2, kh, sh).unfold(3, kw, sw)  # (n, c_in, H', W', kh, kw)
            return patches.permute(0, 1, 4, 5, 2, 3).reshape(n, -1, patches.shape[2] * patches.shape[3])
        if module.padding_mode == "zeros" and left == right and top == bottom:
            return unfold(inputs, module.kernel_size, module.dilation, (top, left), module.stride)
        padded = pad(inputs, (left, right, top, bottom), mode=mode)
        return unfold(padded, module.kernel_size, module.dilation, 0, module.stride)
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


#: One batched backward pass for all cotangent columns (``is_grads_batched``) instead of one per column: ``None``
#: uses it on accelerators, where it saves the launches of ``M`` passes; on a CPU the passes cost the same either
#: way and one per column holds the gradients of one column at a time.
BATCHED_BACKWARD: bool | None = None


def _output_gradients(f: Tensor, outs: list[Tensor], cotangents: Tensor | None, graph: bool):
    """The gradients w.r.t. ``outs`` for each cotangent column (unit vectors when ``cotangents`` is ``None``),
    one list per column: one batched backward pass (:data:`BATCHED_BACKWARD`) or one pass per column."""
    columns = f.shape[1] if cotangents is None else cotangents.shape[-1]

    def column(m: int) -> Tensor:
        if cotangents is not None:
            return cotangents[:, :, m].to(f)
        cot = torch.zeros_like(f)
        cot[:, m] = 1.0
        return cot

    batched = f.device.type != "cpu" if BATCHED_BACKWARD is None else BATCHED_BACKWARD
    if batched and columns > 1:
        cots = torch.stack([column(m) for m in range(columns)])
        gs = torch.autograd.grad(f, outs, cots, retain_graph=graph, create_graph=graph, allow_unused=True,
                                 is_grads_batched=True)
        for m in range(columns):
            yield [None if g is None else g[m] for g in gs]
        return
    for m in range(columns):
        yield torch.autograd.grad(
            f, outs, column(m), retain_graph=graph or m + 1 < columns, create_graph=graph, allow_unused=True
        )


def _along_locations(parts: list[Tensor]) -> Tensor:
    """The features of a layer's calls joined along their locations (the last dimension)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def record(net, params, layers, x, cotangents, graph, reduce=None) -> tuple[LayerFeatures, dict[str, Exception]]:
    """One forward pass with hooks and one backward pass per cotangent column; layers called other than once
    (other than at least once for a :attr:`Layer.repeated` one: its calls joined along the locations) or on unbatched
    inputs are returned as problems (no features). Arguments as :func:`layer_features`."""
    seen: dict[str, list[tuple[object, Tensor]]] = {layer.name: [] for layer in layers}

    def recorder(name: str):
        def hook(module, args, output):
            seen[name].append((args[0] if args else None, output))

        return hook

    # on ``net`` (ntkgp's private copy): each layer's module of the same name, never the user's
    handles = [layer.attach(net, recorder(layer.name)) for layer in layers]
    n = num_rows(x)
    try:
        with torch.enable_grad():
            if params is None:  # the network's own parameters, which require grad, carry the graph to the layers
                f = call(net, None, x)
            else:
                # the layers' parameters carry the graph to their outputs; those that require grad keep their own
                # graph when ``graph`` (differentiating w.r.t. θ, e.g. FSVI)
                local = dict(params)
                for name in {k for layer in layers for k in layer.parameter_names}:
                    p = params[name]
                    local[name] = p if graph and p.requires_grad else p.detach().requires_grad_(True)
                f = forward(net, local, x)
            check_outputs(f, n)
            if callable(cotangents):  # computed from the outputs of this pass (no forward pass of their own)
                cotangents = cotangents(f.detach())
            problems: dict[str, Exception] = {}
            for layer in layers:
                calls = seen[layer.name]
                if not calls or (len(calls) > 1 and not layer.repeated):
                    how = "more than once" if calls else "never"
                    problems[layer.name] = ValueError(
                        f"layer '{layer.name}' is called {how} per forward pass ({len(calls)} calls; the "
                        "structured form needs exactly one)"
                    )
                elif not all(layer.takes(a, n) for a, _ in calls):
                    problems[layer.name] = ValueError(f"layer '{layer.name}' is not applied to batched inputs")
            good = [layer for layer in layers if layer.name not in problems]
            outs = [z for layer in good for _, z in seen[layer.name]]  # every call's output, layer by layer
            with torch.set_grad_enabled(graph):  # the layers' inputs (unfolded patches), before the backward passes
                inputs = {layer.name: _along_locations([layer.recorded_inputs(a if graph else a.detach())
                                                        for a, _ in seen[layer.name]]) for layer in good}
            grads: dict[str, list[Tensor]] = {layer.name: [] for layer in good}
            if good:
                count = f.shape[1] if cotangents is None else cotangents.shape[-1]
                for m, gs in enumerate(_output_gradients(f, outs, cotangents, graph)):
                    at = 0
                    for layer in good:
                        parts = []
                        for _, z in seen[layer.name]:
                            g = torch.zeros_like(z) if gs[at] is None else gs[at]
                            parts.append(layer.recorded_gradients(g if graph else g.detach()))
                            at += 1
                        g = _along_locations(parts)
                        kept = g if reduce is None else reduce(layer, inputs[layer.name], g, m, count)
                        if kept is not None:
                            grads[layer.name].append(kept)
    finally:
        for handle in handles:
            handle.remove()
    stacked = {name: torch.stack(g, dim=1) for name, g in grads.items() if g}
    return LayerFeatures(outputs=f if graph else f.detach(), inputs=inputs, grads=stacked), problems


def own_graph(layers: Sequence[Layer]) -> bool:
    """Whether the network's own parameters carry a graph to every layer's output: a parameter in
    :math:`\theta` of each layer requires grad (``params=None`` of :func:`layer_features`)."""
    return all(layer.requires_grad() for layer in layers)


def layer_features(
    net: nn.Module, params: dict[str, Tensor] | None, layers: Sequence[Layer], x: Tensor,
    cotangents: Tensor | Callable[[Tensor], Tensor] | None = None, graph: bool = False,
    reduce: Callable[..., Tensor | None] | None = None,
) -> LayerFeatures:
    r"""Layer inputs :math:`a` and output gradients :math:`\Gamma` of one batch.

    Args:
        net: ntkgp's private copy of the network (:meth:`NetworkCore.module
            <ntkgp.ntk.network.NetworkCore.module>`; the hooks are registered on it and removed afterwards).
        params: the parameters passed to ``functional_call`` (detached, or requiring grad with ``graph``); ``None``
            (without ``graph``): the network's own, called as it is, where a parameter of each layer requires grad
            (:func:`own_graph`: its graph reaches every layer's output; autograd is asked for the gradients of the
            layers' outputs only, so no ``.grad`` is touched and no weight gradient computed).
        layers: verified layers (:class:`~ntkgp.ntk.layer_plan.LayerPlan`).
        x: prepared inputs ``(n, ...)``.
        cotangents: :math:`u_{nm}` as ``(n, C, M)``: :math:`\Gamma_{nm} = \partial(u_{nm}^\top f_n)/\partial z`;
            ``None`` for the unit vectors (``M = C``, :math:`\Gamma_{nc} = \partial f_c / \partial z`); or a function
            of the detached outputs ``f`` that returns them (called after this pass's forward pass).
        graph: keep the autograd graph to ``x`` and to the entries of ``params`` that require grad
            (second-order autograd through :math:`\Gamma`); otherwise every result is detached.
        reduce: ``reduce(layer, a, g, m, M)`` is kept instead of :math:`\Gamma` for each cotangent column ``m``
            of ``M``, ``g`` ``(n, d_out, T)`` (e.g. :meth:`Layer.blocks`: the ``T`` locations summed right away, so
            that the ``M`` gradients of a convolution's every location are never held together); a ``reduce``
            that returns ``None`` keeps its results itself (the layer is then absent from ``grads``).

    Returns:
        :class:`LayerFeatures` (``grads`` stacked along dimension 1). Cost: one forward and ``M`` backward
        passes.

    Raises:
        ValueError: when a layer is called other than once (the network's control flow changed since the
            layers were verified).
    """
    features, problems = record(net, params, layers, x, cotangents, graph, reduce)
    if problems:
        raise ValueError("; ".join(str(p) for p in problems.values()))
    return features
