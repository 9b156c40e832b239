r"""The structured strategy of the NTK engine: Grams of the layers with one location per example from their
layer features.

For such a layer (``nn.Linear`` on ``(N, d)`` inputs) the Gram factorises (``docs/math.md``, "Structured form"):

.. math::
    [J_W(x) J_W(x')^\top]_{cc'} = (a(x) \cdot a(x'))\,(\gamma_c(x) \cdot \gamma_{c'}(x')), \qquad
    [J_b(x) J_b(x')^\top]_{cc'} = \gamma_c(x) \cdot \gamma_{c'}(x'),

so only the layer inputs :math:`a` and the back-propagated output gradients :math:`\gamma_c = \partial f_c /
\partial z` are computed (:mod:`ntkgp.ntk.feature_pass`), never the Jacobian. The functions here add the terms
of a chunk of rows against a set of columns; the layers with several locations per example and the other
parameters are contracted (:mod:`ntkgp.ntk.contraction`), and :mod:`ntkgp.ntk.grams` drives the chunks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..memory import STRUCTURED_BLOCK_BYTES, chunk_rows
from .feature_pass import ChunkFeatures
from .features import Layer
from .layer_plan import LayerPlan
from .network import NetworkCore


def layer_terms(core: NetworkCore, layer: Layer) -> list[tuple[int, int | None]]:
    """The layer's terms ``(group, shift)``, the term's input factor being ``a·a' + shift`` (``None``: no
    factor). Weight and bias in one group make one term with the factor ``a·a' + 1``; otherwise the weight's
    term has the factor ``a·a'`` and the bias's none."""
    group = dict(zip(core.groups.names, core.groups.group_of))
    if layer.weight is not None and layer.bias is not None and group[layer.weight] == group[layer.bias]:
        return [(group[layer.weight], 1)]
    return [(group[n], 0 if n == layer.weight else None) for n in layer.parameter_names]


def _factor(aa: Tensor | None, shift: int | None, in_place: bool = False) -> Tensor | None:
    """``aa + shift`` (``None`` for no factor, or without ``aa``); ``in_place`` forms it in ``aa``'s memory."""
    if shift is None or aa is None:
        return None
    if shift == 0:
        return aa
    return aa.add_(shift) if in_place else aa + shift


def term_groups(core: NetworkCore, plan: LayerPlan) -> set[int]:
    """The groups the single-location layers write (the other groups of a Gram start at zero)."""
    return {g for layer in plan.single for g, _ in layer_terms(core, layer)}


def gram_rows(core: NetworkCore, plan: LayerPlan, out: Tensor, start: int, f1: ChunkFeatures, f2: ChunkFeatures,
              c: int, graph: bool) -> None:
    """Write the single-location layers' terms of the rows ``f1`` (inputs ``start:``) against all of ``f2`` into
    ``out`` ``(G, N1·C, N2·C)``: the first term of a group is written, later ones added.

    Without ``graph`` every term is formed a block of rows at a time, its input factor ``a·a' (+ 1)`` too: a group
    met for the first time is written in place (``mm`` into the rows of ``out[g]``, then ``mul_``), later ones are
    added, so nothing of the size of ``out`` is allocated besides ``out`` itself (a few temporaries of about
    :data:`ntkgp.memory.STRUCTURED_BLOCK_BYTES` each). With ``graph`` the same terms are formed out of place (differentiable).
    """
    written: set[int] = set()
    n2 = next(iter(f2.inputs.values())).shape[0] if f2.inputs else 0
    for layer in plan.single:
        m, terms = layer.name, layer_terms(core, layer)
        g1, g2 = f1.grads[m], f2.grads[m]
        n1 = f1.inputs[m].shape[0]
        weight = layer.weight is not None
        if graph:
            aa = f1.inputs[m] @ f2.inputs[m].T if weight else None
            rows = slice(start * c, (start + n1) * c)
            for g, shift in terms:
                factor = _factor(aa, shift)
                term = g1 @ g2.T
                if factor is not None:
                    term = (term.view(n1, c, n2, c) * factor[:, None, :, None]).view(n1 * c, n2 * c)
                out[g, rows] = out[g, rows] + term if g in written else term
                written.add(g)
            continue
        a1, a2 = (f1.inputs[m], f2.inputs[m]) if weight else (None, None)
        fresh = {g for g, _ in terms if g not in written}
        block_rows = chunk_rows(STRUCTURED_BLOCK_BYTES, n2 * c * c, g1.dtype)  # a block: rows·C × N2·C numbers
        for s in range(0, n1, block_rows):
            e = min(s + block_rows, n1)
            aa = a1[s:e] @ a2.T if weight else None
            for g, shift in terms:
                factor = _factor(aa, shift, in_place=True)
                target = out[g, (start + s) * c : (start + e) * c]
                if g in fresh:
                    torch.mm(g1[s * c : e * c], g2.T, out=target)
                    if factor is not None:
                        target.view(e - s, c, n2, c).mul_(factor[:, None, :, None])
                else:
                    block = (g1[s * c : e * c] @ g2.T).view(e - s, c, n2, c)
                    if factor is not None:
                        block.mul_(factor[:, None, :, None])
                    target.add_(block.view((e - s) * c, n2 * c))
        written |= fresh


