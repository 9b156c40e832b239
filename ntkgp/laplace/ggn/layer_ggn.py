r"""The dense weight-space GGN of a network of linear layers from its layer features, block by block.

For a linear layer :math:`l` with bias-augmented input :math:`\bar a^l_n` (``(d_a^l,)``,
:meth:`~ntkgp.ntk.features.Layer.fold`) and :math:`\Gamma^l_n = \tilde L_n^\top G^l_n` (``(M, d_out^l)``: the
Jacobian :math:`G^l_n` of the ``C`` outputs w.r.t. the layer's pre-activations, times the unit root
:math:`\tilde L_n`), the rows of :math:`\tilde L_n^\top J_n` on :math:`\Theta^l = [W^l \mid b^l]` are
:math:`\Gamma^l_{nma} \bar a^l_{ni}`, so the block of layers :math:`l, m` of
:math:`D = \sum_n J_n^\top \tilde\Lambda_n J_n` is

.. math::
    D_{lm}[(a, i), (b, j)] = \sum_n \bar a^l_{ni} \bar a^m_{nj}\, M^{lm}_{nab}, \qquad
    M^{lm}_n = \Gamma^{l\top}_n \Gamma^m_n = G^{l\top}_n \tilde\Lambda_n G^m_n,

one matrix product per block over a chunk of examples, ``(n, d_a^l d_a^m)ᵀ @ (n, d_out^l d_out^m)``:
:math:`N P_l P_m` multiply-adds instead of the :math:`N M P_l P_m` of the Gram of the rows (``docs/math.md``,
"GGN from layer features"). Only the blocks :math:`l \le m` are formed, the others are their transposes; a
diagonal block is symmetric in :math:`(i, j)` and in :math:`(a, b)` separately, so only the pairs
:math:`i \le j`, :math:`a \le b` are summed (about a quarter of the block).
Memory: the :math:`P^2` of :math:`D` and at most :math:`P^2/2` for the blocks' sums, plus per block pair and chunk of
``n`` examples :math:`n (d_a^l d_a^m + d_out^l d_out^m)` numbers (``n`` lowered to keep this within
:math:`\max(P^2/4, 2^{20})`), plus the chunk's features :math:`n (\sum_l d_a^l +
M \sum_l d_out^l)`.

The pass over the examples shows its progress as the caller's ``progress`` asks (``"GGN layer blocks"``, or
``"name (GGN layer blocks)"`` within :func:`~ntkgp.progress.reporting`; the core's own chunk passes are silent
within it): the evidence's weight-space route passes its kernel's option.

It applies (:func:`layer_ggn_layers`) to the GGN with a single output scale (one component: classification, or
a Gaussian likelihood with one noise) when every trainable parameter belongs to a verified ``nn.Linear`` /
``nn.Conv2d`` layer of the NTK engine's layer plan with one location per example, and when its multiply-add
count is below the rows route's; otherwise the caller takes the rows route.
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from ...memory import LAYER_GGN_MIN_BYTES, chunk_rows, itemsize
from ...ntk.features import Layer
from ...ntk.network import NetworkCore
from ...progress import Progress, reporting
from .scaling import unit_hessian_sqrt

__all__ = ["blocks_of_root", "layer_ggn", "layer_ggn_components", "layer_ggn_layers"]


def layer_ggn_layers(
    core: NetworkCore, plan, num_rows: int, fisher: bool, per_output: bool
) -> tuple[Layer, ...] | None:
    r"""The layers of the block route, or ``None`` when it does not apply or costs more than the rows route.

    Args:
        core: the network.
        plan: its :class:`~ntkgp.ntk.layer_plan.LayerPlan` for the inputs.
        num_rows: ``M``, the columns of the unit root per example (the rows route's :math:`N M P^2 / 2`).
        fisher: the empirical Fisher (not handled).
        per_output: one component per output (not handled).
    """
    if fisher or per_output or plan.generic or plan.multi or not plan.layers:
        return None
    covered = [name for layer in plan.layers for name in layer.parameter_names]
    if sorted(covered) != sorted(core.names):
        return None
    ins = [layer.fan_in + (layer.bias is not None) for layer in plan.layers]
    outs = [layer.d_out for layer in plan.layers]
    num_params = sum(a * o for a, o in zip(ins, outs))
    # per example: the blocks l < m (P_l P_m), the triangles of the diagonal ones, their M^{lm}
    # (M d_out^l d_out^m), against the rows' M P (P + 1) / 2
    half = [a * (a + 1) * o * (o + 1) // 4 for a, o in zip(ins, outs)]
    pairs = [(i, j) for i in range(len(ins)) for j in range(i + 1, len(ins))]
    blocks = sum(half) + sum(ins[i] * outs[i] * ins[j] * outs[j] for i, j in pairs)
    products = num_rows * (sum(o * o for o in outs) + sum(outs[i] * outs[j] for i, j in pairs))
    if blocks + products >= num_rows * num_params * (num_params + 1) / 2:
        return None
    return tuple(plan.layers)


def layer_ggn(core: NetworkCore, layers: tuple[Layer, ...], x: Tensor, root: Tensor, chunk_size: int = 256,
              progress: bool | None = False) -> Tensor:
    r""":math:`D = \sum_n J_n^\top R_n R_n^\top J_n` ``(P, P)`` (columns in the order of ``core.names``) from
    the layer features of ``layers`` (module docstring), in the dtype of ``root``, exactly symmetric.

    Args:
        core: the network; ``layers`` its verified layers covering every trainable parameter, one location each.
        x: prepared inputs ``(N, ...)``.
        root: the cotangents :math:`R_n` ``(N, C, M)`` (the GGN's unit root :math:`\tilde L_n`, with
            :math:`\tilde L_n \tilde L_n^\top = \tilde\Lambda_n`).
        chunk_size: examples per chunk at most (fewer where a block pair's temporaries would exceed
            :math:`\max(P^2/4, 2^{20})` numbers).
        progress: over the examples (module docstring; :mod:`ntkgp.progress`).
    """
    dtype, device = root.dtype, root.device
    count = len(layers)
    index = [layer.index(core.offset, device).reshape(-1) for layer in layers]
    shapes = [(layer.fan_in + (layer.bias is not None), layer.d_out) for layer in layers]
    pairs = [(i, j) for i in range(count) for j in range(i, count)]
    # a diagonal block is symmetric in (i, j) and in (a, b) separately: only the pairs i <= j, a <= b are summed
    tri = {d: torch.triu_indices(d, d, device=device) for i in range(count) for d in shapes[i]}
    sizes = {(i, j): (tri[shapes[i][0]].shape[1], tri[shapes[i][1]].shape[1]) if i == j else
             (shapes[i][0] * shapes[j][0], shapes[i][1] * shapes[j][1]) for i, j in pairs}
    sums = {pair: torch.zeros(*sizes[pair], dtype=dtype, device=device) for pair in pairs}
    # the temporaries of a block pair, chunk · (rows + columns) numbers, stay within a quarter of the P² of D
    # (at least LAYER_GGN_MIN_BYTES)
    width = max(rows + cols for rows, cols in sizes.values())
    budget = max(core.num_params**2 // 4 * itemsize(dtype), LAYER_GGN_MIN_BYTES)
    chunk_size = chunk_rows(budget, width, dtype, chunk_size)
    name = getattr(core, "pass_name", None)  # set by ntkgp.progress.reporting
    desc = f"{name} (GGN layer blocks)" if name else "GGN layer blocks"
    with Progress(x.shape[0], desc, progress, unit="point") as bar, reporting(core, False, desc):
        for start in range(0, x.shape[0], chunk_size):
            part = slice(start, start + chunk_size)
            features = core.features(x[part], layers, root[part])
            inputs = [layer.fold(features.inputs[layer.name])[..., 0].to(dtype) for layer in layers]  # (n, d_a)
            grads = [features.grads[layer.name][..., 0].to(dtype) for layer in layers]  # (n, M, d_out)
            n = inputs[0].shape[0]
            for (i, j), total in sums.items():
                weights = torch.bmm(grads[i].transpose(1, 2), grads[j])  # M^{ij}_n, (n, d_out^i, d_out^j)
                if i == j:
                    (p, q), (r, t) = tri[shapes[i][0]], tri[shapes[i][1]]
                    outer, weights = inputs[i][:, p] * inputs[i][:, q], weights[:, r, t]
                else:
                    outer = (inputs[i][:, :, None] * inputs[j][:, None, :]).reshape(n, -1)
                    weights = weights.reshape(n, -1)
                total.addmm_(outer.T, weights)
            bar.update(n)
    out = torch.empty(core.num_params, core.num_params, dtype=dtype, device=device)
    for (i, j), total in sums.items():
        (ai, oi), (aj, oj) = shapes[i], shapes[j]
        if i == j:  # the full (i, j, a, b) from the triangles: exactly symmetric
            total = total[_positions(ai, device)][:, _positions(oi, device)]
        block = total.view(ai, aj, oi, oj).permute(2, 0, 3, 1).reshape(ai * oi, aj * oj)  # rows (a, i), cols (b, j)
        out[index[i][:, None], index[j][None, :]] = block
        if i != j:
            out[index[j][:, None], index[i][None, :]] = block.T
    return out


def _positions(d: int, device) -> Tensor:
    """For each ``(i, j)`` of a ``d × d`` symmetric array, row-major, its position among the pairs ``i <= j`` of
    ``torch.triu_indices``, ``(d²,)``."""
    upper = torch.zeros(d, d, dtype=torch.long, device=device)
    rows, cols = torch.triu_indices(d, d, device=device)
    upper[rows, cols] = torch.arange(rows.shape[0], device=device)
    return torch.maximum(upper, upper.T).reshape(-1)  # the lower entries are 0 before the maximum


def blocks_of_root(core: NetworkCore, plan, x: Tensor, root: Tensor, progress: bool | None = False) -> Tensor | None:
    r""":math:`\sum_n J_n^\top R_n R_n^\top J_n` ``(P, P)`` by :func:`layer_ggn` (dtype of ``root``), or ``None``
    where the rows route applies or is cheaper (:func:`layer_ggn_layers`); ``plan`` the layer plan of the prepared
    ``x``, ``root`` ``(N, C, M)``; ``progress`` over the examples (:func:`layer_ggn`)."""
    layers = layer_ggn_layers(core, plan, root.shape[-1], False, False)
    return None if layers is None else layer_ggn(core, layers, x, root, progress=progress)


def layer_ggn_components(
    core: NetworkCore, plan, x: Tensor, likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor,
    fisher: bool, progress: bool | None = False,
) -> Tensor | None:
    r"""The components ``(1, P, P)`` of the dense GGN by the block route, in the dtype of ``f``, or ``None`` where
    the rows route applies or is cheaper (:func:`blocks_of_root`).

    Args:
        core: the network; ``plan`` its layer plan for ``x`` (prepared inputs ``(N, ...)``).
        likelihood: the likelihood; ``scale0`` its output scale :math:`s_0` (detached) for the unit root.
        f, y: outputs ``(N, C)`` at ``x`` and normalized targets.
        fisher: the empirical Fisher (always ``None``).
        progress: over the examples (:func:`layer_ggn`).
    """
    if fisher or scale0.shape[0] != 1:
        return None
    blocks = blocks_of_root(core, plan, x, unit_hessian_sqrt(likelihood, f, y, scale0).to(f), progress)
    return None if blocks is None else blocks[None]
