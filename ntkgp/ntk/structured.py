r"""The structured strategy of the NTK engine: Grams of the layers with one location per example from their
layer features.

For such a layer (``nn.Linear`` on ``(N, d)`` inputs) the Gram factorises (``docs/math.md``, "Structured form"):

.. math::
    [J_W(x) J_W(x')^\top]_{cc'} = (a(x) \cdot a(x'))\,(\gamma_c(x) \cdot \gamma_{c'}(x')), \qquad
    [J_b(x) J_b(x')^\top]_{cc'} = \gamma_c(x) \cdot \gamma_{c'}(x'),

so only the layer inputs :math:`a` and the back-propagated output gradients :math:`\gamma_c = \partial f_c /
\partial z` are computed (:mod:`ntkgp.ntk.features`), never the Jacobian. The layers with several locations
per example and the other parameters are contracted (:mod:`ntkgp.ntk.contraction`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .features import Layer
from .layer_plan import LayerPlan
from .network import NetworkCore


@dataclass
class Features:
    """Layer inputs ``a`` ``(n, d_in)`` and output gradients ``Γ`` ``(n·C, d_out)`` of the single-location layers."""

    inputs: dict[str, Tensor]
    grads: dict[str, Tensor]


def factored_features(core: NetworkCore, x: Tensor, plan: LayerPlan, graph: bool = False) -> tuple[Tensor, Features]:
    """Outputs and features of the plan's single-location layers over all of ``x``, chunk by chunk (memory
    ``O(N·C·Σ d_out)``)."""
    layers = plan.single
    fs, inputs, grads = [], {la.name: [] for la in layers}, {la.name: [] for la in layers}
    for s, e in core.chunks(x.shape[0], "layer features"):
        feats = core.features(x[s:e], layers, graph=graph)
        fs.append(feats.outputs)
        for layer in layers:
            a, g = feats.inputs[layer.name], feats.grads[layer.name]  # (n, d_in, T), (n, C, d_out, T)
            if a.shape[-1] != 1:
                raise RuntimeError(f"layer '{layer.name}' changed its number of locations since the plan was made")
            inputs[layer.name].append(a[..., 0])
            grads[layer.name].append(g[..., 0].reshape(-1, g.shape[2]))
    return torch.cat(fs), Features(
        inputs={m: torch.cat(v) for m, v in inputs.items()}, grads={m: torch.cat(v) for m, v in grads.items()}
    )


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


def structured_grams(core: NetworkCore, plan: LayerPlan, out, x1, x2, sym, c: int, graph: bool) -> set[int]:
    """Write the single-location layers' terms into ``out`` ``(G, N1·C, N2·C)``; returns the groups written.

    Without ``graph`` every term is formed a block of rows at a time, its input factor ``a·a' (+ 1)`` too: a group
    met for the first time is written in place (``mm`` into the rows of ``out[g]``, then ``mul_``), later ones are
    added, so nothing of the size of ``out`` is allocated besides ``out`` itself (a few temporaries of about
    2²² numbers each). With ``graph`` the same terms are formed out of place (differentiable).
    """
    f1 = factored_features(core, x1, plan, graph)[1]
    f2 = f1 if sym else factored_features(core, x2, plan, graph)[1]
    n1, n2 = x1.shape[0], x2.shape[0]
    written: set[int] = set()
    for layer in plan.single:
        m, terms = layer.name, layer_terms(core, layer)
        g1, g2 = f1.grads[m], f2.grads[m]
        weight = layer.weight is not None
        if graph:
            aa = f1.inputs[m] @ f2.inputs[m].T if weight else None
            for g, shift in terms:
                factor = _factor(aa, shift)
                term = g1 @ g2.T
                if factor is not None:
                    term = (term.view(n1, c, n2, c) * factor[:, None, :, None]).view(n1 * c, n2 * c)
                out[g] = out[g] + term if g in written else term
                written.add(g)
            continue
        a1, a2 = (f1.inputs[m], f2.inputs[m]) if weight else (None, None)
        fresh = {g for g, _ in terms if g not in written}
        rows = max(1, (1 << 22) // max(1, n2 * c * c))  # a block of the term: rows·C × N2·C numbers
        for s in range(0, n1, rows):
            e = min(s + rows, n1)
            aa = a1[s:e] @ a2.T if weight else None
            for g, shift in terms:
                factor = _factor(aa, shift, in_place=True)
                target = out[g, s * c : e * c]
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
    return written


def structured_output_grams(core: NetworkCore, plan: LayerPlan, out, diag, x1, x2, sym, c: int, graph: bool) -> None:
    """Add the single-location layers' per-output Grams ``(a·a' + 1)(γ_c·γ'_c)`` to ``out`` ``(G, C, N1, N2)``
    and, when ``diag`` is given, the output diagonals of the per-point blocks of ``x2`` to ``diag`` ``(G, N2, C)``."""
    f1 = factored_features(core, x1, plan, graph)[1]
    f2 = f1 if sym else factored_features(core, x2, plan, graph)[1]
    n1, n2 = x1.shape[0], x2.shape[0]
    for layer in plan.single:
        m = layer.name
        gam1 = f1.grads[m].view(n1, c, -1).transpose(0, 1)
        gam2 = f2.grads[m].view(n2, c, -1).transpose(0, 1)
        per_output = torch.bmm(gam1, gam2.transpose(1, 2))  # (C, N1, N2)
        weight = layer.weight is not None
        aa = f1.inputs[m] @ f2.inputs[m].T if weight else None
        a2 = f2.inputs[m].square().sum(-1)[:, None] if weight and diag is not None else None
        g2 = gam2.square().sum(-1).T if diag is not None else None  # (N2, C)
        terms = [(g, _factor(aa, shift), _factor(a2, shift)) for g, shift in layer_terms(core, layer)]
        terms.sort(key=lambda t: t[1] is not None)  # the plain term first: the factored one may then scale in place
        for i, (g, factor, factor_diag) in enumerate(terms):
            if factor is None:
                out[g] += per_output
            elif not graph and i == len(terms) - 1:  # its last use: no second (C, N1, N2) temporary
                out[g] += per_output.mul_(factor)
            else:
                out[g] += per_output * factor
            if diag is not None:
                diag[g] += g2 if factor_diag is None else g2 * factor_diag


def structured_diag_blocks(core: NetworkCore, plan: LayerPlan, out, x, c: int, graph: bool) -> None:
    """Add the single-location layers' per-point blocks ``(a·a)(γ_c·γ_c')`` to ``out`` ``(G, N, C, C)``."""
    feats = factored_features(core, x, plan, graph)[1]
    n = x.shape[0]
    group = dict(zip(core.groups.names, core.groups.group_of))
    for layer in plan.single:
        gam = feats.grads[layer.name].view(n, c, -1)
        gg = gam @ gam.transpose(-1, -2)
        if layer.weight is not None:
            aa = (feats.inputs[layer.name] ** 2).sum(-1)
            out[group[layer.weight]] += aa[:, None, None] * gg
        if layer.bias is not None:
            out[group[layer.bias]] += gg
