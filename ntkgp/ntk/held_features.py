r"""The features of one chunk of inputs as the feature pass (:mod:`ntkgp.ntk.feature_pass`) leaves them
(:class:`ChunkFeatures`: the single-location layers' inputs and gradients, the contracted columns as pieces or
joined, :class:`Contracted`) and their promotion to a finer dtype for a contraction against features kept in it
(SFR's float32 data against the float64 features of its inducing inputs: :mod:`ntkgp.ntk.grams`), into one
:class:`PromotionBuffer` reused from chunk to chunk."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .token_grams import TokenSums


class Contracted(dict):
    """The contracted features of a chunk: the columns ``{group: (n·C, P_g)}`` (this dict) and the embedding tables'
    token sums :attr:`tokens` (:class:`~ntkgp.ntk.token_grams.TokenSums`, contracted as Grams of equal tokens)."""

    def __init__(self, columns: dict[int, Tensor] | None = None, tokens: tuple[TokenSums, ...] = ()) -> None:
        super().__init__(columns or {})
        self.tokens = tuple(tokens)

    def to(self, dtype: torch.dtype) -> Contracted:
        """The same features in ``dtype``."""
        return Contracted({g: t.to(dtype) for g, t in self.items()}, tuple(t.to(dtype) for t in self.tokens))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.values()) + sum(t.nbytes() for t in self.tokens)


class ChunkFeatures:
    """The features of one chunk: single-location layers' inputs ``(n, d_in)`` and gradients ``(n·C, d_out)``,
    and the contracted features (:class:`Contracted`: columns ``{group: (n·C, P_g)}`` and token sums).

    The columns may be given as ``pieces`` ``{group: [(C, n, P_i), ...]}`` (the multi-location and normalization
    layers' blocks as the feature pass writes them, then the generic parameters' Jacobians, in the columns' order):
    ``columns`` is then formed from them on first use (one copy); the contractions that can use the pieces directly
    (:func:`~ntkgp.ntk.contraction.add_output_gram_pieces`) never form it. ``tokens``: the tables' token sums."""

    def __init__(self, inputs: dict[str, Tensor], grads: dict[str, Tensor], columns: Contracted | None = None,
                 pieces: dict[int, list[Tensor]] | None = None, outputs: Tensor | None = None,
                 linearized: Tensor | None = None, tokens: tuple[TokenSums, ...] = ()) -> None:
        self.inputs, self.grads, self.pieces, self._columns = inputs, grads, pieces, columns
        self.tokens = tuple(tokens) if columns is None else columns.tokens
        self.outputs, self.linearized = outputs, linearized  # f(x) and J(x)θ* (n, C), when the pass formed them

    @property
    def columns(self) -> Contracted:
        if self._columns is None:
            self._columns = Contracted({g: _joined(p) for g, p in (self.pieces or {}).items()}, self.tokens)
        return self._columns

    @columns.setter
    def columns(self, value: Contracted) -> None:
        self._columns, self.pieces, self.tokens = value, None, value.tokens

    def promote_(self, dtype: torch.dtype, buffer: PromotionBuffer | None = None, join: bool = False) -> ChunkFeatures:
        """Convert the features (not ``outputs``, ``linearized``) to ``dtype`` in place, each original released as it
        is converted, for a contraction against features kept in that finer dtype (:mod:`ntkgp.ntk.grams`, given
        features); those already in ``dtype`` are kept as they are. With ``buffer`` (:class:`PromotionBuffer`) they
        are copied into its memory, reused from chunk to chunk (no fresh allocation per chunk). ``join``: the columns
        ``(n·C, P_g)`` are formed in ``dtype`` directly from the pieces (one copy, not a promotion and a join).
        Returns ``self``."""
        slots = [(held, key) for held in (self.inputs, self.grads, self._columns or {}) for key in held]
        pieces = self.pieces or {}
        joining = join and self._columns is None and bool(pieces)
        if joining:  # the columns (n, C, P_g) of each group
            c, n = next(iter(pieces.values()))[0].shape[:2]
            shapes = [(n, c, sum(p.shape[-1] for p in parts)) for parts in pieces.values()]
        else:
            slots += [(parts, i) for parts in pieces.values() for i in range(len(parts))]
            shapes = []
        slots = [(held, key) for held, key in slots if held[key].dtype != dtype]
        shapes += [held[key].shape for held, key in slots]
        if shapes:
            device = slots[0][0][slots[0][1]].device if slots else next(iter(pieces.values()))[0].device
            new = buffer.views(shapes, dtype, device) if buffer is not None else [
                torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
            if joining:  # the joined columns first, each piece copied into its place
                self.columns = Contracted({g: _join_into(parts, cols) for (g, parts), cols in zip(pieces.items(), new)},
                                          self.tokens)
            for (held, key), target in zip(slots, new[len(new) - len(slots):]):
                held[key] = target.copy_(held[key])
        self.tokens = tuple(t.to(dtype) for t in self.tokens)  # the tables' token sums
        if self._columns is not None:
            self._columns.tokens = self.tokens
        return self

    def join_into(self, block: dict[int, Tensor], start: int) -> Contracted:
        """The columns written into the rows ``start:start + n`` of ``block`` ``{group: (N, C, P_g)}`` (the columns of
        many chunks in one tensor each: :class:`~ntkgp.ntk.feature_pass.FeatureSet`), each piece copied into its place
        (unless the pass wrote it there: ``chunk_features(..., into=)``) and released; returns them (views of ``block``, ``(n·C, P_g)``), also kept as :attr:`columns`. Only for
        columns given as pieces (no token sums)."""
        if self.tokens or self._columns is not None:
            raise ValueError("join_into needs the columns as pieces and no token sums")
        n = next(iter(self.pieces.values()))[0].shape[1] if self.pieces else 0
        self.columns = Contracted({g: _join_into(parts, block[g][start : start + n])
                                   for g, parts in self.pieces.items()})
        return self.columns


class PromotionBuffer:
    """The memory that the features of successive chunks are promoted into (:meth:`ChunkFeatures.promote_`), one
    flat tensor reused from chunk to chunk and grown to the largest chunk's features: a fresh copy per chunk would
    pay its allocation's page faults again each time (several times the copy itself on a CPU). The features of a
    chunk promoted into it are valid until the next chunk is promoted."""

    def __init__(self) -> None:
        self.flat: Tensor | None = None

    def views(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        """Contiguous tensors of ``shapes`` in the buffer (each starting on a 64-byte boundary), its earlier contents
        given up."""
        align = max(1, 64 // torch.empty((), dtype=dtype).element_size())
        sizes = [math.prod(shape) for shape in shapes]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + -(-size // align) * align)
        flat = self.flat
        if flat is None or flat.dtype != dtype or flat.device != torch.device(device) or flat.numel() < starts[-1]:
            self.flat = flat = None  # the old buffer released before the new one is taken
            self.flat = flat = torch.empty(starts[-1], dtype=dtype, device=device)
        return [flat[s : s + size].view(shape) for s, size, shape in zip(starts, sizes, shapes)]


def _join_into(parts: list[Tensor | None], cols: Tensor) -> Tensor:
    """The pieces ``(C, n, P_i)`` copied into their columns of ``cols`` ``(n, C, P)`` (each released as it is copied);
    returns ``cols`` as ``(n·C, P)`` (rows ``n·C + c``)."""
    start = 0
    for i, piece in enumerate(parts):
        target, source = cols[..., start : start + piece.shape[-1]], piece.transpose(0, 1)
        if not _same_memory(target, source):  # not written in place by the pass
            target.copy_(source)
        start += piece.shape[-1]
        parts[i] = None  # released as copied
    return cols.view(-1, cols.shape[-1])


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (strides of dimensions of size 1 aside)."""
    return (a.shape == b.shape and a.data_ptr() == b.data_ptr()
            and all(n == 1 or s == t for n, s, t in zip(a.shape, a.stride(), b.stride())))


def _joined(pieces: list[Tensor]) -> Tensor:
    """``(n·C, P)`` from the pieces ``(C, n, P_i)`` (rows ``n·C + c``)."""
    c, n = pieces[0].shape[:2]
    parts = [p.transpose(0, 1) for p in pieces]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).reshape(n * c, -1)
