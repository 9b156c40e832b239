r"""The NTK's Grams and diagonals over chunks: one feature pass per chunk (:mod:`ntkgp.ntk.feature_pass`), the
single-location layers' factored terms (:mod:`ntkgp.ntk.structured`) and the contracted columns
(:mod:`ntkgp.ntk.contraction`) from the same pass.

The features of the second argument ``x2`` are computed once (its contracted columns kept when they fit in
``max_jacobian_bytes``, recomputed for each chunk of ``x1`` otherwise) and serve the Gram and the diagonal of
``x2``; each chunk of ``x1`` is passed through the network once. With ``x2 = x1`` (``sym``) the features of
``x1`` are those of ``x2`` and only the lower blocks of the contracted part are formed.

**Given features of** ``x1`` (``f1``, a :class:`~ntkgp.ntk.feature_pass.FeatureSet` with its columns kept: SFR's
inducing inputs, computed once per model) nothing of ``x1`` is recomputed: ``x2`` is passed through the network
one chunk at a time (one forward and ``C`` backward passes per chunk, its columns never kept) and each chunk is
contracted against all of ``f1``; with ``sym`` the Gram of ``f1`` with itself. Chunks of ``f1`` beyond its memory
budget (not kept) are recomputed once per chunk of ``x2``, one at a time, or, where ``f1`` has a window
(``FeatureSet.window``) and ``x2`` several chunks, in windows: each window once per call, ``x2`` passed again for it
(:mod:`ntkgp.ntk.feature_windows`; with ``sym``, the windows in turn). Features ``f1`` in a finer dtype than the
network's (SFR's float64 features of ``Z`` for a float32 network) give the Grams and the blocks or diagonals of
``x2`` in that dtype: each chunk of ``x2`` is passed in the network's dtype, then its features are promoted
(:meth:`~ntkgp.ntk.held_features.ChunkFeatures.promote_`) and contracted in ``f1``'s, so that the products carry
no rounding beyond that of ``x2``'s own features (the outputs ``f(x2)`` and :math:`J(x_2)\theta^*` stay in the
network's dtype). The promoted features of every chunk are written into one buffer
(:class:`~ntkgp.ntk.held_features.PromotionBuffer`, ``8·C·P_c`` bytes per point of a chunk for float64), allocated
once per call, and the output diagonals are formed from them without squares of their size
(:func:`~ntkgp.ntk.contraction.squared_norms`).

**Held columns.** The kept columns of a :class:`~ntkgp.ntk.feature_pass.FeatureSet` are written into one tensor per
group (``FeatureSet.held``; each chunk's columns are views of it): a chunk of the other argument is contracted against
all of them in one product (with ``sym``, against those below the chunk, mirrored), not one per chunk: the same
products in wider GEMMs, which reach more of the processor's rate (on a 2-core CPU about 1.3 times that of one
product per chunk of 77 points, in float64).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..progress import progress_bar
from . import contraction, structured
from .feature_pass import FeatureSet, chunk_features
from .feature_windows import Window, window_columns, windows
from .held_features import ChunkFeatures, Contracted, PromotionBuffer
from .inputs import num_rows
from .inputs import rows as take_rows
from .layer_plan import LayerPlan
from .network import NetworkCore


def gram_dtype(core: NetworkCore, f1: FeatureSet | None) -> torch.dtype:
    """The dtype of the Grams: the network's, or that of the given features ``f1`` where it is finer."""
    return core.dtype if f1 is None else torch.promote_types(core.dtype, f1.dtype)


def _row_chunks(core: NetworkCore, plan: LayerPlan, x1: Tensor, f2: FeatureSet, sym: bool, c: int, graph: bool,
                columns_until: int | None = None):
    """``(k, s, e, features of x1[s:e])``: from ``f2`` with ``sym`` (the contracted columns only of the chunks that
    start before ``columns_until``, default all), else from one pass per chunk."""
    for k, (s, e) in enumerate(core.chunks(num_rows(x1), "Gram")):
        if sym:
            rows = f2.rows(s, e, c)
            if f2.contracted and (columns_until is None or s < columns_until):
                rows.columns = f2.columns(k)
            yield k, s, e, rows
        else:
            yield k, s, e, chunk_features(core, plan, take_rows(x1, s, e), graph, columns=f2.contracted)


