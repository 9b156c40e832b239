r"""Dense and low-rank algebra of the Laplace approximation with block-diagonal site factors.

The per-point curvature in output space is :math:`\Lambda_n = L_n L_n^\top` with :math:`L_n` of shape
``(C, k)`` (``k = C`` for the GGN, ``k = 1`` for the empirical Fisher), stacked as blocks ``(N, C, k)``.
The block-diagonal :math:`L` (``(N·C, N·k)``) is never formed. Every factorisation goes through
:func:`ntkgp.linalg.cholesky` (linear_operator's ``psd_safe_cholesky`` with a diagonal-scaled jitter).
Rows are in GPyTorch's interleaved order (row ``n·C + c``).
"""

from __future__ import annotations

import torch
from linear_operator.operators import LinearOperator

from ...linalg import block_sandwich, cholesky, gram

__all__ = ["as_columns", "block_apply", "block_sandwich", "low_rank_log_det", "site_cholesky"]


def as_columns(rhs: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``rhs`` as a matrix of columns, and whether it was a vector (``(n,)`` → ``(n, 1)``)."""
    return (rhs.unsqueeze(-1), True) if rhs.dim() == 1 else (rhs, False)


def block_apply(factor: torch.Tensor, v: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``L v`` (or ``Lᵀ v``) for block-diagonal ``L`` with blocks ``(N, C, k)`` and ``v`` of shape ``(N·k[, m])``
    (``(N·C[, m])`` with ``transpose=True``)."""
    n, c, k = factor.shape
    tail = v.shape[1:]
    if len(tail) == 1:  # columns: one batched product of the blocks (an einsum takes about twice as long)
        if transpose:
            return torch.matmul(factor.mT, v.reshape(n, c, tail[0])).reshape(n * k, tail[0])
        return torch.matmul(factor, v.reshape(n, k, tail[0])).reshape(n * c, tail[0])
    if transpose:
        return torch.einsum("nca,nc...->na...", factor, v.reshape(n, c, *tail)).reshape(n * k, *tail)
    return torch.einsum("nca,na...->nc...", factor, v.reshape(n, k, *tail)).reshape(n * c, *tail)


def site_cholesky(factor: torch.Tensor, gram: torch.Tensor | LinearOperator) -> torch.Tensor:
    r"""Lower Cholesky factor of :math:`B = I + L^\top K L` (eigenvalues :math:`\ge 1`), ``(N·k, N·k)``.

    The matrix of the Laplace evidence (:math:`\log|B| = \log|I + \Lambda^{1/2} K \Lambda^{1/2}|`) and of
    the site posterior (docs/math.md, "GLM predictive").
    """
    gram = gram.to_dense() if isinstance(gram, LinearOperator) else gram
    sandwich = block_sandwich(factor, gram)
    eye = torch.eye(sandwich.shape[0], dtype=sandwich.dtype, device=sandwich.device)
    return cholesky(sandwich + eye, "I + Lᵀ K L")


def low_rank_log_det(factor: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    r""":math:`\log|I_{Nk} + L^\top R R^\top L| = \log|I_r + W^\top W|`, :math:`W = L^\top R`, for ``K = R Rᵀ``.

    The weight-space route of the evidence (Sylvester's determinant identity): with the root
    :math:`R = J P_0^{-1/2}` (``(N·C, P)``), :math:`I_P + W^\top W = P_0^{-1/2} H P_0^{-1/2}` and the result is
    :math:`\log|H| - \log|P_0|`. Costs :math:`O(N k P^2 + P^3)` instead of :math:`O((Nk)^3)`.
    """
    w = block_apply(factor, root, transpose=True)  # (N·k, r)
    inner = gram(w)
    inner = inner + torch.eye(inner.shape[0], dtype=inner.dtype, device=inner.device)
    return 2 * cholesky(inner, "I + Wᵀ W (the whitened posterior precision)").diagonal().log().sum()
