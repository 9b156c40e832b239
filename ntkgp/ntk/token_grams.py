r"""The NTK's Grams of ``nn.Embedding`` tables from the one-hot structure of their Jacobians: a Gram of equal tokens.

An embedding :math:`z_{nt} = E_{\mathrm{id}_{nt}}` (table :math:`E` ``(V, D)``) has the per-example Jacobian
:math:`\partial f_c(x_n) / \partial E_v = \sum_{t: \mathrm{id}_{nt} = v} \Gamma_{nct}` with
:math:`\Gamma_{nct} = \partial f_c(x_n) / \partial z_{nt}` (:mod:`ntkgp.ntk.norm_features`): zero on every row
of the table but the example's tokens. So its Gram block is a Gram of equal tokens,

.. math::
    [J_E(x) J_E(x')^\top]_{cc'} = \sum_{t, t'} [\mathrm{id}_t = \mathrm{id}'_{t'}]\,
        \langle \Gamma_{ct}, \Gamma'_{c't'} \rangle
    = \sum_{v \in \mathrm{tokens}(x) \cap \mathrm{tokens}(x')} \langle S_{cv}, S'_{c'v} \rangle, \qquad
    S_{cv} = \sum_{t: \mathrm{id}_t = v} \Gamma_{ct}

(``docs/math.md``, "Structured form"), never a ``(V·D)``-wide Jacobian row. The feature pass keeps, per chunk of
``n`` examples, the :class:`TokenSums` :math:`S` of each distinct (example, token) pair, at most ``n·T`` of them
(``C·D`` numbers each; padding tokens, which get no gradient, are dropped); a Gram block of two chunks is a sum over
the pairs of entries with equal tokens, found by sorting (one ``searchsorted``): :math:`\sum_v a_v b_v` pairs for
:math:`a_v, b_v` the examples of each chunk holding token :math:`v` (at most :math:`n_1 n_2 T`), each a ``C×C``
product of length ``D``. The pairs are formed in blocks of at most :data:`PAIR_NUMBERS` numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: Numbers of the temporaries of one block of token pairs (their sums gathered and their products).
PAIR_NUMBERS = 1 << 23


@dataclass(frozen=True)
class TokenSums:
    r"""An embedding table's features of one chunk: the sums :math:`S` of the output gradients of each distinct
    (example, token) pair (module docstring).

    Attributes:
        group: the prior group of the table.
        name: the table's parameter name.
        examples: ``(U,)`` each entry's example in the chunk (sorted).
        tokens: ``(U,)`` its token id.
        sums: ``(U, C, D)`` :math:`S_{cv}` of the entry's example and token.
    """

    group: int
    name: str
    examples: Tensor
    tokens: Tensor
    sums: Tensor

    def to(self, dtype: torch.dtype) -> TokenSums:
        """The same sums in ``dtype``."""
        return TokenSums(self.group, self.name, self.examples, self.tokens, self.sums.to(dtype))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.examples, self.tokens, self.sums))


def token_keys(ids: Tensor, vocab: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The distinct (example, token) pairs of the ids ``(n, T)`` (``-1``: padding, dropped): their examples and
    tokens ``(U,)``, the locations kept ``(n·T,)`` (a mask) and each kept location's entry (``inverse``)."""
    keep = (ids >= 0).reshape(-1)
    keys = (torch.arange(ids.shape[0], device=ids.device)[:, None] * vocab + ids).reshape(-1)[keep]
    unique, inverse = torch.unique(keys, return_inverse=True)
    return torch.div(unique, vocab, rounding_mode="floor"), unique % vocab, keep, inverse


def _pairs(t1: TokenSums, t2: TokenSums, width: int):
    """Blocks ``(i, j)`` of the entries of ``t1`` and ``t2`` with equal tokens, at most about
    :data:`PAIR_NUMBERS` ``// width`` pairs each."""
    order = torch.argsort(t2.tokens)
    sorted_tokens = t2.tokens[order]
    low = torch.searchsorted(sorted_tokens, t1.tokens)
    counts = torch.searchsorted(sorted_tokens, t1.tokens, right=True) - low
    ends = counts.cumsum(0)
    total = int(ends[-1]) if ends.numel() else 0
    if total == 0:
        return
    budget = max(1, PAIR_NUMBERS // max(1, width))
    marks = torch.tensor(list(range(budget, total, budget)), dtype=ends.dtype, device=ends.device)
    edges = torch.searchsorted(ends, marks, right=True).tolist()
    start = 0
    for stop in [*edges, t1.tokens.numel()]:
        if stop <= start:
            continue
        part = counts[start:stop]
        i = torch.repeat_interleave(torch.arange(start, stop, device=part.device), part)
        first = torch.repeat_interleave(ends[start:stop] - part, part)
        j = order[low[i] + torch.arange(i.numel(), device=i.device) - first + (ends[start] - counts[start])]
        start = stop
        yield i, j


def gram(t1: TokenSums, n1: int, t2: TokenSums, n2: int) -> Tensor:
    r"""The table's Gram block :math:`J_E(X_1) J_E(X_2)^\top` ``(n1·C, n2·C)`` (rows ``n·C + c``) of two chunks."""
    c, d = t1.sums.shape[1:]
    out = t1.sums.new_zeros(n1 * n2, c, c)
    for i, j in _pairs(t1, t2, c * c + 2 * c * d):
        values = torch.bmm(t1.sums[i], t2.sums[j].transpose(1, 2))
        out.index_add_(0, t1.examples[i] * n2 + t2.examples[j], values)
    return out.view(n1, n2, c, c).transpose(1, 2).reshape(n1 * c, n2 * c)


def output_gram(t1: TokenSums, n1: int, t2: TokenSums, n2: int) -> Tensor:
    r"""The table's per-output Grams :math:`[J_E(x) J_E(x')^\top]_{cc}` ``(C, n1, n2)`` of two chunks."""
    c, d = t1.sums.shape[1:]
    out = t1.sums.new_zeros(n1 * n2, c)
    for i, j in _pairs(t1, t2, c + 2 * c * d):
        values = (t1.sums[i] * t2.sums[j]).sum(-1)
        out.index_add_(0, t1.examples[i] * n2 + t2.examples[j], values)
    return out.T.reshape(c, n1, n2)


def diag_blocks(t: TokenSums, n: int) -> Tensor:
    r"""The per-point blocks :math:`J_E(x_n) J_E(x_n)^\top` ``(n, C, C)``: each entry with itself (the tokens of
    one example are distinct entries)."""
    c = t.sums.shape[1]
    return t.sums.new_zeros(n, c, c).index_add(0, t.examples, torch.bmm(t.sums, t.sums.transpose(1, 2)))


def output_diagonal(t: TokenSums, n: int) -> Tensor:
    r"""The output diagonals of the per-point blocks ``(n, C)``."""
    return t.sums.new_zeros(n, t.sums.shape[1]).index_add(0, t.examples, t.sums.square().sum(-1))


def linearized(t: TokenSums, n: int, table: Tensor) -> Tensor:
    r""":math:`J_E(x_n) E` ``(n, C)``: :math:`\sum_v \langle S_{cv}, E_v \rangle` for the table ``(V, D)``."""
    values = torch.bmm(t.sums, table[t.tokens].to(t.sums)[..., None])[..., 0]
    return t.sums.new_zeros(n, t.sums.shape[1]).index_add(0, t.examples, values)
