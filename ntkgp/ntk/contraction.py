r"""The contraction route of the NTK engine: per-example Jacobian columns, contracted group by group.

The columns of a chunk of examples come from ``torch.func.vmap(jacrev)`` for the generic parameters
(normalisation layers, embeddings, layers that fail the structured rule) and from layer features for the
structured layers with several locations per example (:func:`ntkgp.ntk.structured.expanded_blocks`). A
Gram block is :math:`J_g(X_{1,i}) J_g(X_{2,j})^\top` for a pair of chunks; memory
:math:`O(\text{chunk} \cdot C \cdot P)` per chunk, and the columns of ``x2`` are kept when they fit in
``max_jacobian_bytes`` (recomputed chunk by chunk otherwise). With ``x2=None`` only the lower blocks are
contracted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .features import Layer
from .functional import per_example_jacobians
from .structured import Plan, expanded_blocks

if TYPE_CHECKING:
    from .engine import NTKEngine

Columns = dict[int, Tensor]


def jacobian_chunk(engine: NTKEngine, x: Tensor, indices: list[int]) -> list[Tensor]:
    """Per-example Jacobians of the parameters ``indices``: a list of ``(n, C, numel)`` tensors."""
    names = engine.groups.names
    jac = per_example_jacobians(engine.net, engine.params(), x, [names[i] for i in indices])
    return [jac[names[i]] for i in indices]


def group_columns(
    engine: NTKEngine, x: Tensor, indices: list[int], layers: Sequence[Layer] = (), graph: bool = False
) -> Columns:
    """Jacobian columns of each group for the parameters ``indices`` and the expanded ``layers``:
    ``{g: (n·C, P_g)}``, columns in parameter order within a group."""
    blocks: dict[int, Tensor] = {}
    if indices:
        blocks.update(zip(indices, engine._jacobian_chunk(x, indices)))
    if layers:
        blocks.update(expanded_blocks(engine, x, layers, graph))
    by_group: dict[int, list[Tensor]] = {}
    for i in sorted(blocks):
        block = blocks[i]
        by_group.setdefault(engine.groups.group_of[i], []).append(block.reshape(-1, block.shape[-1]))
    return {g: torch.cat(cols, dim=1) for g, cols in by_group.items()}


def plan_columns(engine: NTKEngine, plan: Plan, graph: bool) -> tuple[Callable[[Tensor], Columns], int]:
    """The column function of the plan's contracted parameters and their number of columns."""
    layers = [plan.layers[m] for m in plan.expanded]
    width = sum(engine.groups.numels[i] for i in plan.generic)
    width += sum(engine.groups.numels[i] for m in plan.expanded for i in plan.structured[m].values())
    return (lambda xs: group_columns(engine, xs, plan.generic, layers, graph)), width


def column_pairs(
    engine: NTKEngine, x1: Tensor, x2: Tensor, sym: bool, columns: Callable[[Tensor], Columns], width: int,
    c: int, desc: str,
) -> Iterator[tuple[int, int, Columns, int, int, Columns]]:
    """Pairs of chunks ``(s1, e1, J(x1[s1:e1]), s2, e2, J(x2[s2:e2]))``; with ``sym`` (``x2 is x1``) only
    the pairs with ``s2 <= s1``."""
    n2 = x2.shape[0]
    keep = n2 * c * width * x2.element_size() <= engine.max_jacobian_bytes
    chunks2 = [(s, min(s + engine.chunk_size, n2)) for s in range(0, n2, engine.chunk_size)]
    stored = [columns(x2[s:e]) for s, e in chunks2] if keep and not sym else None
    stored_sym: list[Columns] = []
    for s1, e1 in engine._chunks(x1.shape[0], desc):
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


def contracted_grams(engine: NTKEngine, out: Tensor, x1, x2, sym: bool, plan: Plan, c: int, graph: bool) -> None:
    """Add ``J_g(X1) J_g(X2)ᵀ`` of the contracted parameters to ``out`` ``(G, N1·C, N2·C)``."""
    columns, width = plan_columns(engine, plan, graph)
    for s1, e1, j1, s2, e2, j2 in column_pairs(engine, x1, x2, sym, columns, width, c, "Gram"):
        for g, a in j1.items():
            block = a @ j2[g].T
            out[g, s1 * c : e1 * c, s2 * c : e2 * c] += block
            if sym and s2 != s1:
                out[g, s2 * c : e2 * c, s1 * c : e1 * c] += block.T


def contracted_output_grams(
    engine: NTKEngine, out: Tensor, diag: Tensor | None, x1, x2, sym: bool, plan: Plan, c: int, graph: bool
) -> None:
    """Add the per-output Grams ``[J_g(x) J_g(x')ᵀ]_{cc}`` of the contracted parameters to ``out``
    ``(G, C, N1, N2)`` (``C`` times fewer flops than the full Gram) and their diagonal over ``x2`` to ``diag``."""
    columns, width = plan_columns(engine, plan, graph)
    for s1, e1, j1, s2, e2, j2 in column_pairs(engine, x1, x2, sym, columns, width, c, "Gram"):
        for g, a in j1.items():
            block = torch.einsum("ncp,mcp->cnm", a.view(e1 - s1, c, -1), j2[g].view(e2 - s2, c, -1))
            out[g, :, s1:e1, s2:e2] += block
            if sym and s2 != s1:
                out[g, :, s2:e2, s1:e1] += block.transpose(1, 2)
    if diag is not None:
        for s, e in engine._chunks(x2.shape[0], "diagonal"):
            for g, cols in columns(x2[s:e]).items():
                diag[g, s:e] += cols.view(e - s, c, -1).square().sum(-1)


def contracted_diag_blocks(engine: NTKEngine, out: Tensor, x: Tensor, plan: Plan, c: int, graph: bool) -> None:
    """Add the per-point blocks ``J_g(x_n) J_g(x_n)ᵀ`` of the contracted parameters to ``out`` ``(G, N, C, C)``."""
    columns, _ = plan_columns(engine, plan, graph)
    for s, e in engine._chunks(x.shape[0], "diagonal"):
        for g, cols in columns(x[s:e]).items():
            jn = cols.view(e - s, c, -1)
            out[g, s:e] += jn @ jn.transpose(-1, -2)


def jacobian(engine: NTKEngine, x: Tensor) -> Tensor:
    """The stacked Jacobian ``(N·C, P)``, rows ``n·C + c``, columns in parameter order (``vmap(jacrev)``)."""
    indices = list(range(len(engine.groups.names)))
    rows = []
    for s, e in engine._chunks(x.shape[0], "Jacobians"):
        blocks = engine._jacobian_chunk(x[s:e], indices)
        rows.append(torch.cat(blocks, dim=-1).reshape(-1, engine.num_params))
    return torch.cat(rows)
