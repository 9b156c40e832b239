r"""The contraction strategy of the NTK engine: per-example Jacobian columns, contracted group by group.

The columns of a chunk of examples come from ``torch.func.vmap(jacrev)`` for the generic parameters
(normalisation layers, embeddings, layers that fail the structured rule; :meth:`NetworkCore.jacobian_chunk
<ntkgp.ntk.network.NetworkCore.jacobian_chunk>`) and from layer features for the structured layers with several
locations per example (:func:`expanded_blocks`: :math:`\sum_t \Gamma_{nct} a_{nt}^\top`, one batched product per
chunk instead of per-example backward passes). A Gram block is :math:`J_g(X_{1,i}) J_g(X_{2,j})^\top` for a
pair of chunks; memory :math:`O(\text{chunk} \cdot C \cdot P)` per chunk, and the columns of ``x2`` are kept
when they fit in ``max_jacobian_bytes`` (recomputed chunk by chunk otherwise). With ``x2=None`` only the lower
blocks are contracted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from .features import Layer
from .layer_plan import LayerPlan
from .network import NetworkCore

Columns = dict[int, Tensor]


def expanded_blocks(core: NetworkCore, x: Tensor, layers: Sequence[Layer], graph: bool = False) -> dict[str, Tensor]:
    r"""Per-example Jacobian blocks ``{parameter: (n, C, numel)}`` of ``layers`` from their features,
    :math:`\sum_t \Gamma_{nct} a_{nt}^\top` (one forward and ``C`` backward passes for the chunk)."""
    feats = core.features(x, layers, graph=graph)
    out = {}
    for layer in layers:
        out.update(layer.jacobians(feats.inputs[layer.name], feats.grads[layer.name]))
    return out


def group_columns(core: NetworkCore, x: Tensor, names: Sequence[str], layers: Sequence[Layer] = (),
                  graph: bool = False) -> Columns:
    """Jacobian columns of each group for the generic parameters ``names`` and the expanded ``layers``:
    ``{g: (n·C, P_g)}``, columns in parameter order within a group."""
    blocks: dict[str, Tensor] = {}
    if names:
        blocks.update(core.jacobian_chunk(x, names))
    if layers:
        blocks.update(expanded_blocks(core, x, layers, graph))
    by_group: dict[int, list[Tensor]] = {}
    for name, g in zip(core.groups.names, core.groups.group_of):
        if name in blocks:
            by_group.setdefault(g, []).append(blocks[name].reshape(-1, blocks[name].shape[-1]))
    return {g: torch.cat(cols, dim=1) for g, cols in by_group.items()}


def plan_columns(core: NetworkCore, plan: LayerPlan, graph: bool) -> tuple[Callable[[Tensor], Columns], int]:
    """The column function of the plan's contracted parameters (generic and multi-location) and their number."""
    layers = plan.multi
    numel = dict(zip(core.names, core.numels))
    width = sum(numel[n] for n in plan.generic) + sum(numel[n] for la in layers for n in la.parameter_names)
    return (lambda xs: group_columns(core, xs, plan.generic, layers, graph)), width


def column_pairs(
    core: NetworkCore, x1: Tensor, x2: Tensor, sym: bool, columns: Callable[[Tensor], Columns], width: int,
    c: int, desc: str,
) -> Iterator[tuple[int, int, Columns, int, int, Columns]]:
    """Pairs of chunks ``(s1, e1, J(x1[s1:e1]), s2, e2, J(x2[s2:e2]))``; with ``sym`` (``x2 is x1``) only
    the pairs with ``s2 <= s1``."""
    n2 = x2.shape[0]
    keep = n2 * c * width * x2.element_size() <= core.max_jacobian_bytes
    chunks2 = [(s, min(s + core.chunk_size, n2)) for s in range(0, n2, core.chunk_size)]
    stored = [columns(x2[s:e]) for s, e in chunks2] if keep and not sym else None
    stored_sym: list[Columns] = []
    for s1, e1 in core.chunks(x1.shape[0], desc):
        j1 = columns(x1[s1:e1])
        if sym and keep:
            stored_sym.append(j1)
        for k, (s2, e2) in enumerate(chunks2):
            if sym and s2 > s1:
                break
            if sym and s2 == s1:
                j2 = j1
            elif sym:
                j2 = stored_sym[k] if keep else columns(x1[s2:e2])
            else:
                j2 = stored[k] if keep else columns(x2[s2:e2])
            yield s1, e1, j1, s2, e2, j2


def contracted_grams(core: NetworkCore, plan: LayerPlan, out: Tensor, x1, x2, sym: bool, c: int, graph: bool) -> None:
    """Add ``J_g(X1) J_g(X2)ᵀ`` of the contracted parameters to ``out`` ``(G, N1·C, N2·C)``."""
    columns, width = plan_columns(core, plan, graph)
    for s1, e1, j1, s2, e2, j2 in column_pairs(core, x1, x2, sym, columns, width, c, "Gram"):
        for g, a in j1.items():
            block = a @ j2[g].T
            out[g, s1 * c : e1 * c, s2 * c : e2 * c] += block
            if sym and s2 != s1:
                out[g, s2 * c : e2 * c, s1 * c : e1 * c] += block.T


def contracted_output_grams(
    core: NetworkCore, plan: LayerPlan, out: Tensor, diag: Tensor | None, x1, x2, sym: bool, c: int, graph: bool
) -> None:
    """Add the per-output Grams ``[J_g(x) J_g(x')ᵀ]_{cc}`` of the contracted parameters to ``out``
    ``(G, C, N1, N2)`` (``C`` times fewer flops than the full Gram) and their diagonal over ``x2`` to ``diag``."""
    columns, width = plan_columns(core, plan, graph)
    for s1, e1, j1, s2, e2, j2 in column_pairs(core, x1, x2, sym, columns, width, c, "Gram"):
        for g, a in j1.items():
            block = torch.einsum("ncp,mcp->cnm", a.view(e1 - s1, c, -1), j2[g].view(e2 - s2, c, -1))
            out[g, :, s1:e1, s2:e2] += block
            if sym and s2 != s1:
                out[g, :, s2:e2, s1:e1] += block.transpose(1, 2)
    if diag is not None:
        for s, e in core.chunks(x2.shape[0], "diagonal"):
            for g, cols in columns(x2[s:e]).items():
                diag[g, s:e] += cols.view(e - s, c, -1).square().sum(-1)


def contracted_diag_blocks(core: NetworkCore, plan: LayerPlan, out: Tensor, x: Tensor, c: int, graph: bool) -> None:
    """Add the per-point blocks ``J_g(x_n) J_g(x_n)ᵀ`` of the contracted parameters to ``out`` ``(G, N, C, C)``."""
    columns, _ = plan_columns(core, plan, graph)
    for s, e in core.chunks(x.shape[0], "diagonal"):
        for g, cols in columns(x[s:e]).items():
            jn = cols.view(e - s, c, -1)
            out[g, s:e] += jn @ jn.transpose(-1, -2)


def jacobian(core: NetworkCore, x: Tensor) -> Tensor:
    """The stacked Jacobian ``(N·C, P)`` of every parameter, chunk by chunk."""
    rows = []
    for s, e in core.chunks(x.shape[0], "Jacobians"):
        rows.append(core.jacobian(x[s:e]).reshape(-1, core.num_params))
    return torch.cat(rows)
