r"""The contraction strategy of the NTK engine: Jacobian columns of a chunk of examples, contracted group by
group.

The columns (:mod:`ntkgp.ntk.feature_pass`) are those of the generic parameters (layers that fail the structured
rule, free parameters, anything else: ``vmap(jacrev)``), of the layers with several locations per example
(convolutions: :math:`\sum_t \Gamma_{nct} \bar a_{nt}^\top` from their features, one batched matrix product per
chunk) and of the normalization layers (their rows from the same features, :mod:`ntkgp.ntk.elementwise_pass`);
the embedding tables' token sums beside them are contracted as Grams of equal tokens
(:mod:`ntkgp.ntk.token_grams`). A Gram block is :math:`J_g(X_{1,i}) J_g(X_{2,j})^\top` for a pair of chunks; memory
:math:`O(\text{chunk} \cdot C \cdot P_{contracted})` per chunk (:mod:`ntkgp.ntk.grams` drives the chunks, keeping
the columns of ``x2`` when they fit in ``max_jacobian_bytes``). With ``x2=None`` only the lower blocks are
contracted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import token_grams
from .inputs import num_rows
from .inputs import rows as take_rows
from .network import NetworkCore
from .token_grams import TokenSums

#: The contracted features of a chunk: ``{group: (n·C, P_g)}`` columns with the token sums of the tables as
#: ``.tokens`` (:class:`~ntkgp.ntk.held_features.Contracted`).
Columns = dict[int, Tensor]


def _tokens(j) -> tuple[TokenSums, ...]:
    return getattr(j, "tokens", ())


def add_gram(out: Tensor, s1: int, e1: int, j1: Columns, s2: int, e2: int, j2: Columns, c: int, mirror: bool) -> None:
    """Add ``J_g(X1) J_g(X2)ᵀ`` of the chunks to ``out`` ``(G, N1·C, N2·C)`` (and its transpose with ``mirror``)."""
    blocks = [(g, a @ j2[g].T) for g, a in j1.items()]
    blocks += [(t1.group, token_grams.gram(t1, e1 - s1, t2, e2 - s2)) for t1, t2 in zip(_tokens(j1), _tokens(j2))]
    for g, block in blocks:
        out[g, s1 * c : e1 * c, s2 * c : e2 * c] += block
        if mirror:
            out[g, s2 * c : e2 * c, s1 * c : e1 * c] += block.T


def add_output_gram(out: Tensor, s1: int, e1: int, j1: Columns, s2: int, e2: int, j2: Columns, c: int,
                    mirror: bool) -> None:
    """Add the per-output Grams ``[J_g(x) J_g(x')ᵀ]_{cc}`` of the chunks to ``out`` ``(G, C, N1, N2)`` (``C`` times
    fewer flops than the full Gram)."""
    for g, a in j1.items():
        block = torch.bmm(a.view(e1 - s1, c, -1).transpose(0, 1), j2[g].view(e2 - s2, c, -1).permute(1, 2, 0))
        out[g, :, s1:e1, s2:e2] += block
        if mirror:
            out[g, :, s2:e2, s1:e1] += block.transpose(1, 2)
    for t1, t2 in zip(_tokens(j1), _tokens(j2)):
        block = token_grams.output_gram(t1, e1 - s1, t2, e2 - s2)
        out[t1.group, :, s1:e1, s2:e2] += block
        if mirror:
            out[t1.group, :, s2:e2, s1:e1] += block.transpose(1, 2)


def add_output_gram_pieces(out: Tensor, s1: int, e1: int, j1: Columns, s2: int, e2: int, pieces: dict[int, list[Tensor]],
                           c: int, tokens: tuple[TokenSums, ...] = ()) -> None:
    """:func:`add_output_gram` with the columns of the chunk ``s2:e2`` as pieces ``(C, n, P_i)``
    (:class:`~ntkgp.ntk.held_features.ChunkFeatures`): one batched product per piece against the matching columns of
    ``j1``, so that the chunk's columns are never joined (the same products, summed over the pieces); ``tokens``: the
    chunk's token sums."""
    for t1, t2 in zip(_tokens(j1), tokens):
        out[t1.group, :, s1:e1, s2:e2] += token_grams.output_gram(t1, e1 - s1, t2, e2 - s2)
    for g, parts in pieces.items():
        rows = j1[g].view(e1 - s1, c, -1)
        target, start = out[g, :, s1:e1, s2:e2], 0
        for piece in parts:
            width = piece.shape[-1]
            target += torch.bmm(rows[..., start : start + width].transpose(0, 1), piece.transpose(1, 2))
            start += width


#: Length of the segments whose norms :func:`squared_norms` forms first (short enough that their accumulation
#: rounds no more than a pairwise sum's).
NORM_SEGMENT = 256


def squared_norms(rows: Tensor) -> Tensor:
    r"""The squared norms :math:`\sum_p r_p^2` of the rows (the last dimension) in ``rows``' dtype, without forming
    the squares: the norms of segments of :data:`NORM_SEGMENT` numbers (``torch.linalg.vector_norm``), squared and
    summed (pairwise). As accurate as ``rows.square().sum(-1)`` (a few units of rounding however long the rows:
    a single norm of a long row rounds in proportion to its length) at the cost of reading ``rows`` once (no
    temporary of their size)."""
    width = rows.shape[-1]
    head = width - width % NORM_SEGMENT
    out = None
    if head:
        segments = rows[..., :head].unflatten(-1, (head // NORM_SEGMENT, NORM_SEGMENT))
        out = torch.linalg.vector_norm(segments, dim=-1).square().sum(-1)
    if head < width or out is None:
        rest = torch.linalg.vector_norm(rows[..., head:], dim=-1).square()
        out = rest if out is None else out.add_(rest)
    return out


def add_output_diagonal_pieces(diag: Tensor, s: int, e: int, pieces: dict[int, list[Tensor]],
                               tokens: tuple[TokenSums, ...] = ()) -> None:
    """:func:`add_output_diagonal` from the pieces ``(C, n, P_i)`` of the chunk's columns and its token sums."""
    for t in tokens:
        diag[t.group, s:e] += token_grams.output_diagonal(t, e - s)
    for g, parts in pieces.items():
        for piece in parts:
            diag[g, s:e] += squared_norms(piece).T


def add_output_diagonal(diag: Tensor, s: int, e: int, j: Columns, c: int) -> None:
    """Add the output diagonals of the chunk's per-point blocks to ``diag`` ``(G, N, C)``."""
    for g, cols in j.items():
        diag[g, s:e] += squared_norms(cols.view(e - s, c, -1))
    for t in _tokens(j):
        diag[t.group, s:e] += token_grams.output_diagonal(t, e - s)


def add_diag_blocks(out: Tensor, s: int, e: int, j: Columns, c: int) -> None:
    """Add the chunk's per-point blocks ``J_g(x_n) J_g(x_n)ᵀ`` to ``out`` ``(G, N, C, C)``."""
    for g, cols in j.items():
        jn = cols.view(e - s, c, -1)
        out[g, s:e] += jn @ jn.transpose(-1, -2)
    for t in _tokens(j):
        out[t.group, s:e] += token_grams.diag_blocks(t, e - s)


def jacobian(core: NetworkCore, x: Tensor) -> Tensor:
    """The stacked Jacobian ``(N·C, P)`` of every parameter, chunk by chunk."""
    rows = []
    for s, e in core.chunks(num_rows(x), "Jacobians"):
        rows.append(core.jacobian(take_rows(x, s, e)).reshape(-1, core.num_params))
    return torch.cat(rows)