def _pairs(f2: FeatureSet, k1: int, s1: int, rows: ChunkFeatures, sym: bool):
    """``(s2, e2, columns of x2[s2:e2], mirror)`` for the contracted blocks of the row chunk ``k1``: the points of
    ``f2`` held in one tensor (``f2.held``; with ``sym`` those below the chunk) as one block, then the other chunks."""
    held = min(f2.held_points, s1) if sym else f2.held_points
    if held:
        c = next(iter(f2.held.values())).shape[0] // f2.held_points
        yield 0, held, Contracted({g: t[: held * c] for g, t in f2.held.items()}), sym
    for k2, (s2, e2) in enumerate(f2.bounds):
        if sym and s2 > s1:
            break
        if e2 > held:
            yield s2, e2, rows.columns if sym and k2 == k1 else f2.columns(k2), sym and k2 != k1


def _sym_windows(out: Tensor, f: FeatureSet, wins: list[Window], c: int, add) -> None:
    """The contracted part of the symmetric Gram of ``f`` for the points of its windows (the kept points' part
    already added): each window recomputed once and contracted, in one product each, against the held points
    (mirrored), itself, and the chunks of the windows before it (recomputed one at a time, mirrored). ``add``:
    :func:`~ntkgp.ntk.contraction.add_gram` or :func:`~ntkgp.ntk.contraction.add_output_gram`."""
    name = getattr(f.core, "pass_name", None)  # set by ntkgp.progress.reporting
    desc = f"{name} (Gram windows)" if name else "Gram windows"
    progress = f.core.progress if len(wins) > 1 else False
    for i, (s1, e1, ks) in progress_bar(list(enumerate(wins)), len(wins), desc, progress, "window"):
        cols = window_columns(f, (s1, e1, ks))
        if f.held is not None:
            add(out, s1, e1, cols, 0, f.held_points, f.held, c, True)
        add(out, s1, e1, cols, s1, e1, cols, c, False)
        for k in (k for _, _, earlier in wins[:i] for k in earlier):
            s2, e2 = f.bounds[k]
            add(out, s1, e1, cols, s2, e2, f.columns(k), c, True)
        del cols


def _given_rows(core: NetworkCore, f1: FeatureSet, c: int, n2: int
                ) -> tuple[ChunkFeatures, list[tuple[int, int, int]], list[Window]]:
    """All single-location features of ``f1``, its chunks ``(s, e, k)`` beyond the points held in one tensor
    (``f1.held``, contracted in one product) whose columns are taken (kept) or recomputed (beyond ``f1``'s budget)
    by ``f1.columns(k)`` one at a time, for each chunk of ``x2`` (``n2`` points), and the windows of recomputed chunks
    (:mod:`~ntkgp.ntk.feature_windows`) that take their place when ``x2`` has several chunks."""
    wins = windows(f1) if n2 > core.chunk_size else []
    done = {k for _, _, ks in wins for k in ks}
    chunks = [(s, e, k) for k, (s, e) in enumerate(f1.bounds)
              if e > f1.held_points and k not in done] if f1.contracted else []
    return f1.rows(0, f1.num_points, c), chunks, wins


def _window_passes(core: NetworkCore, plan: LayerPlan, f1: FeatureSet, wins: list[Window], x2: Tensor,
                   dtype: torch.dtype, buffer: PromotionBuffer, join: bool):
    """``(s1, e1, window columns, s2, e2, features of x2[s2:e2])``: each window of ``f1`` recomputed once, then ``x2``
    passed through the network again for it (its contracted features only, promoted to ``dtype``)."""
    for s1, e1, ks in wins:
        cols = window_columns(f1, (s1, e1, ks))
        for s2, e2 in core.chunks(num_rows(x2), f"Gram, inducing points {s1}-{e1}"):
            f2 = chunk_features(core, plan, take_rows(x2, s2, e2), False, single=False)
            yield s1, e1, cols, s2, e2, f2.promote_(dtype, buffer, join=join)
        del cols


