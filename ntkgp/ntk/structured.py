r"""The structured route of the NTK engine: Grams of ``nn.Linear`` / ``nn.Conv2d`` layers from layer features.

For a layer with one location per example (``nn.Linear`` on ``(N, d)`` inputs) the Gram factorises
(``docs/math.md``, "Structured form"):

.. math::
    [J_W(x) J_W(x')^\top]_{cc'} = (a(x) \cdot a(x'))\,(\gamma_c(x) \cdot \gamma_{c'}(x')), \qquad
    [J_b(x) J_b(x')^\top]_{cc'} = \gamma_c(x) \cdot \gamma_{c'}(x'),

so only the layer inputs :math:`a` and the back-propagated output gradients :math:`\gamma_c = \partial f_c /
\partial z` are computed (:mod:`ntkgp.ntk.features`), never the Jacobian. Layers with several locations per
example (``nn.Conv2d``: unfolded patches; a linear layer on ``(N, ..., d)`` inputs) give their per-example
Jacobian blocks :math:`\sum_t \Gamma_{ct} a_t^\top` from the same features, one batched matrix product per
chunk instead of per-example backward passes (:func:`expanded_blocks`); those blocks are contracted with the
generic ones (:mod:`ntkgp.ntk.contraction`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..options import Strategy
from .features import Layer, candidate_layers, layer_features, layer_jacobians, verify_layers

if TYPE_CHECKING:
    from .engine import NTKEngine


@dataclass
class Plan:
    """Which parameters take which route, decided once per input shape.

    Attributes:
        structured: every structured layer, ``module -> {"weight"|"bias": parameter index}``.
        generic: the parameters contracted from ``vmap(jacrev)`` Jacobians.
        layers: the structured layers (:class:`~ntkgp.ntk.features.Layer`).
        expanded: the structured layers with several locations per example (Conv2d, ...): per-example
            Jacobian blocks from their features, contracted like the generic parameters.
    """

    structured: dict[str, dict[str, int]] = field(default_factory=dict)
    generic: list[int] = field(default_factory=list)
    layers: dict[str, Layer] = field(default_factory=dict)
    expanded: tuple[str, ...] = ()

    @property
    def factored(self) -> list[str]:
        """The structured layers with one location per example (factorised Grams)."""
        return [m for m in self.structured if m not in self.expanded]

    @property
    def contracted(self) -> bool:
        """Whether some parameters are contracted (generic or expanded)."""
        return bool(self.generic or self.expanded)

    def routes(self) -> tuple:
        return (tuple(self.structured), tuple(self.generic), self.expanded)


@dataclass
class Features:
    """Layer inputs ``a`` ``(n, d_in)`` and output gradients ``Γ`` ``(n·C, d_out)`` of the factored layers."""

    inputs: dict[str, Tensor]
    grads: dict[str, Tensor]


def build_plan(engine: NTKEngine, probe: Tensor) -> Plan:
    """Verify the candidate layers on ``probe`` (one example) with the safety rule of
    :func:`~ntkgp.ntk.features.verify_layers`.

    Raises:
        ValueError: with ``strategy="structured"``, when a Linear/Conv2d layer fails the rule for a reason
            other than an unsupported convolution configuration.
    """
    names = engine.groups.names
    if engine.strategy is Strategy.CONTRACTION:
        return Plan(generic=list(range(len(names))))
    candidates, problems = candidate_layers(engine.net, names)
    layers, locations, failed = verify_layers(engine.net, engine.params(), candidates, probe)
    unsafe = {m: e for m, e in {**problems, **failed}.items() if not isinstance(e, NotImplementedError)}
    if engine.strategy is Strategy.STRUCTURED and unsafe:
        reasons = "; ".join(str(e) for e in unsafe.values())
        raise ValueError(f"strategy='structured' cannot treat layers {sorted(unsafe)} ({reasons}); use strategy='auto'")
    index = {n: i for i, n in enumerate(names)}
    structured = {
        layer.name: {k: index[n] for k, n in (("weight", layer.weight), ("bias", layer.bias)) if n is not None}
        for layer in layers
    }
    taken = {i for kinds in structured.values() for i in kinds.values()}
    return Plan(
        structured=structured,
        generic=[i for i in range(len(names)) if i not in taken],
        layers={layer.name: layer for layer in layers},
        expanded=tuple(layer.name for layer in layers if locations[layer.name] != 1),
    )


def factored_features(engine: NTKEngine, x: Tensor, plan: Plan, graph: bool = False) -> tuple[Tensor, Features]:
    """Features of the factored layers over all of ``x``, chunk by chunk (memory ``O(N·C·Σ d_out)``)."""
    modules = plan.factored
    layers = [plan.layers[m] for m in modules]
    params = engine.params()
    fs, inputs, grads = [], {m: [] for m in modules}, {m: [] for m in modules}
    for s, e in engine._chunks(x.shape[0], "layer features"):
        feats = layer_features(engine.net, params, layers, x[s:e], graph=graph)
        fs.append(feats.outputs)
        for m in modules:
            a, g = feats.inputs[m], feats.grads[m]  # (n, d_in, T), (n, C, d_out, T)
            if a.shape[-1] != 1:
                raise RuntimeError(f"layer '{m}' changed its number of locations since the plan was made")
            inputs[m].append(a[..., 0])
            grads[m].append(g[..., 0].reshape(-1, g.shape[2]))
    return torch.cat(fs), Features(
        inputs={m: torch.cat(v) for m, v in inputs.items()}, grads={m: torch.cat(v) for m, v in grads.items()}
    )


def expanded_blocks(engine: NTKEngine, x: Tensor, layers: Sequence[Layer], graph: bool = False) -> dict[int, Tensor]:
    r"""Per-example Jacobian blocks ``{parameter index: (n, C, numel)}`` of ``layers`` from their features,
    :math:`\sum_t \Gamma_{nct} a_{nt}^\top` (one forward and ``C`` backward passes for the chunk)."""
    feats = layer_features(engine.net, engine.params(), layers, x, graph=graph)
    index = {n: i for i, n in enumerate(engine.groups.names)}
    out = {}
    for layer in layers:
        for name, block in layer_jacobians(layer, feats.inputs[layer.name], feats.grads[layer.name]).items():
            out[index[name]] = block
    return out


def _features(engine: NTKEngine, x: Tensor, plan: Plan, graph: bool) -> Features:
    # the fast path goes through the engine's method (one place to observe or replace it)
    return (engine._features(x, plan) if not graph else factored_features(engine, x, plan, graph))[1]


def _shared_factor(engine: NTKEngine, kinds: dict[str, int]) -> bool:
    """Whether the layer's weight and bias are in one group (one term with the factor ``a·a' + 1``)."""
    group_of = engine.groups.group_of
    return "weight" in kinds and "bias" in kinds and group_of[kinds["weight"]] == group_of[kinds["bias"]]


def _terms(
    engine: NTKEngine, kinds: dict[str, int], aa: Tensor | None, in_place: bool = False
) -> list[tuple[int, Tensor | None]]:
    """(group, factor on the output-gradient kernel or None) for one layer: weight and bias in one group
    share the factor ``a·a' + 1`` (formed in ``aa``'s memory with ``in_place``: no second matrix of its size)."""
    group_of = engine.groups.group_of
    if _shared_factor(engine, kinds):
        return [(group_of[kinds["weight"]], aa.add_(1) if in_place else aa + 1)]
    return [(group_of[i], aa if k == "weight" else None) for k, i in kinds.items()]


def _term_groups(engine: NTKEngine, kinds: dict[str, int]) -> list[int]:
    """The groups of :func:`_terms`, in the same order."""
    group_of = engine.groups.group_of
    return [group_of[kinds["weight"]]] if _shared_factor(engine, kinds) else [group_of[i] for i in kinds.values()]


def structured_grams(engine: NTKEngine, out, x1, x2, sym, plan: Plan, c: int, graph: bool) -> set[int]:
    """Write the factored layers' terms into ``out`` ``(G, N1·C, N2·C)``; returns the groups written.

    Without ``graph`` every term is formed a block of rows at a time, its input factor ``a·a' (+ 1)`` too: a group
    met for the first time is written in place (``mm`` into the rows of ``out[g]``, then ``mul_``), later ones are
    added, so nothing of the size of ``out`` is allocated besides ``out`` itself (a few temporaries of about
    2²² numbers each). With ``graph`` the same terms are formed out of place (differentiable).
    """
    f1 = _features(engine, x1, plan, graph)
    f2 = f1 if sym else _features(engine, x2, plan, graph)
    n1, n2 = x1.shape[0], x2.shape[0]
    written: set[int] = set()
    for m in plan.factored:
        kinds = plan.structured[m]
        g1, g2 = f1.grads[m], f2.grads[m]
        weight = "weight" in kinds
        if graph:
            aa = f1.inputs[m] @ f2.inputs[m].T if weight else None
            for g, factor in _terms(engine, kinds, aa):
                term = g1 @ g2.T
                if factor is not None:
                    term = (term.view(n1, c, n2, c) * factor[:, None, :, None]).view(n1 * c, n2 * c)
                out[g] = out[g] + term if g in written else term
                written.add(g)
            continue
        a1, a2 = (f1.inputs[m], f2.inputs[m]) if weight else (None, None)
        fresh = {g for g in _term_groups(engine, kinds) if g not in written}
        rows = max(1, (1 << 22) // max(1, n2 * c * c))  # a block of the term: rows·C × N2·C numbers
        for s in range(0, n1, rows):
            e = min(s + rows, n1)
            aa = a1[s:e] @ a2.T if weight else None
            for g, factor in _terms(engine, kinds, aa, in_place=True):
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


def structured_output_grams(engine: NTKEngine, out, diag, x1, x2, sym, plan: Plan, c: int, graph: bool) -> None:
    """Add the factored layers' per-output Grams ``(a·a' + 1)(γ_c·γ'_c)`` to ``out`` ``(G, C, N1, N2)`` and,
    when ``diag`` is given, the output diagonals of the per-point blocks of ``x2`` to ``diag`` ``(G, N2, C)``."""
    f1 = _features(engine, x1, plan, graph)
    f2 = f1 if sym else _features(engine, x2, plan, graph)
    n1, n2 = x1.shape[0], x2.shape[0]
    group_of = engine.groups.group_of
    for m in plan.factored:
        kinds = plan.structured[m]
        gam1 = f1.grads[m].view(n1, c, -1).transpose(0, 1)
        gam2 = f2.grads[m].view(n2, c, -1).transpose(0, 1)
        per_output = torch.bmm(gam1, gam2.transpose(1, 2))  # (C, N1, N2)
        weight = "weight" in kinds
        aa = f1.inputs[m] @ f2.inputs[m].T if weight else None
        a2 = f2.inputs[m].square().sum(-1)[:, None] if weight and diag is not None else None
        g2 = gam2.square().sum(-1).T if diag is not None else None  # (N2, C)
        if _shared_factor(engine, kinds):
            terms = [(group_of[kinds["weight"]], aa + 1, None if a2 is None else a2 + 1)]
        else:
            terms = [(group_of[i], aa if k == "weight" else None, a2 if k == "weight" else None) for k, i in kinds.items()]
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


def structured_diag_blocks(engine: NTKEngine, out, x, plan: Plan, c: int, graph: bool) -> None:
    """Add the factored layers' per-point blocks ``(a·a)(γ_c·γ_c')`` to ``out`` ``(G, N, C, C)``."""
    feats = _features(engine, x, plan, graph)
    n = x.shape[0]
    for m in plan.factored:
        kinds = plan.structured[m]
        gam = feats.grads[m].view(n, c, -1)
        gg = gam @ gam.transpose(-1, -2)
        if "weight" in kinds:
            aa = (feats.inputs[m] ** 2).sum(-1)
            out[engine.groups.group_of[kinds["weight"]]] += aa[:, None, None] * gg
        if "bias" in kinds:
            out[engine.groups.group_of[kinds["bias"]]] += gg
