r"""Functional passes through a network at given parameters, shared by the NTK engine and the curvature.

Every pass runs on ntkgp's private structural copy of the network (:mod:`ntkgp.ntk.private_copy`, given here as
``net``), through ``torch.func.functional_call`` with a dictionary of (detached) parameters, so the user's module
(its parameters, ``requires_grad`` flags, mode and hooks) is never touched, not even for the length of a call.
Buffers (BatchNorm statistics) are read as they are. A copy flagged by the autodiff probe
(:mod:`ntkgp.ntk.autodiff`) runs its forward passes under
:func:`~ntkgp.ntk.private_copy.differentiable_kernels`.

Per-example functions take ``vectorized``: ``True`` maps over the examples by ``torch.func.vmap`` (one batched
pass); ``False`` loops over them (the networks whose forward cannot be vmapped over examples, e.g. ``nn.GRU``).
:func:`jvp_columns` pushes tangents forward by forward-mode AD or, for networks without forward-mode derivatives
(``parametrizations.weight_norm``), by the reverse-over-reverse product :math:`Ju = \partial_v (J^\top v)^\top u`.
Forward-mode passes hold :data:`FORWARD_AD_LOCK` (torch's forward-AD levels are process-wide).

Inputs that require grad keep their autograd graph through every function here: the per-example Jacobians
and vector-Jacobian products are differentiable w.r.t. ``x`` (``torch.func`` composes with ordinary
autograd), which is how ``∂/∂x`` of a kernel or of a predictive is obtained. Such passes (the inputs or the
parameters require grad, :func:`~ntkgp.ntk.exact_norms.keeps_graph`) run under
:func:`~ntkgp.ntk.exact_norms.exact_norms`: torch's batching and forward-mode rules of the layer norm (and of
the instance norm) are not exact when differentiated again, so these normalizations are computed from elementary
operations there. Inputs may be a tensor or a container of tensors sharing the leading batch dimension.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp, vjp, vmap
from torch.utils import _pytree as pytree

from .exact_norms import exact_norms, keeps_graph
from .private_copy import differentiable_kernels, use_kernels

#: Held around every forward-mode pass: torch's forward-AD levels (``torch.autograd.forward_ad``, which
#: ``torch.func.jvp`` enters and leaves) are process-wide, not per thread, so two threads in forward mode at once
#: would close each other's level. Reverse mode (``vmap``, ``jacrev``, ``vjp``) runs concurrently.
FORWARD_AD_LOCK = threading.RLock()


def call(net: nn.Module, params: dict[str, Tensor] | None, x) -> Tensor:
    """``net(x)`` (``params=None``: its own parameters) or ``f(x; θ)`` through ``functional_call``, under the
    differentiable kernels when the copy is flagged for them."""
    with differentiable_kernels(use_kernels(net)):
        return net(x) if params is None else functional_call(net, params, (x,))


def forward(net: nn.Module, params: dict[str, Tensor], x) -> Tensor:
    r"""``f(x; θ)`` through ``functional_call``; ``params`` may hold a subset of the trainable parameters (the
    others are read from the network)."""
    return call(net, params, x)


def _unsqueezed(x):
    return pytree.tree_map(lambda t: t.unsqueeze(0), x)


def _row(x, i: int):
    return pytree.tree_map(lambda t: t[i], x)


def _num_rows(x) -> int:
    return pytree.tree_leaves(x)[0].shape[0]


def _touched(out: Tensor, sub: dict[str, Tensor]) -> Tensor:
    """``out`` plus an exact zero that depends on every tensor of ``sub``: a parameter the forward never uses then
    has a zero derivative that ``torch.func`` batches like the others (an unused input's derivative is otherwise an
    unbatched zero, which some of its transforms cannot place)."""
    zero = sum((t.reshape(-1)[:1] * 0).sum() for t in sub.values())
    return out + zero


def per_example_jacobians(
    net: nn.Module, params: dict[str, Tensor], x, names: Sequence[str], vectorized: bool = True
) -> dict[str, Tensor]:
    r"""Per-example Jacobians :math:`\partial f(x_n) / \partial \theta_p` of the parameters ``names``.

    Args:
        net: the network (ntkgp's private copy).
        params: every trainable parameter, detached.
        x: prepared inputs ``(n, ...)``.
        names: the parameters to differentiate.
        vectorized: ``vmap`` over the examples (else one ``jacrev`` per example).

    Returns:
        ``{name: (n, C, numel)}``, by ``torch.func.vmap(jacrev)``; memory :math:`O(n C P_{names})`. A parameter the
        forward never uses has zero columns.
    """
    chosen = {k: params[k] for k in names}

    def single(sub: dict[str, Tensor], xi) -> Tensor:
        return _touched(forward(net, {**params, **sub}, _unsqueezed(xi)).squeeze(0), sub)

    with exact_norms(keeps_graph(x, params)):
        if vectorized:
            jac = vmap(jacrev(single), in_dims=(None, 0))(chosen, x)
        else:
            each = [jacrev(single)(chosen, _row(x, i)) for i in range(_num_rows(x))]
            jac = {k: torch.stack([j[k] for j in each]) for k in names}
    n = _num_rows(x)
    return {k: jac[k].reshape(n, jac[k].shape[1], -1) for k in names}


def per_example_vjps(
    net: nn.Module, params: dict[str, Tensor], x, cotangents: Tensor, names: Sequence[str],
    vectorized: bool = True,
) -> Tensor:
    r"""Rows :math:`J_n^\top u_{nm}` restricted to the parameters ``names``, shape ``(n, M, P_{names})``.

    Args:
        net: the network (ntkgp's private copy).
        params: every trainable parameter, detached.
        x: prepared inputs ``(n, ...)``.
        cotangents: :math:`u_{nm}` as ``(n, C, M)`` (column ``m`` of each example's matrix).
        names: parameter names, in the order of the columns returned.
        vectorized: ``vmap`` over the examples (else one ``vjp`` per example).

    Returns:
        ``(n, M, P_names)``: one forward and ``M`` backward passes per example (``vmap`` over examples of
        ``vjp``); memory :math:`O(n M P)`.
    """
    chosen = {k: params[k] for k in names}

    def single(sub: dict[str, Tensor], xi, ui: Tensor) -> dict[str, Tensor]:
        _, pull = vjp(lambda s: _touched(forward(net, {**params, **s}, _unsqueezed(xi)).squeeze(0), s), sub)
        return vmap(pull)(ui.T)[0]

    with exact_norms(keeps_graph(x, params)):
        if vectorized:
            rows = vmap(single, in_dims=(None, 0, 0))(chosen, x, cotangents)
        else:
            each = [single(chosen, _row(x, i), cotangents[i]) for i in range(_num_rows(x))]
            rows = {k: torch.stack([r[k] for r in each]) for k in names}
    n = _num_rows(x)
    return torch.cat([rows[k].reshape(n, cotangents.shape[-1], -1) for k in names], dim=-1)


def vjp_columns(net: nn.Module, params: dict[str, Tensor], x, names: Sequence[str], v: Tensor
                ) -> dict[str, Tensor]:
    r""":math:`J(X)^\top V` of the parameters ``names`` for cotangent columns ``v`` ``(n, C, k)``: one forward and
    ``k`` backward passes of the batch, ``{name: (*shape, k)}`` (an unused parameter's entries are zero)."""
    sub = {k: params[k] for k in names}
    with exact_norms(keeps_graph(x, params)):
        _, pull = vjp(lambda s: _touched(forward(net, {**params, **s}, x), s), sub)
        grads = vmap(pull, in_dims=-1, out_dims=0)(v)[0]
    return {k: g.movedim(0, -1) for k, g in grads.items()}


def jvp_columns(net: nn.Module, params: dict[str, Tensor], x, tangents: dict[str, Tensor],
                forward_mode: bool = True) -> tuple[Tensor, Tensor]:
    r""":math:`f(x)` ``(n, C)`` and :math:`J(X) u_s` ``(S, n, C)`` for parameter-shaped tangents
    ``{name: (S, *shape)}``.

    ``forward_mode``: ``torch.func.jvp`` vectorized over the tangents (about three forward passes per tangent).
    Otherwise reverse over reverse: :math:`g(v) = J^\top v` is linear in :math:`v` and its vector-Jacobian product
    with :math:`u` is :math:`J u` (one forward, one backward and, per tangent, one double-backward pass), for the
    networks whose operations have no forward-mode derivative."""
    primals = {k: params[k] for k in tangents}

    def f(s: dict[str, Tensor]) -> Tensor:
        return forward(net, {**params, **s}, x)

    with exact_norms(keeps_graph(x, params)):
        if forward_mode:
            def push(tangent: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
                return jvp(f, (primals,), (tangent,))

            with FORWARD_AD_LOCK:  # torch's forward-AD levels are process-wide: one forward-mode pass at a time
                outs, pushed = vmap(push)(tangents)
            return outs[0], pushed
        out, pull = vjp(lambda s: _touched(f(s), s), primals)

        def transposed(v: Tensor) -> dict[str, Tensor]:
            return pull(v)[0]

        _, pull2 = vjp(transposed, torch.zeros_like(out))
        pushed = vmap(lambda t: pull2(t)[0])(tangents)
        return out, pushed