def _group_grams_given(core: NetworkCore, plan: LayerPlan, f1: FeatureSet, x2: Tensor, c: int, out: Tensor,
                       blocks: Tensor | None, outputs: tuple[Tensor, Tensor] | None = None) -> None:
    """:func:`group_grams` from the given features of ``x1`` against ``x2``, one chunk of ``x2`` at a time (and, into
    ``blocks``, the per-point blocks of ``x2``, into ``outputs`` :math:`f(x_2)` and :math:`J(x_2)\\theta^*`, from the
    same pass)."""
    whole, chunks, wins = _given_rows(core, f1, c, num_rows(x2))
    buffer = PromotionBuffer()
    for s2, e2 in core.chunks(num_rows(x2), "Gram"):
        f2 = chunk_features(core, plan, take_rows(x2, s2, e2), False, columns=f1.contracted, linearized=outputs is not None)
        if outputs is not None:
            outputs[0][s2:e2], outputs[1][s2:e2] = f2.outputs, f2.linearized
        f2.promote_(out.dtype, buffer, join=True)  # the columns formed in out's dtype in one copy
        block = out[:, :, s2 * c : e2 * c]
        if plan.single:  # written into a contiguous block, then copied into the columns of out
            part = torch.zeros(block.shape, dtype=out.dtype, device=out.device)
            structured.gram_rows(core, plan, part, 0, whole, f2, c, False)
            block.copy_(part)
        if f1.held is not None:  # the held points in one product
            contraction.add_gram(out, 0, f1.held_points, f1.held, s2, e2, f2.columns, c, False)
        for s1, e1, k in chunks:
            contraction.add_gram(out, s1, e1, f1.columns(k), s2, e2, f2.columns, c, False)
        if blocks is not None:
            if plan.single:
                structured.diag_block_rows(core, plan, blocks[:, s2:e2], f2, c)
            contraction.add_diag_blocks(blocks, s2, e2, f2.columns, c)
    for s1, e1, cols, s2, e2, f2 in _window_passes(core, plan, f1, wins, x2, out.dtype, buffer, True):
        contraction.add_gram(out, s1, e1, cols, s2, e2, f2.columns, c, False)