def output_gram_rows(core: NetworkCore, plan: LayerPlan, out: Tensor, f1: ChunkFeatures, f2: ChunkFeatures, c: int,
                     graph: bool) -> None:
    """Add the single-location layers' per-output Grams ``(a·a' + 1)(γ_c·γ'_c)`` of the rows ``f1`` against all of
    ``f2`` to ``out`` ``(G, C, n1, N2)`` (the rows' part of the result)."""
    for layer in plan.single:
        m = layer.name
        n1, n2 = f1.inputs[m].shape[0], f2.inputs[m].shape[0]
        gam1 = f1.grads[m].view(n1, c, -1).transpose(0, 1)
        gam2 = f2.grads[m].view(n2, c, -1).transpose(0, 1)
        per_output = torch.bmm(gam1, gam2.transpose(1, 2))  # (C, n1, N2)
        aa = f1.inputs[m] @ f2.inputs[m].T if layer.weight is not None else None
        terms = [(g, _factor(aa, shift)) for g, shift in layer_terms(core, layer)]
        terms.sort(key=lambda t: t[1] is not None)  # the plain term first: the factored one may then scale in place
        for i, (g, factor) in enumerate(terms):
            if factor is None:
                out[g] += per_output
            elif not graph and i == len(terms) - 1:  # its last use: no second (C, n1, N2) temporary
                out[g] += per_output.mul_(factor)
            else:
                out[g] += per_output * factor


def output_diagonal(core: NetworkCore, plan: LayerPlan, diag: Tensor, f: ChunkFeatures, c: int) -> None:
    """Add the single-location layers' output diagonals of the per-point blocks, ``(a·a + 1)(γ_c·γ_c)``, to
    ``diag`` ``(G, N, C)``."""
    for layer in plan.single:
        m = layer.name
        n = f.inputs[m].shape[0]
        gg = f.grads[m].view(n, c, -1).square().sum(-1)  # (N, C)
        aa = f.inputs[m].square().sum(-1)[:, None] if layer.weight is not None else None
        for g, shift in layer_terms(core, layer):
            factor = _factor(aa, shift)
            diag[g] += gg if factor is None else gg * factor


def diag_block_rows(core: NetworkCore, plan: LayerPlan, out: Tensor, f: ChunkFeatures, c: int) -> None:
    """Add the single-location layers' per-point blocks ``(a·a)(γ_c·γ_c')`` to ``out`` ``(G, n, C, C)``."""
    for layer in plan.single:
        m = layer.name
        n = f.inputs[m].shape[0]
        gam = f.grads[m].view(n, c, -1)
        gg = gam @ gam.transpose(-1, -2)
        aa = (f.inputs[m] ** 2).sum(-1)[:, None, None] if layer.weight is not None else None
        for g, shift in layer_terms(core, layer):
            factor = _factor(aa, shift)
            out[g] += gg if factor is None else gg * factor
