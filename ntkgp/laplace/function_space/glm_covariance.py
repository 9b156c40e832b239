r"""The GLM predictive covariance as a lazy ``LinearOperator`` evaluated in chunks of test points.

For test inputs :math:`X_*` (``M`` points, ``C`` outputs) the Laplace-GGN predictive covariance
:math:`J_* H^{-1} J_*^\top` is evaluated in the space its :class:`~ntkgp.laplace.SitePosterior` was
factorized in (:func:`~ntkgp.laplace.function_space.posterior_space`, docs/math.md, "GLM predictive"):

* weight space: the sum of squares :math:`A A^\top`, :math:`A = J_* P_0^{-1/2} R^{-1}` (never negative, in any
  precision);
* function space: the difference :math:`K_{**} - A A^\top`, :math:`A = K_{*X} L R^{-\top}`. It is exact in
  exact arithmetic, but it cancels when the posterior variance is much smaller than the prior variance
  :math:`K_{**}`: in float32 the error is of order :math:`10^{-7}\kappa(B)\,K_{**}`. Variances that come out
  negative by rounding are set to zero with a :class:`~linear_operator.utils.warnings.NumericalWarning`
  (docs/guarantees.md, "Predictive variances").

Neither :math:`K_{**}` (``(MC)²``) nor :math:`A` (``M·C × N·k`` or ``M·C × P``) is stored: every method computes
what it needs chunk by chunk, so that the memory of one evaluation is bounded by a constant times
``chunk_size · C · N · C`` numbers (docs/ntkgp.md, "Prediction at scale") whatever ``M`` is:

* :meth:`~GLMPredictiveCovariance.diagonal` (what ``.variance`` reads): per chunk the root :math:`A_c` (and in
  function space the cross-Gram :math:`K_{cX}` and the prior diagonal);
* ``__getitem__`` with tensor indices (e.g. the per-point ``C × C`` blocks of
  :func:`ntkgp.likelihoods.output_covariance_blocks`): only the points the indices touch;
* ``matmul``: two passes over the chunks (:math:`A^\top v`, then :math:`[K_{**} v] - A (A^\top v)` or
  :math:`A (A^\top v)`);
* ``to_dense``: the ``(MC)²`` matrix, built block by block.

Batches: inputs ``(*batch, n, D)`` give a ``(*batch, n·C, n·C)`` operator (the joint covariance within each
batch element, as GPyTorch's batch semantics require).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from gpytorch.kernels import Kernel
from linear_operator.operators import LinearOperator
from linear_operator.operators._linear_operator import _to_helper
from linear_operator.utils.warnings import NumericalWarning

from ...kernels import NTKKernel
from ...kernels.snapshot import KernelSnapshot
from ...ntk.private_copy import model_lock
from ...options import Space
from ...progress import Progress, reporting
from .site_posterior import SitePosterior

__all__ = ["GLMPredictiveCovariance", "PredictiveContext"]


@dataclass(eq=False)
class PredictiveContext:
    r"""What the predictive covariance needs besides the test inputs, as it is when the context is made.

    The kernel is read through a :class:`~ntkgp.kernels.snapshot.KernelSnapshot` taken then (:math:`\delta` and
    the network's weights and buffers): the covariance is that of the model at that moment whatever changes
    afterwards, as the site posterior (computed then) is (docs/guarantees.md, "Distributions are snapshots").

    Attributes:
        kernel: the NTK kernel (live; :meth:`current_kernel` is the one to compute with).
        posterior: the site posterior at the training data.
        train_x: training inputs ``(N, D)`` as the kernel takes them.
        num_outputs: ``C``, the network's outputs.
        outputs: the outputs kept (indices into ``range(C)``), or ``None`` for all.
        chunk_size: test points per chunk.
        progress: over the test points of each evaluation (:meth:`pass_over`; :mod:`ntkgp.progress`).
        name: the passes' name.
    """

    kernel: NTKKernel
    posterior: SitePosterior
    train_x: torch.Tensor
    num_outputs: int
    outputs: tuple[int, ...] | None
    chunk_size: int
    progress: bool | None = False
    name: str = "NTKGP prediction"
    snapshot: KernelSnapshot = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.snapshot = KernelSnapshot(self.kernel)

    def current_kernel(self) -> NTKKernel:
        """The kernel at the values of the moment the context was made (the live one while nothing changed)."""
        return self.snapshot.kernel()

    def _matrix(self, xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        """``K(xa, xb)`` dense, in the posterior's dtype, evaluated at once (no lazy tensor, no second snapshot)."""
        kernel = self.current_kernel()
        # the kernel's evaluation itself (GPyTorch's non-lazy path), not ``settings.lazily_evaluate_kernels(False)``:
        # a process-wide setting that concurrent predictions would corrupt
        block = super(Kernel, kernel).__call__(xa, xb)
        return (block.to_dense() if isinstance(block, LinearOperator) else block).to(self.posterior.dtype)

    @property
    def num_kept(self) -> int:
        return self.num_outputs if self.outputs is None else len(self.outputs)

    def keep(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Keep the rows (``dim=0``) or columns (``dim=1``) of the selected outputs of an interleaved matrix."""
        if self.outputs is None:
            return t
        c = self.num_outputs
        idx = torch.tensor(self.outputs, device=t.device)
        if dim == 0:
            return t.reshape(-1, c, *t.shape[1:])[:, idx].reshape(-1, *t.shape[1:])
        return t.reshape(t.shape[0], -1, c)[:, :, idx].reshape(t.shape[0], -1)

    @property
    def weight_space(self) -> bool:
        """Whether the covariance is the sum of squares ``A Aᵀ`` (weight space) rather than ``K_** − A Aᵀ``."""
        return self.posterior.space is Space.WEIGHT

    def root(self, xs: torch.Tensor) -> torch.Tensor:
        """``A`` for the points ``xs`` ``(m, D)``, kept outputs only: ``(m·C', N·k)`` or ``(m·C', P)``."""
        if self.weight_space:
            return self.posterior.weight_root(self.keep(self.current_kernel().jacobian(xs)))
        cross = self._matrix(xs, self.train_x)
        return self.posterior.variance_root(self.keep(cross))

    def variance(self, xs: torch.Tensor) -> torch.Tensor:
        """The predictive variances at ``xs`` for the kept outputs, ``(m·C',)``, never negative."""
        root = self.root(xs)
        if self.weight_space:
            return root.square().sum(-1)
        return nonnegative(self.prior_diagonal(xs) - root.square().sum(-1))

    def covariance_block(
        self, xa: torch.Tensor, xb: torch.Tensor, ra: torch.Tensor, rb: torch.Tensor
    ) -> torch.Tensor:
        """The covariance between ``xa`` and ``xb`` from their roots ``ra``, ``rb``: ``[K(xa, xb)] − ra rbᵀ`` or ``ra rbᵀ``."""
        if self.weight_space:
            return ra @ rb.mT
        return self.prior_block(xa, xb) - ra @ rb.mT

    def prior_diagonal(self, xs: torch.Tensor) -> torch.Tensor:
        """``diag K(xs, xs)`` for the kept outputs, ``(m·C',)``."""
        return self.keep(self.current_kernel()(xs, diag=True).reshape(-1).to(self.posterior.dtype))

    def prior_block(self, xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        """``K(xa, xb)`` for the kept outputs, ``(ma·C', mb·C')``."""
        return self.keep(self.keep(self._matrix(xa, xb), 0), 1)

    def chunks(self, m: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk_size, m)) for s in range(0, m, self.chunk_size)]

    @contextmanager
    def pass_over(self, m: int, what: str, unit: str = "point") -> Iterator[Progress]:
        """One evaluation pass over ``m`` units, ``"name (what)"``, with the progress :attr:`progress` asks; the
        kernel's own chunk passes (its Grams with the training inputs) are silent within it
        (:func:`~ntkgp.progress.reporting`, under the kernel's lock: one evaluation at a time changes its engine)."""
        kernel = self.current_kernel()
        name = f"{self.name} ({what})"
        with (model_lock(self.kernel), Progress(m, name, self.progress, unit=unit) as bar,
              reporting(kernel.engine.core, False, name)):
            yield bar


def nonnegative(variances: torch.Tensor) -> torch.Tensor:
    """Variances of the function-space difference ``K_** − A Aᵀ`` with rounding below zero set to zero (warned)."""
    negative = variances.detach() < 0
    if negative.any():
        warnings.warn(
            f"{int(negative.sum())} GLM predictive variances came out negative by cancellation in "
            f"{variances.dtype} (largest {variances.detach().min().item():.3g}) and were set to 0: the "
            "function-space form K** − A Aᵀ loses precision when the posterior variance is much smaller than the "
            "prior variance; space='weight' computes a sum of squares instead (docs/guarantees.md)",
            NumericalWarning,
            stacklevel=4,
        )
        return variances.clamp_min(0)
    return variances


class GLMPredictiveCovariance(LinearOperator):
    r"""The Laplace-GGN predictive covariance :math:`J_* H^{-1} J_*^\top = K_{**} - K_{*X} L B^{-1} L^\top K_{X*}` at
    test inputs ``x`` (a sum of squares in weight space; see the module docstring for the function-space form).

    Args:
        x: test inputs ``(*batch, n, D)`` as the kernel takes them (in the network's dtype).
        context: the kernel, site posterior, training inputs, outputs kept and chunk size.

    Gradients: :meth:`diagonal`, :meth:`to_dense` and tensor indexing are ordinary autograd computations
    (w.r.t. ``x`` and every hyperparameter). Products (``matmul``, solves) propagate gradients to ``x`` only.
    """

    def __init__(self, x: torch.Tensor, context: PredictiveContext) -> None:
        super().__init__(x, context=context)
        self.x = x
        self.context = context

    @property
    def dtype(self) -> torch.dtype:
        """The covariance's dtype: the inputs' when floating point, the posterior's for integer token ids."""
        return self.x.dtype if self.x.is_floating_point() else self.context.posterior.dtype

    def to(self, *args, **kwargs) -> GLMPredictiveCovariance:
        """As ``LinearOperator.to``; integer token ids are only moved, never cast."""
        if self.x.is_floating_point():
            return super().to(*args, **kwargs)
        device = _to_helper(*args, **kwargs)[0]
        return type(self)(self.x if device is None else self.x.to(device=device), self.context)

    # ------------------------------------------------------------------ LinearOperator interface
    def _size(self) -> torch.Size:
        side = self.x.shape[-2] * self.context.num_kept
        return torch.Size([*self.x.shape[:-2], side, side])

    def _transpose_nonbatch(self) -> GLMPredictiveCovariance:
        return self

    def _expand_batch(self, batch_shape) -> GLMPredictiveCovariance:
        return type(self)(self.x.expand(*batch_shape, *self.x.shape[-2:]), self.context)

    def _points(self) -> torch.Tensor:
        return self.x.reshape(-1, self.x.shape[-1])

    def _diagonal(self) -> torch.Tensor:
        ctx = self.context
        points = self._points()
        parts = []
        with ctx.pass_over(points.shape[0], "variances") as bar:
            for s, e in ctx.chunks(points.shape[0]):
                parts.append(ctx.variance(points[s:e]))
                bar.update(e - s)
        if not parts:  # no test points
            return torch.zeros(*self.batch_shape, 0, dtype=self.dtype, device=self.x.device)
        return torch.cat(parts).reshape(*self.batch_shape, -1)

    def _dense_single(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        chunks = ctx.chunks(x.shape[0])
        if not chunks:
            return torch.zeros(0, 0, dtype=self.dtype, device=x.device)
        # keep the roots A_j when they are no larger than the result (N·k ≤ n·C'), else recompute them
        store = len(chunks) == 1 or ctx.posterior.rank <= x.shape[0] * ctx.num_kept
        rows = []
        with ctx.pass_over(x.shape[0], "covariance") as bar:  # one unit per row of the result
            stored = [ctx.root(x[s:e]) for s, e in chunks] if store else None
            for i, (s, e) in enumerate(chunks):
                root_i = stored[i] if store else ctx.root(x[s:e])
                blocks = []
                for j, (s2, e2) in enumerate(chunks):
                    root_j = stored[j] if store else (root_i if j == i else ctx.root(x[s2:e2]))
                    blocks.append(ctx.covariance_block(x[s:e], x[s2:e2], root_i, root_j))
                rows.append(torch.cat(blocks, dim=-1))
                bar.update(e - s)
        dense = torch.cat(rows, dim=-2)
        if ctx.weight_space:
            return dense
        diagonal = dense.diagonal()
        return dense - torch.diag_embed(diagonal - nonnegative(diagonal))

    def to_dense(self) -> torch.Tensor:
        """The full ``(*batch, n·C, n·C)`` matrix (memory ``(n·C)²`` per batch element)."""
        n, d = self.x.shape[-2:]
        if self.x.numel() == 0:  # no test points (or an empty batch)
            return torch.zeros(self.shape, dtype=self.dtype, device=self.x.device)
        flat = self.x.reshape(-1, n, d)
        dense = torch.stack([self._dense_single(xb) for xb in flat])
        return dense.reshape(*self.batch_shape, *dense.shape[-2:])

    def _matmul_single(self, x: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        c = ctx.num_kept
        chunks = ctx.chunks(x.shape[0])
        if not chunks:
            return rhs[..., :0, :]
        at_rhs = 0
        out = []
        with ctx.pass_over(2 * x.shape[0], "products") as bar:  # each point twice: once per pass
            for s, e in chunks:  # first pass: Aᵀ v
                at_rhs = at_rhs + ctx.root(x[s:e]).mT @ rhs[s * c : e * c]
                bar.update(e - s)
            for s, e in chunks:  # second pass: K_** v − A (Aᵀ v) (or A (Aᵀ v)), row chunk by row chunk
                low_rank = ctx.root(x[s:e]) @ at_rhs
                out.append(low_rank if ctx.weight_space else ctx.prior_block(x[s:e], x) @ rhs - low_rank)
                bar.update(e - s)
        return torch.cat(out, dim=-2)

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        vector = rhs.dim() == 1
        if vector:
            rhs = rhs.unsqueeze(-1)
        batch = self.batch_shape
        out_batch = torch.broadcast_shapes(batch, rhs.shape[:-2])
        rhs = rhs.expand(*out_batch, *rhs.shape[-2:]).to(self.dtype)
        if self.x.numel() == 0:  # no test points: the product of an empty matrix
            res = torch.zeros(*out_batch, *rhs.shape[-2:], dtype=self.dtype, device=rhs.device)
            return res.squeeze(-1) if vector else res
        extra = len(out_batch) - len(batch)
        # move the leading dims the operator does not have to the columns: (*batch, n·C', t·extra)
        perm = list(range(extra, rhs.dim())) + list(range(extra))
        moved = rhs.permute(*perm)
        tail = moved.shape[len(batch) + 2 :]
        cols = moved.reshape(*batch, rhs.shape[-2], -1)
        n, d = self.x.shape[-2:]
        xs = self.x.expand(*batch, n, d).reshape(-1, n, d)
        flat_rhs = cols.reshape(-1, *cols.shape[-2:])
        res = torch.stack([self._matmul_single(xb, rb) for xb, rb in zip(xs, flat_rhs)])
        res = res.reshape(*batch, rhs.shape[-2], rhs.shape[-1], *tail)
        inverse = [0] * res.dim()
        for i, p in enumerate(perm):
            inverse[p] = i
        res = res.permute(*inverse)
        return res.squeeze(-1) if vector else res

    def _get_indices(self, row_index, col_index, *batch_indices) -> torch.Tensor:
        ctx = self.context
        shape = torch.broadcast_shapes(row_index.shape, col_index.shape, *(b.shape for b in batch_indices))
        rows = row_index.expand(shape).reshape(-1)
        cols = col_index.expand(shape).reshape(-1)
        flat_batch = torch.zeros_like(rows)
        for b, size in zip(batch_indices, self.batch_shape):
            flat_batch = flat_batch * size + b.expand(shape).reshape(-1)
        c, n = ctx.num_kept, self.x.shape[-2]
        p_row, o_row = flat_batch * n + rows // c, rows % c
        p_col, o_col = flat_batch * n + cols // c, cols % c
        points = self._points()
        num = rows.shape[0]
        # at most 2·step points per step, so that a K_UU block stays within chunk·N·C numbers
        budget = ctx.chunk_size * ctx.train_x.shape[0] * ctx.num_outputs
        step = max(1, min(ctx.chunk_size, math.isqrt(budget) // (2 * c)))
        values = []
        with ctx.pass_over(num, "entries", unit="value") as bar:
            for s in range(0, num, step):
                pr, pc, orow, ocol = (
                    p_row[s : s + step],
                    p_col[s : s + step],
                    o_row[s : s + step],
                    o_col[s : s + step],
                )
                if torch.equal(pr, pc):  # entries inside per-point blocks (e.g. output_covariance_blocks)
                    unique, inv = torch.unique(pr, return_inverse=True)
                    xs = points[unique]
                    root = ctx.root(xs)
                    value = (root[inv * c + orow] * root[inv * c + ocol]).sum(-1)
                    if not ctx.weight_space:
                        value = self._point_blocks(xs)[inv, orow, ocol] - value
                        on_diagonal = orow == ocol
                        value = torch.where(on_diagonal, nonnegative(torch.where(on_diagonal, value, 0)), value)
                else:
                    unique, inv = torch.unique(torch.cat([pr, pc]), return_inverse=True)
                    ir, ic = inv[: pr.shape[0]], inv[pr.shape[0] :]
                    xs = points[unique]
                    root = ctx.root(xs)
                    value = (root[ir * c + orow] * root[ic * c + ocol]).sum(-1)
                    if not ctx.weight_space:
                        value = ctx.prior_block(xs, xs)[ir * c + orow, ic * c + ocol] - value
                        on_diagonal = (ir == ic) & (orow == ocol)
                        value = torch.where(on_diagonal, nonnegative(torch.where(on_diagonal, value, 0)), value)
                values.append(value)
                bar.update(min(step, num - s))
        return torch.cat(values).reshape(shape)

    def _point_blocks(self, xs: torch.Tensor) -> torch.Tensor:
        """Per-point prior blocks ``K(x_m, x_m)`` for the kept outputs, ``(m, C', C')``."""
        ctx = self.context
        blocks_fn = getattr(ctx.current_kernel(), "diag_blocks", None)
        if callable(blocks_fn):
            blocks = blocks_fn(xs).to(ctx.posterior.dtype)
            if ctx.outputs is not None:
                idx = torch.tensor(ctx.outputs, device=blocks.device)
                blocks = blocks[:, idx][:, :, idx]
            return blocks
        c = ctx.num_kept
        full = ctx.prior_block(xs, xs).reshape(xs.shape[0], c, xs.shape[0], c)
        return full.diagonal(dim1=0, dim2=2).permute(2, 0, 1)
