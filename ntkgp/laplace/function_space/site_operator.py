r"""The site matrix of the Laplace evidence, :math:`B = I + L^\top K L`, as a matrix-free ``LinearOperator``.

Represented by the tensors :math:`(L, \delta)` (:math:`L` the block-diagonal site factor, ``(N, C, k)``; the
NTK :math:`K` through :class:`~ntkgp.ntk.products.NTKProducts`), its product is
:math:`v + L^\top J P_0^{-1} J^\top L v`, and its bilinear derivative

.. math::
    \frac{\partial\, u^\top B v}{\partial \delta_g} = -\delta_g^{-2}\,
        \langle J_g^\top L u,\, J_g^\top L v\rangle, \qquad
    \frac{\partial\, u^\top B v}{\partial L_n} = (K L v)_n u_n^\top + (K L u)_n v_n^\top

carries GPyTorch's stochastic gradient to :math:`\delta` and, through :math:`L`, to the noise and the temperature.
It supplies GPyTorch's CG with the randomized Nyström preconditioner
(:class:`~ntkgp.laplace.function_space.nystrom.NystromPreconditioner`) and probe vectors drawn from it.
"""

from __future__ import annotations

import math

import torch
from linear_operator import settings
from linear_operator.operators import LinearOperator

from .algebra import as_columns, block_apply
from ...ntk.products import NTKProducts
from .nystrom import NystromPreconditioner

__all__ = ["LaplaceSiteOperator"]


class LaplaceSiteOperator(LinearOperator):
    r""":math:`B = I + L^\top K L` (``(N·k, N·k)``) with the NTK :math:`K` matrix-free, represented by
    :math:`(L, \delta)`.

    Args:
        factor: :math:`L` as blocks ``(N, C, k)`` (:func:`ntkgp.laplace.function_space.curvature_factor`).
        prior_precision: :math:`\delta`, shape ``(G,)``.
        products: the products of the network at the inputs.
        preconditioner_rank: rank of the Nyström preconditioner (0: none).
        generator: random generator of the probes and of the preconditioner (``None``: torch's global one).
    """

    def __init__(
        self,
        factor: torch.Tensor,
        prior_precision: torch.Tensor,
        products: NTKProducts,
        preconditioner_rank: int = 0,
        generator: torch.Generator | None = None,
        sketch: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(
            factor,
            prior_precision,
            products=products,
            preconditioner_rank=preconditioner_rank,
            generator=generator,
            sketch=sketch,
        )
        self.factor = factor
        self.prior_precision = prior_precision
        self.products = products
        self.preconditioner_rank = preconditioner_rank
        self.generator = generator
        self._sketch = sketch
        self._nystrom: NystromPreconditioner | None = None

    # ------------------------------------------------------------------ the matrix
    def _size(self) -> torch.Size:
        n, _, k = self.factor.shape
        return torch.Size([n * k, n * k])

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def _sandwich(self, r: torch.Tensor) -> torch.Tensor:
        """``Lᵀ K L r`` for ``r`` ``(N·k, m)``."""
        factor = self.factor.detach()
        w = self.prior_precision.detach().reciprocal()
        kl = self.products.matvec(block_apply(factor, r), w)
        return block_apply(factor, kl.to(r), transpose=True)

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        r, vec = as_columns(rhs)
        out = r + self._sandwich(r)
        return out.squeeze(-1) if vec else out

    def _diagonal(self) -> torch.Tensor:
        blocks = self.products.engine.diag_blocks(self.products.x)  # (G, N, C, C)
        w = self.prior_precision.detach().reciprocal().to(blocks)
        k_nn = torch.einsum("g,gnij->nij", w, blocks).to(self.factor)
        factor = self.factor.detach()
        inner = torch.einsum("nia,nij,nja->na", factor, k_nn, factor)
        return 1 + inner.reshape(-1)

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor) -> tuple:
        factor, delta = self.factor, self.prior_precision
        if not (factor.requires_grad or delta.requires_grad):
            return (None, None)
        products = self.products
        n, c, k = factor.shape
        with torch.no_grad():
            f = factor.detach()
            left, right = as_columns(left_vecs)[0], as_columns(right_vecs)[0]
            d = left.shape[-1]
            w = delta.detach().reciprocal()
            tu = products.transpose(block_apply(f, left))
            tv = products.transpose(block_apply(f, right))
            delta_grad = factor_grad = None
            if delta.requires_grad:
                delta_grad = -products.group_inner(tu, tv).to(delta) * w.square()
            if factor.requires_grad:
                ku = products.apply(products.weighted(tu, w)).to(f).view(n, c, d)
                kv = products.apply(products.weighted(tv, w)).to(f).view(n, c, d)
                factor_grad = torch.einsum("nad,ncd->nca", left.reshape(n, k, d), kv) + torch.einsum(
                    "nad,ncd->nca", right.reshape(n, k, d), ku
                )
        return (factor_grad, delta_grad)

    # ------------------------------------------------------------------ preconditioner and probes
    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=self.dtype, device=self.device)

    def sketch(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The per-group sketches :math:`Y_g = K_g \Omega` (``(G, N·C, r)``) of the test matrix
        :math:`\Omega = L Q` (:math:`Q` Gaussian ``N·k × r``, orthonormalized): one product with :math:`r`
        columns. They do not depend on :math:`\delta`, and any test matrix gives a valid preconditioner, so one
        sketch serves every hyperparameter step at the same weights and inputs (``sketch=`` of the constructor)."""
        if self._sketch is None:
            m = self.shape[-1]
            rank = min(self.preconditioner_rank, m)
            products = self.products
            with torch.no_grad():
                q, _ = torch.linalg.qr(self._randn(m, rank))
                omega = block_apply(self.factor.detach(), q)
                jt = products.transpose(omega)
                sketches = torch.stack(
                    [products.apply(products.group_part(jt, g)).to(q) for g in range(products.num_groups)]
                )
            self._sketch = (sketches, omega)
        return self._sketch

    def nystrom(self) -> NystromPreconditioner | None:
        r"""The preconditioner :math:`P = I + L^\top \hat K(\delta) L` (:class:`NystromPreconditioner`) from
        :meth:`sketch`, built once per operator (``None`` for rank 0)."""
        if self._nystrom is None and self.preconditioner_rank > 0:
            sketches, omega = self.sketch()
            with torch.no_grad():
                y = torch.einsum("g,gmr->mr", self.prior_precision.detach().reciprocal().to(omega), sketches)
                shift = math.sqrt(self.shape[-1]) * torch.finfo(self.dtype).eps * torch.linalg.norm(y)
            self._nystrom = NystromPreconditioner(self.factor, self.prior_precision, sketches, omega, shift)
        return self._nystrom

    def _preconditioner(self) -> tuple:
        precond = self.nystrom()
        if precond is None:
            return None, None, None
        return precond.solve_closure(), precond, precond.log_det()

    def _probe_vectors_and_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        m, t = self.shape[-1], settings.num_trace_samples.value()
        with torch.no_grad():
            z = self._randn(m, t)
            precond = self.nystrom()
            if precond is not None:
                root = precond.detached_root()
                z = z + root @ self._randn(root.shape[-1], t)
            norms = torch.linalg.norm(z, dim=-2, keepdim=True)
        return z / norms, norms
