r"""SFR's posterior covariance as a lazy :class:`~linear_operator.operators.LinearOperator` that never densifies.

.. math::
    \Sigma = K_{xx} - V^\top V + S^\top S, \qquad V = W K_{Zx},\ S = R^{-1} V,

for ``n`` test points (per batch element), ``(n·C, n·C)`` in GPyTorch's interleaved order. What is stored:
the test inputs, the posterior ``C×C`` block of each point (computed chunk by chunk when the predictive is
formed) and, when the points fit in one chunk, the low-rank factors :math:`V, S`. Everything else is
recomputed on demand from the inputs, one chunk at a time:

* marginal variances and per-point blocks (probit, Monte Carlo) read the stored blocks;
* products (:meth:`_matmul`) apply each piece to the right-hand side: :math:`K_{xx} v` matrix-free by one
  vector-Jacobian and one Jacobian-vector product (:meth:`~ntkgp.ntk.NTKEngine.matvec`), and
  :math:`V^\top (V v)`, :math:`S^\top(S v)` chunk by chunk: the dense matrix is never formed;
* :meth:`to_dense` (and entries off the point blocks) form the dense matrix, which is what was asked for.

What is recomputed is that of the moment the operator was made (:class:`TermsSnapshot`; docs/guarantees.md,
"Distributions are snapshots"): the posterior state (:math:`\delta`, the noise or temperature, the factors) is
held as computed then, and the network's weights and buffers and :math:`Z` are copied then, so that a change
afterwards (an optimizer step on the network, ``.data``, ``sfr.inducing_points``) is not read.
"""

from __future__ import annotations

import torch
from linear_operator.operators import LinearOperator
from linear_operator.operators._linear_operator import _to_helper
from linear_operator.utils.getitem import _is_noop_index
from linear_operator.utils.memoize import cached
from torch import Tensor

from ...caching import same_values
from ...kernels.snapshot import NetworkSnapshot
from .prediction_terms import PredictiveTerms

__all__ = ["SparsePosteriorCovariance", "TermsSnapshot"]


class TermsSnapshot:
    """The predictive terms at the network and inducing inputs of the moment they were made.

    The live ``terms`` while the network (:class:`~ntkgp.kernels.snapshot.NetworkSnapshot`) and :math:`Z` are
    unchanged; afterwards the same posterior state on an engine over a private copy of the network at the old
    weights and the copy of :math:`Z`.

    Args:
        terms: the live terms.
    """

    def __init__(self, terms: PredictiveTerms) -> None:
        self.terms = terms
        self.network = NetworkSnapshot(terms.engine)
        self.inducing_points = terms.inducing_points.detach().clone()
        self._frozen: PredictiveTerms | None = None

    def current(self) -> PredictiveTerms:
        """The terms to compute with now."""
        if self._frozen is not None:
            return self._frozen
        live = self.terms
        changed = self.network.changed()
        if not changed and same_values((self.inducing_points,), (live.inducing_points.detach(),)):
            return live
        engine = self.network.frozen() if changed else live.engine
        z = self.inducing_points
        terms = PredictiveTerms(
            engine, z, live.coupling, live.num_outputs, live.state, live.mean, live.predictive_mean,
            lambda: engine.jacobian(z), None,
        )
        if changed:  # a private network: these terms stay valid
            self._frozen = terms
        return terms


def project(a: Tensor, rhs: Tensor, num_outputs: int) -> Tensor:
    """``A v`` per system, ``(nb, K, k)``, for factors ``a`` ``(nb, K, R)`` and ``rhs`` ``(n·C, k)``."""
    if a.shape[0] == 1:
        return (a[0] @ rhs).unsqueeze(0)
    return torch.einsum("cmn,nck->cmk", a, rhs.view(-1, num_outputs, rhs.shape[-1]))


def project_t(a: Tensor, u: Tensor, num_outputs: int) -> Tensor:
    r""":math:`A^\top u`, ``(n·C, k)``, for factors ``a`` ``(nb, K, R)`` and ``u`` ``(nb, K, k)``."""
    if a.shape[0] == 1:
        return a[0].mT @ u[0]
    return torch.einsum("cmn,cmk->nck", a, u).reshape(-1, u.shape[-1])


