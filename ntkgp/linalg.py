"""The one Cholesky factorisation of ntkgp: linear_operator's ``psd_safe_cholesky`` with a scaled jitter.

ntkgp factorises matrices whose scale is set by the data and the hyperparameters (a Gram weighted by
:math:`1/\\delta`, :math:`I + L^\\top K L`, a posterior precision). An absolute jitter (GPyTorch's default
``1e-8`` in float64) is meaningless for a matrix whose diagonal is :math:`10^{6}`, so the jitter passed to
:func:`linear_operator.utils.cholesky.psd_safe_cholesky` is scaled by the mean diagonal. Everything else is
GPyTorch's policy: no jitter when the plain factorisation succeeds, at most
``linear_operator.settings.cholesky_max_tries`` tenfold increases, a
:class:`~linear_operator.utils.warnings.NumericalWarning` each time jitter is added, and
:class:`~linear_operator.utils.errors.NotPSDError` when even the largest jitter fails.

:func:`gram` forms :math:`A^\top A` from the blocks on and below its diagonal (about half the arithmetic of
``a.mT @ a``). This module is a bottom utility (it imports nothing from ntkgp). The block-diagonal algebra of the Laplace
approximation lives in :mod:`ntkgp.laplace.function_space.algebra`.
"""

from __future__ import annotations

import math
import warnings

import torch
from linear_operator import settings
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.errors import NotPSDError
from linear_operator.utils.warnings import NumericalWarning

__all__ = [
    "JitterWarning", "NotPSDError", "NumericalWarning", "add_lower_gram_", "all_finite", "block_sandwich", "cholesky",
    "gram", "mirror_lower", "relative_jitter", "triangular_inverse",
]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of ``t`` is finite. A sum with a NaN or infinite term is NaN or infinite whatever the
    order of the additions, so a finite sum proves every entry finite (one reduction, no boolean temporary);
    only a sum that overflows or holds a non-finite entry is followed by the entry-wise check."""
    if t.is_floating_point() and t.numel() > 0 and math.isfinite(t.sum().item()):
        return True
    return bool(torch.isfinite(t).all())


def block_sandwich(blocks: torch.Tensor, matrix: torch.Tensor, symmetric: bool = False) -> torch.Tensor:
    """``Lᵀ A L`` for the block-diagonal ``L`` of the blocks ``(N, C, k)`` and ``A`` ``(..., N·C, N·C)``:
    ``(..., N·k, N·k)``, rows in interleaved order (``n·k + a``); ``L`` (``N·C × N·k``) is never formed.

    Both products are left products by ``Lᵀ``, one batch of ``k × C`` blocks against whole rows (a matrix
    product), ``Lᵀ A L = (Lᵀ (Lᵀ A)ᵀ)ᵀ``; an einsum over the block indices is two to three times slower.
    ``O((NC)² k)``, for any ``A``. ``symmetric=True`` (``A`` a Gram or another symmetric matrix) returns
    ``Lᵀ (Lᵀ A)ᵀ = Lᵀ Aᵀ L`` itself, contiguous: the same matrix up to the rounding in which ``A`` and ``Aᵀ``
    differ, without the final transpose."""
    n, c, k = blocks.shape
    lead = matrix.shape[:-2]
    left = blocks.transpose(1, 2)  # (N, k, C)
    once = torch.matmul(left, matrix.reshape(*lead, n, c, n * c)).reshape(*lead, n * k, n * c)  # Lᵀ A
    twice = torch.matmul(left, once.transpose(-1, -2).reshape(*lead, n, c, n * k))  # Lᵀ (Lᵀ A)ᵀ
    twice = twice.reshape(*lead, n * k, n * k)
    return twice if symmetric else twice.transpose(-1, -2)


#: Deprecated name: ntkgp warns with GPyTorch's :class:`~linear_operator.utils.warnings.NumericalWarning`
#: (this is the same class, so ``warnings.simplefilter("error", JitterWarning)`` keeps working).
JitterWarning = NumericalWarning


def relative_jitter(dtype: torch.dtype) -> float:
    """The first jitter relative to the mean diagonal: GPyTorch's ``cholesky_jitter`` for ``dtype``."""
    return float(settings.cholesky_jitter.value(dtype))


