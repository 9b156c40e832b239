"""Small dense linear-algebra helpers shared by the models and evidences."""

from __future__ import annotations

import warnings

import torch


class JitterWarning(UserWarning):
    """A Cholesky factorisation needed jitter on its diagonal."""


def cholesky(a: torch.Tensor, name: str = "matrix", max_tries: int = 6) -> torch.Tensor:
    """Lower Cholesky factor of a symmetric PSD matrix; jitter is added only if the plain factorisation fails.

    Jitter starts at ``1e-8`` (float64) or ``1e-6`` (float32) times the mean diagonal and grows ten-fold per
    try, at most ``max_tries`` times; when used, a :class:`JitterWarning` names the matrix and the value.
    ``a`` itself is never modified.
    """
    factor, info = torch.linalg.cholesky_ex(a)
    if not info.any():
        return factor
    scale = a.diagonal(dim1=-2, dim2=-1).abs().mean().clamp_min(torch.finfo(a.dtype).tiny).detach()
    jitter = (1e-8 if a.dtype == torch.float64 else 1e-6) * scale
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(max_tries):
        factor, info = torch.linalg.cholesky_ex(a + jitter * eye)
        if not info.any():
            warnings.warn(f"{name} was not numerically positive definite: added jitter {jitter.item():.3g} to its diagonal", JitterWarning, stacklevel=2)
            return factor
        jitter = jitter * 10
    raise torch.linalg.LinAlgError(f"Cholesky of {name} failed even with jitter {jitter.item() / 10:.3g}")


def block_sandwich(factor: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``Lᵀ K L`` for a block-diagonal ``L`` given as blocks ``(N, C, k)`` and ``K`` of shape ``(N·C, N·C)``.

    Returns ``(N·k, N·k)`` in interleaved order. Costs ``O((NC)² k)``; the ``(NC, Nk)`` matrix ``L`` is never formed.
    """
    n, c, k = factor.shape
    kl = torch.einsum("nbmc,mcd->nbmd", gram.reshape(n, c, n, c), factor)
    return torch.einsum("nba,nbmd->namd", factor, kl).reshape(n * k, n * k)


def block_apply(factor: torch.Tensor, v: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``L v`` (or ``Lᵀ v``) for block-diagonal ``L`` with blocks ``(N, C, k)`` and ``v`` of shape ``(N·k[, m])``."""
    n, c, k = factor.shape
    tail = v.shape[1:]
    if transpose:
        return torch.einsum("nca,nc...->na...", factor, v.reshape(n, c, *tail)).reshape(n * k, *tail)
    return torch.einsum("nca,na...->nc...", factor, v.reshape(n, k, *tail)).reshape(n * c, *tail)


def site_cholesky(factor: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of ``B = I + Lᵀ K L`` (eigenvalues ≥ 1) for ``L`` as blocks ``(N, C, k)``.

    The matrix of the Laplace evidence (``log|B| = log|I + Λ^{1/2} K Λ^{1/2}|``) and of the site posterior.
    """
    sandwich = block_sandwich(factor, gram)
    eye = torch.eye(sandwich.shape[0], dtype=sandwich.dtype, device=sandwich.device)
    return cholesky(sandwich + eye, "I + Lᵀ K L")