def group_grams(core: NetworkCore, plan: LayerPlan, x1: Tensor, x2: Tensor, sym: bool, c: int, graph: bool,
                f1: FeatureSet | None = None, blocks: Tensor | None = None,
                outputs: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Per-group Grams ``(G, N1·C, N2·C)`` (``f1``: the given features of ``x1``, see the module doc; then
    ``blocks``, if given, receives the per-point blocks of ``x2`` ``(G, N2, C, C)`` and ``outputs``, two ``(N2, C)``
    tensors, :math:`f(x_2)` and :math:`J(x_2)\\theta^*`, from the same pass)."""
    groups = core.groups.num_groups
    out = torch.empty(groups, num_rows(x1) * c, num_rows(x2) * c, dtype=gram_dtype(core, f1), device=core.device)
    written = structured.term_groups(core, plan)
    for g in range(groups):
        if g not in written or (f1 is not None and not sym):
            out[g].zero_()
    if f1 is not None and not sym:
        _group_grams_given(core, plan, f1, x2, c, out, blocks, outputs)
        return out
    f2 = FeatureSet(core, plan, x2, graph) if f1 is None else f1
    whole = f2.rows(0, num_rows(x2), c)
    wins = windows(f2) if sym else []
    until = f2.held_points if wins else None
    for k1, s1, e1, rows in _row_chunks(core, plan, x1, f2, sym, c, graph, until):
        if plan.single:
            structured.gram_rows(core, plan, out, s1, rows, whole, c, graph)
        if f2.contracted and (until is None or s1 < until):
            for s2, e2, cols, mirror in _pairs(f2, k1, s1, rows, sym):
                contraction.add_gram(out, s1, e1, rows.columns, s2, e2, cols, c, mirror)
    _sym_windows(out, f2, wins, c, contraction.add_gram)
    return out


def _output_grams_given(core: NetworkCore, plan: LayerPlan, f1: FeatureSet, x2: Tensor, c: int, out: Tensor,
                        diag: Tensor | None, outputs: tuple[Tensor, Tensor] | None = None) -> None:
    """:func:`output_grams` from the given features of ``x1`` against ``x2``, one chunk of ``x2`` at a time (and,
    into ``outputs``, :math:`f(x_2)` and :math:`J(x_2)\\theta^*` from the same pass)."""
    whole, chunks, wins = _given_rows(core, f1, c, num_rows(x2))
    buffer = PromotionBuffer()
    for s2, e2 in core.chunks(num_rows(x2), "Gram"):
        f2 = chunk_features(core, plan, take_rows(x2, s2, e2), False, columns=f1.contracted, linearized=outputs is not None)
        if outputs is not None:
            outputs[0][s2:e2], outputs[1][s2:e2] = f2.outputs, f2.linearized
        f2.promote_(out.dtype, buffer)
        if plan.single:
            structured.output_gram_rows(core, plan, out[..., s2:e2], whole, f2, c, False)
            if diag is not None:
                structured.output_diagonal(core, plan, diag[:, s2:e2], f2, c)
        if f1.held is not None:  # the held points in one product per piece
            contraction.add_output_gram_pieces(out, 0, f1.held_points, f1.held, s2, e2, f2.pieces, c)
        for s1, e1, k in chunks:  # the chunk's columns as the pass wrote them (never joined)
            contraction.add_output_gram_pieces(out, s1, e1, f1.columns(k), s2, e2, f2.pieces, c, f2.tokens)
        if diag is not None and (f2.pieces or f2.tokens):
            contraction.add_output_diagonal_pieces(diag, s2, e2, f2.pieces, f2.tokens)
    for s1, e1, cols, s2, e2, f2 in _window_passes(core, plan, f1, wins, x2, out.dtype, buffer, False):
        contraction.add_output_gram_pieces(out, s1, e1, cols, s2, e2, f2.pieces, c)


def output_grams(
    core: NetworkCore, plan: LayerPlan, x1: Tensor, x2: Tensor, sym: bool, c: int, graph: bool, with_diagonal: bool,
    f1: FeatureSet | None = None, outputs: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-output Grams ``(G, C, N1, N2)`` and, ``with_diagonal``, the output diagonals of ``x2`` ``(G, N2, C)``
    (``f1``: the given features of ``x1``, see the module doc; with them and ``outputs``, two ``(N2, C)`` tensors,
    :math:`f(x_2)` and :math:`J(x_2)\\theta^*` are written into ``outputs`` from the same pass)."""
    kw = {"dtype": gram_dtype(core, f1), "device": core.device}
    groups, n2 = core.groups.num_groups, num_rows(x2)
    out = torch.zeros(groups, c, num_rows(x1), n2, **kw)
    diag = torch.zeros(groups, n2, c, **kw) if with_diagonal else None
    if f1 is not None and not sym:
        _output_grams_given(core, plan, f1, x2, c, out, diag, outputs)
        return out, diag
    if outputs is not None:
        raise ValueError("outputs need the given features of x1 and another x2")
    f2 = FeatureSet(core, plan, x2, graph) if f1 is None else f1
    whole = f2.rows(0, n2, c)
    wins = windows(f2) if sym else []
    until = f2.held_points if wins else None
    for k1, s1, e1, rows in _row_chunks(core, plan, x1, f2, sym, c, graph, until):
        if plan.single:
            structured.output_gram_rows(core, plan, out[:, :, s1:e1], rows, whole, c, graph)
        if f2.contracted and (until is None or s1 < until):
            for s2, e2, cols, mirror in _pairs(f2, k1, s1, rows, sym):
                contraction.add_output_gram(out, s1, e1, rows.columns, s2, e2, cols, c, mirror)
    _sym_windows(out, f2, wins, c, contraction.add_output_gram)
    if diag is not None:
        if plan.single:
            structured.output_diagonal(core, plan, diag, whole, c)
        if f2.contracted:
            for k2, (s2, e2) in enumerate(f2.bounds):
                contraction.add_output_diagonal(diag, s2, e2, f2.columns(k2), c)
    return out, diag


def diag_blocks(core: NetworkCore, plan: LayerPlan, x: Tensor, c: int, graph: bool) -> Tensor:
    """Per-group, per-point ``C×C`` blocks ``(G, N, C, C)``, chunk by chunk (one feature pass each)."""
    out = torch.zeros(core.groups.num_groups, num_rows(x), c, c, dtype=core.dtype, device=core.device)
    for s, e in core.chunks(num_rows(x), "diagonal"):
        f = chunk_features(core, plan, take_rows(x, s, e), graph)
        if plan.single:
            structured.diag_block_rows(core, plan, out[:, s:e], f, c)
        contraction.add_diag_blocks(out, s, e, f.columns, c)
    return out
