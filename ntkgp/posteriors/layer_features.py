r"""Per-layer Jacobians in Kronecker-factored form at test inputs: layer inputs and output gradients.

For a layer :math:`z_t = \Theta \bar a_t` with :math:`\Theta = [W \mid b]` (``nn.Linear``; ``nn.Conv2d`` on
unfolded patches, :math:`t` the spatial location; extra input dimensions of a linear layer are locations too)
and :math:`\bar a = [a; 1]` (the 1 only when the bias is in :math:`\theta`), row :math:`c` of the layer's
Jacobian of example :math:`n` is

.. math::
    \partial f_c(x_n) / \partial \Theta = \sum_t \gamma_{nct} \, \bar a_{nt}^\top,
    \qquad \gamma_{nct} = \partial f_c(x_n) / \partial z_{nt},

a ``(d_out, d_a)`` matrix in the row-major order of :math:`\operatorname{vec}(\Theta)` (output index major),
the order of the KFAC blocks of :mod:`ntkgp.curvature`. With one location it is the outer product
:math:`\gamma_{nc} \bar a_n^\top` (the review's :math:`a_{l-1} \otimes g_l`), so the GLM closed forms need
:math:`\bar a` and :math:`\gamma` only: one forward pass with hooks (removed afterwards) and :math:`C`
backward passes for a batch, never the Jacobian.

Layers are verified once on a probe example against ``torch.func.jacrev``: a weight shared with another
module or used outside the layer's forward is caught there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.functional import unfold

from .network_function import NetworkFunction

LAYER_TYPES = (nn.Linear, nn.Conv2d)


@dataclass(frozen=True)
class Layer:
    """A ``Linear``/``Conv2d`` layer in Kronecker form: module name, module, weight and bias names.

    Attributes:
        name: the module's name in ``net.named_modules()``.
        module: the module.
        weight: its weight's parameter name.
        bias: its bias's parameter name, or ``None`` when it has none or the bias is not in :math:`\\theta`.
    """

    name: str
    module: nn.Module
    weight: str
    bias: str | None

    @property
    def fan_in(self) -> int:
        """The number of weight columns: ``in_features``, or ``in_channels · kh · kw``."""
        return self.module.weight[0].numel()

    @property
    def d_out(self) -> int:
        return self.module.weight.shape[0]

    @property
    def d_a(self) -> int:
        """The length of :math:`\\bar a`: fan-in, plus one with a bias."""
        return self.fan_in + (self.bias is not None)


def supported(module: nn.Module) -> bool:
    """Whether ``module`` is a ``Linear`` or a ``Conv2d`` with ``groups=1``, numeric or ``'valid'`` padding and
    zero padding mode (exact types: subclasses may change the forward)."""
    if type(module) is nn.Linear:
        return True
    return (
        type(module) is nn.Conv2d
        and module.groups == 1
        and (not isinstance(module.padding, str) or module.padding == "valid")
        and module.padding_mode == "zeros"
    )


def candidate_layers(fn: NetworkFunction) -> list[Layer]:
    """Every supported layer whose weight is in :math:`\\theta`, in module order."""
    layers = []
    for name, module in fn.net.named_modules():
        prefix = f"{name}." if name else ""
        if not supported(module) or prefix + "weight" not in fn.names:
            continue
        bias = prefix + "bias" if prefix + "bias" in fn.names else None
        layers.append(Layer(name, module, prefix + "weight", bias))
    return layers


def layer_inputs(layer: Layer, inputs: Tensor) -> Tensor:
    r""":math:`\bar a_{nt}` as ``(n, d_a, T)`` from the layer's input (patches for a convolution)."""
    module, n = layer.module, inputs.shape[0]
    if isinstance(module, nn.Conv2d):
        padding = 0 if module.padding == "valid" else module.padding
        a = unfold(inputs, module.kernel_size, module.dilation, padding, module.stride)
    else:
        a = inputs.reshape(n, -1, inputs.shape[-1]).transpose(1, 2)
    if layer.bias is not None:
        a = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
    return a