def cholesky(a: torch.Tensor, name: str = "matrix", max_tries: int | None = None) -> torch.Tensor:
    r"""Lower Cholesky factor of a symmetric positive (semi-)definite matrix ``a`` (``(..., n, n)``).

    The plain factorisation is tried first; only if it fails,
    :func:`~linear_operator.utils.cholesky.psd_safe_cholesky` is called with the jitter

    .. math::
        \epsilon = \epsilon_0 \cdot \overline{|\operatorname{diag} a|}, \qquad
        \epsilon_0 = 10^{-8}\ (\text{float64}),\ 10^{-6}\ (\text{float32}),

    growing tenfold per try, at most ``max_tries`` (default ``linear_operator.settings.cholesky_max_tries``,
    3) times. A jitter that was needed is reported by one
    :class:`~linear_operator.utils.warnings.NumericalWarning` naming the matrix. ``a`` is never modified;
    gradients flow through the factor.

    Args:
        a: the matrix (or a batch of matrices).
        name: how the matrix is named in warnings and errors.
        max_tries: number of jitter increases before giving up.

    Returns:
        The lower-triangular factor ``R`` with ``R Rᵀ = a`` (+ jitter).

    Raises:
        NotPSDError: when the factorisation fails even with the largest jitter, or ``a`` contains NaN.
    """
    factor, info = torch.linalg.cholesky_ex(a)
    if not info.any():
        return factor
    if torch.isnan(a).any():
        raise NotPSDError(f"Cholesky of {name} failed: it contains NaN")
    scale = a.detach().diagonal(dim1=-2, dim2=-1).abs().mean().clamp_min(torch.finfo(a.dtype).tiny).item()
    jitter = relative_jitter(a.dtype) * scale
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NumericalWarning)
        try:
            factor = psd_safe_cholesky(a, jitter=jitter, max_tries=max_tries)
        except NotPSDError as error:
            raise NotPSDError(f"Cholesky of {name} failed: {error}") from None
    jittered = [w for w in caught if issubclass(w.category, NumericalWarning)]
    if jittered:  # one warning, with the jitter that worked
        warnings.warn(f"{name} was not numerically positive definite: {jittered[-1].message}", NumericalWarning, stacklevel=2)
    for w in caught:
        if not issubclass(w.category, NumericalWarning):  # pragma: no cover - anything else passes unchanged
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return factor



#: Column block of :func:`gram`: wide enough for efficient matrix products, narrow enough that the products above
#: the diagonal it skips are most of them (``p = 2410``: 10 blocks, 55 % of the products of ``a.mT @ a``).
GRAM_BLOCK = 256


def gram(a: torch.Tensor) -> torch.Tensor:
    r""":math:`A^\top A` for ``a`` of shape ``(..., n, p)``, shape ``(..., p, p)``, exactly symmetric.

    The row panels :math:`A_i^\top [A_1 \dots A_i]` of the column blocks :math:`A_i` (:data:`GRAM_BLOCK` wide)
    are computed, the lower triangle kept and mirrored: :math:`n p^2 (m + 1)/m` multiply-adds for :math:`m`
    blocks, against :math:`2 n p^2` for ``a.mT @ a`` (what a symmetric rank-k update, which PyTorch does not
    expose, would save). Extra memory: one ``(p, p)`` result and one panel.
    """
    p = a.shape[-1]
    if p <= 2 * GRAM_BLOCK:
        return a.mT @ a
    out = a.new_zeros(*a.shape[:-2], p, p)
    add_lower_gram_(out, a)
    return mirror_lower(out)


def add_lower_gram_(out: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    r"""Add the lower triangle of :math:`A^\top A` (``a`` ``(..., n, p)``) to ``out`` ``(..., p, p)`` in place,
    by the row panels of :func:`gram` (entries above the diagonal are left in an unspecified state): sums over
    chunks of rows with one :func:`mirror_lower` at the end, and no ``(p, p)`` temporary per chunk."""
    p = a.shape[-1]
    flat_out, flat_a = out.view(-1, p, p), a.reshape(-1, *a.shape[-2:])  # out: contiguous, written through
    for start in range(0, p, GRAM_BLOCK):
        stop = min(start + GRAM_BLOCK, p)
        panel = flat_out[:, start:stop, :stop]
        panel.baddbmm_(flat_a[:, :, start:stop].mT, flat_a[:, :, :stop])
    return out


def mirror_lower(out: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose lower triangle is that of ``out`` ``(..., p, p)``."""
    lower = out.tril()
    return lower + lower.tril(-1).mT


TRIANGULAR_BLOCK = 64


def triangular_inverse(factor: torch.Tensor) -> torch.Tensor:
    r""":math:`L^{-1}` of a lower-triangular ``factor`` ``(..., n, n)`` (its upper triangle is not read),
    lower triangular, in about :math:`n^3/6` multiply-adds: the triangular inverse of LAPACK's ``trtri``, which
    PyTorch does not expose (a triangular solve against the whole of :math:`I` does three times the arithmetic).

    By column panels of width :math:`b` (``n // 8``, at least :data:`TRIANGULAR_BLOCK`): the columns
    :math:`j \dots j + b` of :math:`L^{-1}` are zero above row :math:`j`, and below it they solve
    :math:`L_{j:, j:} X = [I_b; 0]`, one triangular solve of :math:`(n - j)^2 b / 2` multiply-adds. Extra memory:
    the result and one panel.
    """
    n = factor.shape[-1]
    width = max(TRIANGULAR_BLOCK, n // 8)
    out = torch.zeros_like(factor)
    for start in range(0, n, width):
        stop = min(start + width, n)
        panel = factor.new_zeros(*factor.shape[:-2], n - start, stop - start)
        panel.diagonal(dim1=-2, dim2=-1).fill_(1)
        out[..., start:, start:stop] = torch.linalg.solve_triangular(factor[..., start:, start:], panel, upper=False)
    return out
