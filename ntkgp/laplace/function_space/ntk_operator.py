r"""The NTK Gram as a matrix-free GPyTorch ``LinearOperator``, differentiable in the prior precisions.

:math:`K = \sum_g \delta_g^{-1} J_g J_g^\top` (``(N·C, N·C)``, rows ``n·C + c``) is represented by
:math:`\delta` alone: a product is one vector-Jacobian and one Jacobian-vector product per column block
(:class:`~ntkgp.ntk.products.NTKProducts`), the diagonal comes from the per-point blocks,
and the bilinear derivative :math:`\partial(u^\top K v)/\partial\delta_g = -\delta_g^{-2}\langle J_g^\top u,
J_g^\top v\rangle` gives GPyTorch's solves and log-determinants their gradients in :math:`\delta`.
"""

from __future__ import annotations

import torch
from linear_operator.operators import LinearOperator

from .algebra import as_columns
from ...ntk.products import NTKProducts

__all__ = ["MatrixFreeNTKOperator"]


class MatrixFreeNTKOperator(LinearOperator):
    r"""The NTK Gram :math:`K = \sum_g \delta_g^{-1} J_g J_g^\top` (``(N·C, N·C)``) as a matrix-free operator.

    Represented by the prior precisions ``(G,)``, so solves and log-determinants through GPyTorch give
    gradients in :math:`\delta`. Products cost one vector-Jacobian and one Jacobian-vector product per
    column block; the diagonal comes from the per-point blocks (no Gram).

    Args:
        prior_precision: :math:`\delta`, shape ``(G,)``.
        products: the products of the network at the inputs.
    """

    def __init__(self, prior_precision: torch.Tensor, products: NTKProducts) -> None:
        super().__init__(prior_precision, products=products)
        self.products = products
        self.prior_precision = prior_precision

    def _size(self) -> torch.Size:
        m = self.products.num_rows
        return torch.Size([m, m])

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        r, vec = as_columns(rhs)
        w = self.prior_precision.detach().reciprocal()
        out = self.products.matvec(r, w).to(rhs)
        return out.squeeze(-1) if vec else out

    def _diagonal(self) -> torch.Tensor:
        blocks = self.products.engine.diag_blocks(self.products.x)  # (G, N, C, C)
        w = self.prior_precision.detach().reciprocal().to(blocks)
        return torch.einsum("g,gncc->nc", w, blocks).reshape(-1).to(self.prior_precision)

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor) -> tuple:
        delta = self.prior_precision
        if not delta.requires_grad:
            return (None,)
        with torch.no_grad():
            left, right = as_columns(left_vecs)[0], as_columns(right_vecs)[0]
            inner = self.products.group_inner(self.products.transpose(left), self.products.transpose(right))
            return (-inner.to(delta) / delta.detach().square(),)
