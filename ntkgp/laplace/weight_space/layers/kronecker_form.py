r"""Per-layer Jacobians in Kronecker-factored form at test inputs, and the GLM closed forms built on them.

For a layer :math:`z_t = \Theta \bar a_t` with :math:`\Theta = [W \mid b]` (``nn.Linear``; ``nn.Conv2d`` on
unfolded patches, :math:`t` the location) and :math:`\bar a = [a; 1]` (the 1 only when the bias is in
:math:`\theta`), row :math:`c` of the layer's Jacobian of example :math:`n` is

.. math::
    \partial f_c(x_n) / \partial \Theta = \sum_t \gamma_{nct} \, \bar a_{nt}^\top,
    \qquad \gamma_{nct} = \partial f_c(x_n) / \partial z_{nt},

a ``(d_out, d_a)`` matrix in the row-major order of :math:`\operatorname{vec}(\Theta)` (output index major),
the order of the KFAC blocks of :mod:`ntkgp.laplace.weight_space`. With one location it is the outer product
:math:`\gamma_{nc} \bar a_n^\top` (:math:`a_{l-1} \otimes g_l` in the review of GLM-predictive estimators,
``docs/predictive.md``), so the GLM closed forms need :math:`\bar a` and :math:`\gamma` only. Both come
from ntkgp's one layer-feature machinery (:mod:`ntkgp.ntk.features`: one forward pass with hooks,
:math:`C` backward passes, one safety rule, layers verified against autograd on a probe example).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ....ntk.features import Layer
from ....ntk.network import NetworkCore


def layer_index(fn: NetworkCore, layer: Layer) -> Tensor:
    r"""The position in the flat vector of :math:`\theta` of each entry of :math:`\Theta = [W \mid b]`,
    ``(d_out, d_a)`` (weight row-major, then the bias column)."""
    return layer.index(fn.offset, fn.device)


def kronecker_features(
    fn: NetworkCore, x: Tensor, layers: Sequence[Layer]
) -> dict[str, tuple[Tensor, Tensor]]:
    r"""For a prepared batch ``x``: per layer :math:`\bar a` ``(n, d_a, T)`` and :math:`\gamma`
    ``(n, C, d_out, T)``."""
    features = fn.features(x, list(layers))
    return {layer.name: (layer.fold(features.inputs[layer.name]), features.grads[layer.name]) for layer in layers}


def layer_jacobian(a: Tensor, gamma: Tensor) -> Tensor:
    r"""The per-example layer Jacobians :math:`\sum_t \gamma_{nct} \bar a_{nt}^\top`,
    ``(n, C, d_out, d_a)``."""
    return torch.einsum("ncot,nit->ncoi", gamma, a)


def project(
    a: Tensor, gamma: Tensor, out_basis: Tensor | None, in_basis: Tensor | None
) -> tuple[Tensor, Tensor]:
    r""":math:`U_A^\top \bar a` and :math:`U_G^\top \gamma` (either basis ``None``: the identity)."""
    if in_basis is not None:
        a = in_basis.T @ a
    if out_basis is not None:
        gamma = out_basis.T @ gamma
    return a, gamma


def kronecker_sandwich(
    a: Tensor, gamma: Tensor, weights: Tensor, out_basis: Tensor | None = None, in_basis: Tensor | None = None
) -> Tensor:
    r"""Per-point :math:`J_l \Sigma_l J_l^\top`, ``(n, C, C)``, for a layer covariance
    :math:`\Sigma_l = (U_G \otimes U_A) \operatorname{diag}(\operatorname{vec} W) (U_G \otimes U_A)^\top`.

    With one location (the review's eq. 16, the prior included through :math:`W`):

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
    m = layer_jacobian(a, gamma).flatten(-2)  # (n, C, d_out d_a)
    return (m * weights.reshape(-1)) @ m.mT


def kronecker_root(
    a: Tensor, gamma: Tensor, weights: Tensor, out_basis: Tensor | None = None, in_basis: Tensor | None = None
) -> Tensor:
    r"""A root :math:`(U_G^\top J_c U_A) \odot W^{1/2}` of the layer's joint covariance, ``(n, C, d_out d_a)``
    (arguments as :func:`kronecker_sandwich`)."""
    a, gamma = project(a, gamma, out_basis, in_basis)
    return (layer_jacobian(a, gamma) * weights.sqrt()).flatten(-2)


class _SandwichRoots:
    r"""The ``reduce`` hook of one feature pass (:func:`ntkgp.ntk.features.layer_features`) that turns each
    cotangent column's output gradients into the rows of a root of :func:`kronecker_sandwich` right away: a
    layer's projected inputs are formed once (at the first column), and no column's gradients are kept."""

    def __init__(self, covariances: dict[str, tuple[Tensor, Tensor | None, Tensor | None]]) -> None:
        self.covariances = covariances
        self.inputs: dict[str, Tensor] = {}
        self.roots: dict[str, list[Tensor]] = {name: [] for name in covariances}

    def __call__(self, layer: Layer, a: Tensor, g: Tensor, m: int, count: int) -> None:
        weights, out_basis, in_basis = self.covariances[layer.name]
        if m == 0:  # U_Aᵀ ā, once per chunk; one location: the per-output variances s_o = Σ_i ã_i² W_oi
            a_bar = layer.fold(a)
            if a_bar.shape[-1] == 1:
                a_t = a_bar[..., 0] if in_basis is None else a_bar[..., 0] @ in_basis
                self.inputs[layer.name] = (a_t.square() @ weights.T).sqrt()
            else:
                self.inputs[layer.name] = a_bar if in_basis is None else in_basis.T @ a_bar
        projected = self.inputs[layer.name]
        if g.shape[-1] == 1:  # (n, d_out): γ̃ ⊙ √s
            g_t = g[..., 0] if out_basis is None else g[..., 0] @ out_basis
            self.roots[layer.name].append(g_t * projected)
            return None
        if out_basis is not None and g.shape[-1] <= projected.shape[1]:  # U_Gᵀ on the cheaper side
            block = torch.bmm(out_basis.T @ g, projected.mT)
        else:
            block = torch.bmm(g, projected.mT)
            block = block if out_basis is None else out_basis.T @ block
        self.roots[layer.name].append((block * weights.sqrt()).flatten(1))  # (U_Gᵀ J_m U_A) ⊙ W^{1/2}
        return None


def kronecker_covariances(
    fn: NetworkCore, x: Tensor, layers: Sequence[Layer],
    covariances: Sequence[tuple[Tensor, Tensor | None, Tensor | None]],
) -> Tensor:
    r""":math:`\sum_l J_l \Sigma_l J_l^\top` per point of a prepared chunk ``x``, ``(n, C, C)``, for layer covariances
    given as ``(W, U_G, U_A)`` (:func:`kronecker_sandwich`): one forward and :math:`C` backward passes, each
    column's gradients reduced as they come to the rows of a root (one location:
    :math:`\tilde\gamma_c \odot \sqrt{s}`, :math:`s_o = \sum_i \tilde a_i^2 W_{oi}`; several: the projected layer
    Jacobian :math:`(U_G^\top \Gamma_c)(U_A^\top \bar a)^\top \odot W^{1/2}`, one batched product), then one batched
    product of the roots. Memory: the roots, :math:`n C \sum_l d_{out} d_a` for the layers with several locations
    (:math:`n C d_{out}` for the others), and one column's gradients."""
    hook = _SandwichRoots({layer.name: cov for layer, cov in zip(layers, covariances)})
    fn.features(x, list(layers), reduce=hook)
    out = 0
    for layer in layers:
        root = torch.stack(hook.roots[layer.name], dim=1)  # (n, C, R_l)
        out = out + root @ root.mT
    return out
