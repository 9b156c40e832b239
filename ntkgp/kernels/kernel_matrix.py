r"""The matrix :math:`K(x_1, x_2)` of :class:`~ntkgp.kernels.NTKKernel` as a linear operator, and its diagonal.

Weight space (``space="weight"``, or ``"auto"`` when :math:`P < N \cdot C`): a
:class:`~linear_operator.operators.LowRankRootLinearOperator` with root :math:`J P_0^{-1/2}` for a square kernel,
a :class:`~linear_operator.operators.MatmulLinearOperator` :math:`(J_1 P_0^{-1}) J_2^\top` otherwise; function
space: a :class:`~linear_operator.operators.DenseLinearOperator` of the per-group Grams re-weighted by
:math:`\delta^{-1}`. Each distinct input slice of a batch is computed once (:mod:`ntkgp.kernels.batching`).
"""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from linear_operator.operators import (
    DenseLinearOperator,
    LinearOperator,
    LowRankRootLinearOperator,
    MatmulLinearOperator,
)

from ..ntk.inputs import check_structure, num_rows
from ..options import Space, choose_space
from .batching import Slices, distinct_slices, gather, pair_grams

__all__ = ["kernel_diagonal", "kernel_matrix", "structured_kernel_matrix"]

# every ``kernel`` here is an NTKKernel, typed by its GPyTorch base: NTKKernel.forward calls this module


def kernel_matrix(kernel: Kernel, x1: torch.Tensor, x2: torch.Tensor, batch: torch.Size, square: bool) -> LinearOperator:
    """``K(x1, x2)`` of shape ``(*batch, N1·C, N2·C)`` for flat inputs ``(*b, N, D)`` (``square``: ``x1`` equals ``x2``)."""
    n1, n2 = x1.shape[-2], x2.shape[-2]
    c = kernel.num_outputs_per_input(x1, x2)
    ref = kernel.raw_prior_precision
    if n1 == 0 or n2 == 0:
        return DenseLinearOperator(torch.zeros(*batch, n1 * c, n2 * c, dtype=ref.dtype, device=ref.device))
    s1 = distinct_slices(x1)
    s2 = s1 if square else distinct_slices(x2)
    rows = n1 * c if square else min(n1, n2) * c
    if choose_space(kernel.space, kernel.engine.num_params, rows) is Space.WEIGHT:
        j1 = _jacobians(kernel, s1, c)
        if square:
            root = j1 * kernel.column_weights(-0.5).unsqueeze(-2)
            return LowRankRootLinearOperator(root.expand(*batch, *root.shape[-2:]))
        left = j1 * kernel.column_weights(-1.0).unsqueeze(-2)
        right = _jacobians(kernel, s2, c)
        return MatmulLinearOperator(left.expand(*batch, *left.shape[-2:]), right.expand(*batch, *right.shape[-2:]).mT)
    grams, pair_index = pair_grams(
        lambda *xs: kernel.group_grams(*xs), s1, s2, square, c * c * kernel.engine.num_groups
    )
    w = kernel.prior_precision.reciprocal()
    grams = grams.to(w)
    if w.dim() == 1:
        gram = gather(torch.einsum("g,pgij->pij", w, grams), pair_index)
    else:
        gram = torch.einsum("...g,...gij->...ij", w, gather(grams, pair_index))
    return DenseLinearOperator(gram.expand(*batch, n1 * c, n2 * c))


def _jacobians(kernel: Kernel, slices: Slices, c: int) -> torch.Tensor:
    """``J`` of every batch element, ``(*batch, N·C, P)``, kernel dtype (once per distinct slice)."""
    ref = kernel.raw_prior_precision
    u, n = slices.values.shape[:2]
    j = kernel.jacobian(slices.rows).view(u, n * c, -1).to(dtype=ref.dtype, device=ref.device)
    return gather(j, slices.index)


def kernel_diagonal(kernel: Kernel, x1: torch.Tensor, x2: torch.Tensor, square: bool, batch: torch.Size) -> torch.Tensor:
    """``diag K(x1, x2)``, ``(*batch, N·C)``: per-point blocks when square, else chunks of the Gram.

    Raises:
        ValueError: ``x1`` and ``x2`` with different numbers of points.
    """
    n1, n2 = x1.shape[-2], x2.shape[-2]
    if n1 != n2:
        raise ValueError(f"diag=True needs x1 and x2 with the same number of points, got {n1} and {n2}")
    if n1 == 0:  # as the full matrix: an empty result
        ref = kernel.raw_prior_precision
        return torch.zeros(*batch, 0, dtype=ref.dtype, device=ref.device)
    if square:
        blocks = kernel.point_blocks(x1)
        return blocks.diagonal(dim1=-2, dim2=-1).reshape(*blocks.shape[:-3], -1).expand(*batch, -1)
    step = kernel.engine.chunk_size
    parts = [
        kernel.forward(x1[..., s : s + step, :], x2[..., s : s + step, :]).to_dense().diagonal(dim1=-2, dim2=-1)
        for s in range(0, n1, step)
    ]
    return torch.cat(parts, dim=-1).expand(*batch, -1)


def structured_kernel_matrix(kernel: Kernel, x1: dict, x2: dict | None, diag: bool) -> LinearOperator | torch.Tensor:
    r"""``K(x1, x2)`` ``(N1·C, N2·C)`` (or its diagonal ``(N·C,)``) for dict inputs of tensors sharing their leading
    dimension (:mod:`ntkgp.ntk.inputs`, e.g. ``{"ids": ..., "mask": ...}``): the per-group Grams of the engine
    (no cache, no batch dimensions) re-weighted by :math:`\delta^{-1}`, a
    :class:`~linear_operator.operators.DenseLinearOperator` in the kernel's dtype."""
    for name, x in (("x1", x1), ("x2", x2)):
        if x is not None:
            check_structure(x, name)
    w = kernel.prior_precision.reciprocal()
    if kernel.batch_shape:
        raise ValueError("dict inputs take a kernel without batch_shape")
    if diag:
        if x2 is not None and x2 is not x1:
            if num_rows(x1) != num_rows(x2):
                raise ValueError(f"diag=True needs x1 and x2 with the same number of points, got {num_rows(x1)} and "
                                 f"{num_rows(x2)}")
            return torch.einsum("g,gii->i", w, kernel.engine.group_grams(x1, x2).to(w))
        return torch.einsum("g,gncc->nc", w, kernel.engine.diag_blocks(x1).to(w)).reshape(-1)
    grams = kernel.engine.group_grams(x1, None if x2 is x1 else x2).to(w)
    return DenseLinearOperator(torch.einsum("g,gij->ij", w, grams))


def kernel_forward(kernel: Kernel, x1: torch.Tensor, x2: torch.Tensor, diag: bool) -> LinearOperator | torch.Tensor:
    """``NTKKernel.forward``: the kernel matrix (or its diagonal) of checked inputs ``(*batch, N, D)``, broadcast with
    the kernel's ``batch_shape``.

    Raises:
        ValueError: the inputs' batch shapes do not broadcast with the kernel's.
    """
    try:
        batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2], kernel.batch_shape)
    except RuntimeError:
        raise ValueError(
            f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} do not broadcast with the kernel's batch_shape "
            f"{tuple(kernel.batch_shape)}"
        ) from None
    square = kernel.is_square(x1, x2)
    if diag:
        return kernel_diagonal(kernel, x1, x2, square, batch)
    return kernel_matrix(kernel, x1, x2, batch, square)