def per_batch_factors(factor: Tensor, batch: torch.Size) -> Tensor:
    """Low-rank factors ``(nb, K, B·R)`` of a flattened batch of ``B`` elements as ``(*batch, nb, K, R)``."""
    nb, k, total = factor.shape
    count = max(1, batch.numel())
    return factor.view(nb, k, count, total // count).permute(2, 0, 1, 3).reshape(*batch, nb, k, total // count)


def low_rank_dense(a: Tensor, num_outputs: int) -> Tensor:
    r""":math:`A^\top A` arranged as ``(n·C, n·C)`` interleaved (output-diagonal blocks for ``nb = C`` systems)."""
    product = a.mT @ a
    if a.shape[0] == 1:
        return product[0]
    c, n = num_outputs, a.shape[-1]
    full = torch.zeros(n, c, n, c, dtype=product.dtype, device=product.device)
    idx = torch.arange(c, device=product.device)
    full[:, idx, :, idx] = product
    return full.view(n * c, n * c)


class SparsePosteriorCovariance(LinearOperator):
    r"""The SFR posterior covariance of ``n`` points per batch element, ``(*batch, n·C, n·C)``.

    Args:
        x: the prepared test inputs, ``(*batch, n, *example)``.
        blocks: posterior ``C×C`` block of each point, ``(*batch, n, C, C)``.
        low_rank_z: :math:`V` per batch element, ``(*batch, nb, K, R)``, or ``None`` (recomputed per chunk).
        low_rank_s: :math:`S = R^{-1}V`, same shape, or ``None``.
        terms: the model's :class:`~ntkgp.models.sfr.prediction_terms.PredictiveTerms` (prior products, factors).
        chunk_size: test points per chunk when factors are recomputed.
    """

    def __init__(
        self,
        x: Tensor,
        blocks: Tensor,
        low_rank_z: Tensor | None = None,
        low_rank_s: Tensor | None = None,
        *,
        terms: PredictiveTerms,
        chunk_size: int,
        snapshot: TermsSnapshot | None = None,
    ) -> None:
        factors = {} if low_rank_z is None else {"low_rank_z": low_rank_z, "low_rank_s": low_rank_s}
        snapshot = TermsSnapshot(terms) if snapshot is None else snapshot  # operators derived from this share it
        super().__init__(x, blocks, terms=terms, chunk_size=chunk_size, snapshot=snapshot, **factors)
        self.x, self.blocks = x, blocks
        self.low_rank_z, self.low_rank_s = low_rank_z, low_rank_s
        self.chunk_size, self.snapshot = chunk_size, snapshot

    @property
    def terms(self) -> PredictiveTerms:
        """The predictive terms of the moment the operator was made (:class:`TermsSnapshot`)."""
        return self.snapshot.current()

    # ------------------------------------------------------------------ shapes
    @property
    def dtype(self) -> torch.dtype:
        """The blocks' dtype (the inputs may be integer token ids)."""
        return self.blocks.dtype

    def to(self, *args, **kwargs) -> SparsePosteriorCovariance:
        """As ``LinearOperator.to``, except that integer token ids are only moved, never cast."""
        if self.x.is_floating_point():
            return super().to(*args, **kwargs)
        device, dtype = _to_helper(*args, **kwargs)
        factors = [None if t is None else t.to(dtype=dtype, device=device)
                   for t in (self.blocks, self.low_rank_z, self.low_rank_s)]
        return type(self)(self.x.to(device=device), *factors, terms=self.snapshot.terms, chunk_size=self.chunk_size,
                          snapshot=self.snapshot)

    @property
    def _num_points(self) -> int:
        return self.blocks.shape[-3]

    @property
    def _num_outputs(self) -> int:
        return self.blocks.shape[-1]

    def _size(self) -> torch.Size:
        rows = self._num_points * self._num_outputs
        return torch.Size([*self.blocks.shape[:-3], rows, rows])

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def _points(self, index: int) -> Tensor:
        """The inputs of batch element ``index`` (flattened batch), ``(n, *example)``, in the network's dtype (they
        are stored in the operator's; the conversion back is exact)."""
        batch = self.blocks.dim() - 3
        return self.x.reshape(-1, *self.x.shape[batch:])[index].to(self.terms.engine.dtype)

    @property
    def _algebra_dtype(self) -> torch.dtype:
        """The dtype of the terms (the statistics'), in which products are formed."""
        return self.terms.state.weights.dtype

    def _factors(self, index: int) -> list[tuple[slice, Tensor, Tensor]]:
        """``(rows, V, S)`` per chunk of batch element ``index``: stored, or recomputed chunk by chunk."""
        n, c = self._num_points, self._num_outputs
        if self.low_rank_z is not None:
            shape = self.low_rank_z.shape[-3:]
            z = self.low_rank_z.reshape(-1, *shape)[index]
            s = self.low_rank_s.reshape(-1, *shape)[index]
            return [(slice(0, n * c), z, s)]
        x = self._points(index)
        return [
            (slice(i * c, min(i + self.chunk_size, n) * c), *self.terms.low_rank(x[i : i + self.chunk_size]))
            for i in range(0, n, self.chunk_size)
        ]

    # ------------------------------------------------------------------ what never forms the matrix
    def _diagonal(self) -> Tensor:
        return self.blocks.diagonal(dim1=-2, dim2=-1).reshape(*self.blocks.shape[:-3], -1)

    def point_blocks(self) -> Tensor:
        """Posterior ``C×C`` block of each point, ``(*batch, n, C, C)``."""
        return self.blocks

    def _matmul(self, rhs: Tensor) -> Tensor:
        vector = rhs.dim() == 1
        rhs = rhs.unsqueeze(-1) if vector else rhs
        batch = torch.broadcast_shapes(self.batch_shape, rhs.shape[:-2])
        op = self if batch == self.batch_shape else self._expand_batch(batch)
        rhs = rhs.expand(*batch, *rhs.shape[-2:])
        flat = rhs.reshape(-1, *rhs.shape[-2:])
        c = self._num_outputs
        outs = []
        for index in range(flat.shape[0]):
            v = flat[index].to(self._algebra_dtype)
            out = op.terms.prior_matmul(op._points(index), v)
            chunks = op._factors(index)
            proj_z = sum(project(z, v[rows], c) for rows, z, _ in chunks)
            proj_s = sum(project(s, v[rows], c) for rows, _, s in chunks)
            if len(chunks) > 1 and op.low_rank_z is None:  # second pass: recomputed, not kept
                chunks = op._factors(index)
            correction = torch.cat([project_t(s, proj_s, c) - project_t(z, proj_z, c) for _, z, s in chunks])
            outs.append(out + correction)
        result = torch.stack(outs).reshape(*batch, *rhs.shape[-2:]).to(rhs.dtype)
        return result.squeeze(-1) if vector else result

    def matmul(self, other: Tensor | LinearOperator) -> Tensor | LinearOperator:
        """Products by plain autograd (every term keeps its graph to the inputs and hyperparameters)."""
        if isinstance(other, LinearOperator):
            return super().matmul(other)
        return self._matmul(other)

    # ------------------------------------------------------------------ what forms it
    @cached
    def to_dense(self) -> Tensor:
        c, batch = self._num_outputs, self.batch_shape
        dense = []
        for index in range(batch.numel()):
            chunks = self._factors(index)
            z = torch.cat([f for _, f, _ in chunks], dim=-1)
            s = torch.cat([f for _, _, f in chunks], dim=-1)
            prior = self.terms.prior_dense(self._points(index))
            dense.append(prior - low_rank_dense(z, c) + low_rank_dense(s, c))
        return torch.stack(dense).reshape(*batch, *self.matrix_shape).to(self.blocks.dtype)

    def _get_indices(self, row_index: Tensor, col_index: Tensor, *batch_indices: Tensor) -> Tensor:
        c = self._num_outputs
        row_index, col_index, *batch_indices = torch.broadcast_tensors(row_index, col_index, *batch_indices)
        if bool((row_index // c == col_index // c).all()):
            return self.blocks[(*batch_indices, row_index // c, row_index % c, col_index % c)]
        return self.to_dense()[(*batch_indices, row_index, col_index)]

    # ------------------------------------------------------------------ batch operations
    def _map(self, fn) -> SparsePosteriorCovariance:
        """A new operator with ``fn(tensor, num_trailing)`` applied to every stored tensor's batch dimensions."""
        extra = self.x.dim() - self.blocks.dim() + 3  # trailing dimensions of x after the batch
        z = None if self.low_rank_z is None else fn(self.low_rank_z, 3)
        s = None if self.low_rank_s is None else fn(self.low_rank_s, 3)
        return SparsePosteriorCovariance(
            fn(self.x, extra), fn(self.blocks, 3), z, s, terms=self.snapshot.terms, chunk_size=self.chunk_size,
            snapshot=self.snapshot,
        )

    def _getitem(self, row_index, col_index, *batch_indices) -> LinearOperator:
        if _is_noop_index(row_index) and _is_noop_index(col_index) and batch_indices:
            return self._map(lambda t, _: t[batch_indices])
        return super()._getitem(row_index, col_index, *batch_indices)

    def _expand_batch(self, batch_shape) -> SparsePosteriorCovariance:
        return self._map(lambda t, k: t.expand(*batch_shape, *t.shape[t.dim() - k :]))

    def _unsqueeze_batch(self, dim: int) -> SparsePosteriorCovariance:
        return self._map(lambda t, _: t.unsqueeze(dim))

    def _permute_batch(self, *dims: int) -> SparsePosteriorCovariance:
        return self._map(lambda t, k: t.permute(*dims, *range(len(dims), t.dim())))
