r"""Functional passes through a network at given parameters, shared by the NTK engine and the curvature.

Every pass uses ``torch.func.functional_call`` with a dictionary of (detached) parameters, so the network's
weights, ``requires_grad`` flags, mode and hooks are never touched. Buffers (BatchNorm statistics) are read
from the network as they are.

Inputs that require grad keep their autograd graph through every function here: the per-example Jacobians
and vector-Jacobian products are differentiable w.r.t. ``x`` (``torch.func`` composes with ordinary
autograd), which is how ``∂/∂x`` of a kernel or of a predictive is obtained.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vjp, vmap


def forward(net: nn.Module, params: dict[str, Tensor], x: Tensor) -> Tensor:
    r"""``f(x; θ)`` through ``functional_call``; ``params`` may hold a subset of the trainable parameters (the
    others are read from the network)."""
    return functional_call(net, params, (x,))


def per_example_jacobians(
    net: nn.Module, params: dict[str, Tensor], x: Tensor, names: Sequence[str]
) -> dict[str, Tensor]:
    r"""Per-example Jacobians :math:`\partial f(x_n) / \partial \theta_p` of the parameters ``names``.

    Args:
        net: the network.
        params: every trainable parameter, detached.
        x: prepared inputs ``(n, ...)``.
        names: the parameters to differentiate.

    Returns:
        ``{name: (n, C, numel)}``, by ``torch.func.vmap(jacrev)``; memory :math:`O(n C P_{names})`.
    """
    chosen = {k: params[k] for k in names}

    def single(sub: dict[str, Tensor], xi: Tensor) -> Tensor:
        return forward(net, {**params, **sub}, xi.unsqueeze(0)).squeeze(0)

    jac = vmap(jacrev(single), in_dims=(None, 0))(chosen, x)
    return {k: jac[k].reshape(x.shape[0], jac[k].shape[1], -1) for k in names}


def per_example_vjps(
    net: nn.Module, params: dict[str, Tensor], x: Tensor, cotangents: Tensor, names: Sequence[str]
) -> Tensor:
    r"""Rows :math:`J_n^\top u_{nm}` restricted to the parameters ``names``, shape ``(n, M, P_{names})``.

    Args:
        net: the network.
        params: every trainable parameter, detached.
        x: prepared inputs ``(n, ...)``.
        cotangents: :math:`u_{nm}` as ``(n, C, M)`` (column ``m`` of each example's matrix).
        names: parameter names, in the order of the columns returned.

    Returns:
        ``(n, M, P_names)``: one forward and ``M`` backward passes per example (``vmap`` over examples of
        ``vjp``); memory :math:`O(n M P)`.
    """
    chosen = {k: params[k] for k in names}

    def single(sub: dict[str, Tensor], xi: Tensor, ui: Tensor) -> dict[str, Tensor]:
        _, pull = vjp(lambda s: forward(net, {**params, **s}, xi.unsqueeze(0)).squeeze(0), sub)
        return vmap(pull)(ui.T)[0]

    rows = vmap(single, in_dims=(None, 0, 0))(chosen, x, cotangents)
    return torch.cat([rows[k].reshape(x.shape[0], cotangents.shape[-1], -1) for k in names], dim=-1)