def layer_gradients(layer: Layer, grads: Tensor) -> Tensor:
    r""":math:`\gamma_{nt}` as ``(n, d_out, T)`` from the gradient w.r.t. the layer's output."""
    n = grads.shape[0]
    if isinstance(layer.module, nn.Conv2d):
        return grads.reshape(n, grads.shape[1], -1)
    return grads.reshape(n, -1, grads.shape[-1]).transpose(1, 2)


def layer_features(fn: NetworkFunction, x: Tensor, layers: list[Layer]) -> dict[str, tuple[Tensor, Tensor]]:
    r"""For a prepared batch ``x`` and each layer: :math:`\bar a` ``(n, d_a, T)`` and :math:`\gamma`
    ``(n, C, d_out, T)`` (module docstring). One forward pass with hooks, :math:`C` backward passes.

    Raises:
        ValueError: when a layer is not called exactly once in the forward pass.
    """
    seen: dict[str, list[tuple[Tensor, Tensor]]] = {layer.name: [] for layer in layers}

    def recorder(name: str):
        def hook(module, args, output):
            seen[name].append((args[0], output))

        return hook

    handles = [layer.module.register_forward_hook(recorder(layer.name)) for layer in layers]
    try:
        with torch.enable_grad():
            params = {k: p.requires_grad_(True) for k, p in fn.params().items()}
            f = torch.func.functional_call(fn.net, params, (x,))
            wrong = [name for name, calls in seen.items() if len(calls) != 1]
            if wrong:
                raise ValueError(f"layers {wrong} are not called exactly once per forward pass")
            outputs = [seen[layer.name][0][1] for layer in layers]
            grads: dict[str, list[Tensor]] = {layer.name: [] for layer in layers}
            for c in range(f.shape[1]):
                cot = torch.zeros_like(f)
                cot[:, c] = 1
                gs = torch.autograd.grad(f, outputs, cot, retain_graph=c + 1 < f.shape[1], allow_unused=True)
                for layer, g, z in zip(layers, gs, outputs):
                    grads[layer.name].append(layer_gradients(layer, torch.zeros_like(z) if g is None else g))
    finally:
        for handle in handles:
            handle.remove()
    return {
        layer.name: (layer_inputs(layer, seen[layer.name][0][0].detach()), torch.stack(grads[layer.name], dim=1))
        for layer in layers
    }


def layer_jacobian(a: Tensor, gamma: Tensor) -> Tensor:
    r"""The per-example layer Jacobians :math:`\sum_t \gamma_{nct} \bar a_{nt}^\top`, ``(n, C, d_out, d_a)``."""
    return torch.einsum("ncot,nit->ncoi", gamma, a)


def flat_layer_jacobian(layer: Layer, jac: Tensor) -> Tensor:
    """A layer Jacobian ``(n, C, d_out, d_a)`` in the network's parameter order: weight (row-major), then bias."""
    weight = jac[..., : layer.fan_in].flatten(-2)
    if layer.bias is None:
        return weight
    return torch.cat([weight, jac[..., layer.fan_in]], dim=-1)


def verified_layers(fn: NetworkFunction, probe: Tensor, layers: list[Layer], strict: bool) -> list[Layer]:
    """The ``layers`` whose Kronecker-form Jacobian equals ``jacrev``'s on the probe example ``probe[:1]``.

    Layers called more than once, or whose weight is shared or used elsewhere, fail. With ``strict`` a
    failure raises ``ValueError``; otherwise the layer is left out (its parameters take the generic route).
    """
    probe = probe[:1]
    usable = []
    for layer in layers:
        try:
            a, gamma = layer_features(fn, probe, [layer])[layer.name]
        except ValueError:
            if strict:
                raise
            continue
        names = [n for n in (layer.weight, layer.bias) if n is not None]
        exact = fn.jacobian(probe, names)
        approx = flat_layer_jacobian(layer, layer_jacobian(a, gamma))
        tol = 1e-4 if exact.dtype == torch.float32 else 1e-9
        if torch.allclose(approx, exact, rtol=tol, atol=tol * (1 + exact.abs().max().item())):
            usable.append(layer)
        elif strict:
            raise ValueError(
                f"layer '{layer.name}': its Jacobian is not the Kronecker form of its inputs and output "
                "gradients (a weight shared with another module, or used outside the layer's forward?)"
            )
    return usable


def layer_index(fn: NetworkFunction, layer: Layer) -> Tensor:
    r"""The position in the flat vector of :math:`\theta` of each entry of :math:`\Theta = [W \mid b]`,
    ``(d_out, d_a)`` (weight row-major, then the bias column)."""
    fan_in = layer.fan_in
    rows = torch.arange(layer.d_out, device=fn.device)[:, None]
    index = fn.offset(layer.weight) + rows * fan_in + torch.arange(fan_in, device=fn.device)[None, :]
    if layer.bias is not None:
        index = torch.cat([index, fn.offset(layer.bias) + rows], dim=1)
    return index


def project(a: Tensor, gamma: Tensor, out_basis: Tensor | None, in_basis: Tensor | None) -> tuple[Tensor, Tensor]:
    r""":math:`U_A^\top \bar a` and :math:`U_G^\top \gamma` (either basis ``None``: the identity)."""
    if in_basis is not None:
        a = torch.einsum("ij,nit->njt", in_basis, a)
    if out_basis is not None:
        gamma = torch.einsum("oj,ncot->ncjt", out_basis, gamma)
    return a, gamma


def kronecker_sandwich(
    a: Tensor, gamma: Tensor, weights: Tensor, out_basis: Tensor | None = None, in_basis: Tensor | None = None
) -> Tensor:
    r"""Per-point :math:`J_l \Sigma_l J_l^\top`, ``(n, C, C)``, for a layer covariance
    :math:`\Sigma_l = (U_G \otimes U_A) \operatorname{diag}(\operatorname{vec} W) (U_G \otimes U_A)^\top`.

    With one location (the review's eq. 16, prior included through :math:`W`):

    .. math::
        [J \Sigma_l J^\top]_{cc'} = \sum_o \tilde\gamma_{co} \tilde\gamma_{c'o} \sum_i \tilde a_i^2 W_{oi},
        \qquad \tilde a = U_A^\top \bar a, \ \tilde\gamma_c = U_G^\top \gamma_c,

    :math:`O(d_a^2 + C d_{out}^2 + d_{out} d_a + C^2 d_{out})` per point, never the Jacobian; with several
    locations (convolutions) the projected layer Jacobian :math:`U_G^\top J_c U_A` is formed per point,
    :math:`O(C d_{out} d_a T)`.

    Args:
        a: :math:`\bar a`, ``(n, d_a, T)``.
        gamma: :math:`\gamma`, ``(n, C, d_out, T)``.
        weights: :math:`W`, ``(d_out, d_a)``.
        out_basis: :math:`U_G` ``(d_out, d_out)`` or ``None`` (identity: a diagonal covariance).
        in_basis: :math:`U_A` ``(d_a, d_a)`` or ``None``.
    """
    a, gamma = project(a, gamma, out_basis, in_basis)
    if a.shape[-1] == 1:
        g = gamma[..., 0]
        return (g * (a[..., 0].square() @ weights.T).unsqueeze(1)) @ g.mT
    m = layer_jacobian(a, gamma)
    return torch.einsum("ncoi,ndoi,oi->ncd", m, m, weights)


def kronecker_root(
    a: Tensor, gamma: Tensor, weights: Tensor, out_basis: Tensor | None = None, in_basis: Tensor | None = None
) -> Tensor:
    r"""A root :math:`(U_G^\top J_c U_A) \odot W^{1/2}` of the layer's joint covariance, ``(n, C, d_out d_a)``
    (arguments as :func:`kronecker_sandwich`)."""
    a, gamma = project(a, gamma, out_basis, in_basis)
    return (layer_jacobian(a, gamma) * weights.sqrt()).flatten(-2)
