r"""SFR's posterior in whitened ("SGPR") form: dense linear algebra on :math:`K_{ZZ}`, :math:`B_u`, :math:`\tilde y_u`.

Nothing here knows about networks or kernels: the inputs are the (batched) matrices of the sparse model,
``(nb, K, K)`` for ``nb`` independent systems of size ``K``. See :func:`whitened_factors` and docs/math.md,
"SFR".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import NumericalWarning, cholesky

__all__ = ["InducingFactors", "WhitenedFactors", "Whitening", "inducing_factors", "keeps_every_direction",
           "whitened_factors"]


#: :math:`c_K` and :math:`c_B` of :func:`whitened_factors`' rounding threshold (its docstring)
GRAM_FACTOR = SITE_FACTOR = 10.0


@dataclass
class InducingFactors:
    r"""What :func:`whitened_factors` needs of :math:`K_{ZZ}` alone (reusable for any :math:`B_u`).

    :math:`K_{ZZ}` itself is not kept when it was given as a function (as :class:`~ntkgp.models.sfr.SFR`
    does, from its per-group Grams): only its Cholesky factor is, and :attr:`kzz` recomputes it on the
    rare occasions it is needed (a numerically singular :math:`K_{ZZ}`, the iterated update).

    Attributes:
        gram: returns :math:`K_{ZZ}`, ``(nb, K, K)``.
        k_trace: :math:`\operatorname{tr} K_{ZZ}`, ``(nb,)`` (detached).
        k_diagonal: the diagonal of :math:`K_{ZZ}`, ``(nb, K)`` (detached).
        chol: its Cholesky factor :math:`L_Z`, or ``None`` when that fails.
        inverse_trace: :math:`\operatorname{tr}(K_{ZZ}^{-1})`, filled in lazily by :func:`whitened_factors`.
        inverse_norm: power-iteration estimate of :math:`1/s_{\min}(K_{ZZ})`, filled in lazily.
        gram_eps: the unit roundoff of the features :math:`K_{ZZ}` was computed from, when known (SFR: float64's,
            or the network's where it could not be copied); ``None``: that of its dtype.
    """

    gram: Callable[[], Tensor]
    k_trace: Tensor
    k_diagonal: Tensor
    chol: Tensor | None
    inverse_trace: Tensor | None = None
    inverse_norm: Tensor | None = None
    gram_eps: float | None = None

    @property
    def kzz(self) -> Tensor:
        """:math:`K_{ZZ}`, ``(nb, K, K)`` (recomputed by :attr:`gram` at each access unless given as a tensor)."""
        return self.gram()


def inducing_factors(kzz: Tensor | Callable[[], Tensor]) -> InducingFactors:
    r"""The factors of :math:`K_{ZZ}` alone, ``(nb, K, K)`` (an update of the statistics refactorizes only
    :math:`I + A`).

    Args:
        kzz: :math:`K_{ZZ}`, or a function that computes it: then it is computed once here, factorized and
            released (only :math:`L_Z` is kept), and recomputed only when needed again.
    """
    if callable(kzz):
        gram, matrix = kzz, kzz()
    else:
        gram, matrix = (lambda: kzz), kzz
    chol_z, info = torch.linalg.cholesky_ex(matrix)
    diagonal = matrix.detach().diagonal(dim1=-2, dim2=-1).clone()
    chol = None if info.any() else chol_z
    return InducingFactors(gram=gram, k_trace=diagonal.sum(-1), k_diagonal=diagonal, chol=chol)


class Whitening:
    r"""The whitening :math:`W = L^{-1} U^\top` of :math:`K_{ZZ}` (``U = I`` on the fast path, else the kept
    eigenvectors :math:`U_r` with zero columns for the dropped directions), applied by triangular solves:
    :math:`W` is never formed (:attr:`dense` forms it, for inspection).

    Args:
        chol: :math:`L`, ``(nb, K, K)`` lower triangular.
        basis: :math:`U`, ``(nb, K, K)``, or ``None`` for the identity.
    """

    def __init__(self, chol: Tensor, basis: Tensor | None = None) -> None:
        self.chol = chol
        self.basis = basis

    def apply(self, rhs: Tensor) -> Tensor:
        """:math:`W X` for ``X`` ``(nb, K, k)``."""
        if self.basis is not None:
            rhs = self.basis.mT @ rhs
        return torch.linalg.solve_triangular(self.chol, rhs, upper=False)

    def apply_t(self, rhs: Tensor) -> Tensor:
        r""":math:`W^\top X` for ``X`` ``(nb, K, k)``."""
        out = torch.linalg.solve_triangular(self.chol.mT, rhs, upper=True)
        return out if self.basis is None else self.basis @ out

    def sandwich(self, b: Tensor, overwrite: bool = False) -> Tensor:
        r""":math:`W B W^\top` (symmetrized) for symmetric ``B`` ``(nb, K, K)``: two triangular solves.

        With ``overwrite=True`` (no gradient needed) the result is written into ``b``'s storage and
        symmetrized in place, tile by tile: one temporary of the size of ``B`` instead of three. The numbers
        are the same either way.
        """
        if self.basis is not None:
            b = self.basis.mT @ b @ self.basis
        half = torch.linalg.solve_triangular(self.chol, b, upper=False)  # L⁻¹ B
        if overwrite:
            # L⁻¹ B L⁻ᵀ into B, column-major as torch lays out a fresh result (so the same rounding)
            out = torch.linalg.solve_triangular(self.chol, half.mT, upper=False, out=b.mT)
            del half
            _symmetrize_(out)
            return out
        out = torch.linalg.solve_triangular(self.chol, half.mT, upper=False)  # L⁻¹ B L⁻ᵀ (B symmetric)
        return 0.5 * (out + out.mT)

    @property
    def dense(self) -> Tensor:
        """:math:`W`, formed explicitly (for inspection and tests)."""
        eye = torch.eye(self.chol.shape[-1], dtype=self.chol.dtype, device=self.chol.device)
        return self.apply(eye.expand_as(self.chol))

    def rank(self) -> Tensor:
        """Directions kept per system, ``(nb,)``."""
        size = self.chol.shape[-1]
        if self.basis is None:
            return torch.full(self.chol.shape[:-2], size, dtype=torch.long, device=self.chol.device)
        return (self.basis.detach().abs().sum(-2) > 0).sum(-1)


@dataclass
class WhitenedFactors:
    r"""The result of :func:`whitened_factors`, per system (``nb`` systems of size ``K``).

    Only what prediction and the evidence read is kept: the two triangular factors (:math:`L_Z` inside
    :attr:`whitening`, :math:`R`) and vectors. :math:`K_{ZZ}`, :math:`B_u` and :math:`A` are not (the evidence
    needs only :math:`\operatorname{tr} A`), which is what bounds SFR's memory (docs/scaling.md, "Memory of SFR").

    Attributes:
        y_u: :math:`\tilde y_u`, ``(nb, K)``.
        whitening: :math:`W` (:class:`Whitening`).
        a_diagonal: the diagonal of :math:`A = W B_u W^\top`, ``(nb, K)`` (its sum is
            :math:`\operatorname{tr}(K_{ZZ}^{-1} B_u)`).
        chol: :math:`R`, the Cholesky factor of :math:`I + A`.
        y_white: :math:`R^{-1} W \tilde y_u`, ``(nb, K)``.
        alpha: :math:`(K_{ZZ} + B_u)^{-1} \tilde y_u` (pseudo-inverse in the dropped case), ``(nb, K)``.
        rank: directions kept per system, ``(nb,)``.
    """

    y_u: Tensor
    whitening: Whitening
    a_diagonal: Tensor
    chol: Tensor
    y_white: Tensor
    alpha: Tensor
    rank: Tensor

    def project(self, cross_t: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`V = W K_{Zx}` and :math:`R^{-1} V` for ``cross_t`` :math:`K_{Zx}` ``(nb, K, k)``: two triangular
        solves (``2 K^2 k`` flops)."""
        v = self.whitening.apply(cross_t)
        return v, torch.linalg.solve_triangular(self.chol, v, upper=False)

    @property
    def white(self) -> Tensor:
        """:math:`W`, formed explicitly (for inspection)."""
        return self.whitening.dense

    @property
    def solve(self) -> Tensor:
        r""":math:`R^{-1} W`, formed explicitly (for inspection)."""
        return torch.linalg.solve_triangular(self.chol, self.white, upper=False)


def roundoff(*dtypes: torch.dtype) -> float:
    """The unit roundoff of a quantity computed in the coarsest of ``dtypes`` (e.g. :math:`K_{ZZ}`: the network's
    dtype, where its features are computed, and that of its storage; ``sfr.float()`` of a model keeps float32
    rounding)."""
    return max(torch.finfo(d).eps for d in dtypes)


def whitened_factors(
    kzz: Tensor | None,
    b_u: Tensor,
    y_u: Tensor,
    gram_factor: float = GRAM_FACTOR,
    site_factor: float = SITE_FACTOR,
    inducing: InducingFactors | None = None,
    overwrite_b_u: bool = False,
    eps: float | None = None,
    site_eps: float | None = None,
    cross_eps: float = 0.0,
    cross_factor: float = 1e4,
) -> WhitenedFactors:
    r"""SFR's posterior in whitened ("SGPR") form, batched over systems ``(nb, K, K)``; no jitter in ordinary cases.

    With a whitening :math:`W` of :math:`K_{ZZ}` (:math:`W^\top W = K_{ZZ}^{-1}`, e.g. :math:`W = L_Z^{-1}`),
    :math:`A = W B_u W^\top` and :math:`R R^\top = I + A` (eigenvalues :math:`\ge 1`, so this Cholesky never
    needs jitter), :math:`K_{ZZ} + B_u = W^{-1}(I + A)W^{-\top}` gives

    .. math::
        (K_{ZZ} + B_u)^{-1} = W^\top R^{-\top} R^{-1} W, \qquad
        K_{ZZ}^{-1} - (K_{ZZ} + B_u)^{-1} = W^\top [I - (I + A)^{-1}] W,

        \log\frac{|K_{ZZ} + B_u|}{|K_{ZZ}|} = 2\textstyle\sum_i \log R_{ii}, \qquad
        \operatorname{tr}(K_{ZZ}^{-1} B_u) = \operatorname{tr} A,

    so the mean is :math:`K_{xZ} (R^{-1}W)^\top (R^{-1}W)\tilde y_u` and the covariance
    :math:`K_{xx} - V^\top V + (R^{-1}V)^\top(R^{-1}V)` with :math:`V = W K_{Zx}`. Unlike a Cholesky of
    :math:`K_{ZZ} + B_u` (whose condition number is about that of :math:`K_{ZZ}` times :math:`\|B_u\|/\|K_{ZZ}\|`,
    huge for small noise), nothing here is worse conditioned than :math:`K_{ZZ}` itself.

    **Rank-deficient** :math:`K_{ZZ}` (duplicate inducing inputs; ``M·C > P``; or, commonly, a smooth
    low-dimensional NTK whose Gram is singular to working precision, as in 1-D regression). Rounding in
    :math:`K_{ZZ}` perturbs :math:`Q = K_{xZ}K_{ZZ}^{-1}K_{Zx}` by about :math:`\epsilon\, s_{\max}/s` in a direction of
    :math:`K_{ZZ}` with eigenvalue :math:`s`, and rounding in the stored sum :math:`B_u` perturbs :math:`A` by
    about :math:`\epsilon\operatorname{tr}B_u/s` there. Directions with :math:`s \le \tau`,

    .. math::
        \tau = \max\big(c_K\, \epsilon_K \operatorname{tr}K_{ZZ},\; c_X\, \epsilon_X^2 \operatorname{tr}K_{ZZ},\;
        c_B\, \epsilon_B\operatorname{tr}B_u\big), \qquad c_K = c_B = 10,\ c_X = 10^4,

    (:math:`\epsilon_K` the unit roundoff of :math:`K_{ZZ}`, :math:`\epsilon_B` that of the summed :math:`B_u`;
    :math:`\epsilon_X` that of the cross-covariances :math:`K_{Zx}` when they are rounded coarser than :math:`K_{ZZ}`,
    e.g. products formed in float32 against a float64 :math:`K_{ZZ}` (SFR forms them in float64 and passes 0): an error :math:`\epsilon_X \lVert K\rVert` in
    :math:`K_{Zx}` moves :math:`V = W K_{Zx}` by about :math:`\epsilon_X\sqrt{\operatorname{tr}K_{ZZ}/s}`
    relatively, at most :math:`10^{-2}` above :math:`\tau`) are therefore dropped: :math:`W = \tilde L^{-1}
    U_r^\top` with :math:`U_r` the eigenvectors of :math:`K_{ZZ}` with eigenvalues above :math:`\tau` and
    :math:`\tilde L \tilde L^\top = U_r^\top K_{ZZ} U_r`. This is *exactly* the sparse model whose inducing variables
    are the ``r`` linear functionals :math:`U_r^\top f(Z)` (an inter-domain inducing set): the posterior stays a
    valid DTC posterior and the collapsed evidence stays a lower bound; with duplicate inputs it is exactly the
    model without the duplicates. No jitter is added and no warning is raised: this is an ordinary situation,
    reported by ``rank``; except when the cross-covariances' precision drops directions that :math:`K_{ZZ}` itself
    resolves (a float32 network), or the site term more than half of them (float32 statistics with a small noise):
    the data in those directions are lost, and a ``NumericalWarning`` says so. The constants were set against a stable
    weight-space reference (SVD of the Jacobian features) on trained networks: predictive means within about
    :math:`10^{-4}`, variances within about :math:`3\cdot10^{-3}` and the evidence within :math:`10^{-3}` nats
    (below it). The fast path, a plain Cholesky :math:`W = L_Z^{-1}`, is taken when it succeeds and a
    power-iteration estimate of :math:`\tau/s_{\min}` is :math:`\le 1/2` or :math:`\operatorname{tr}(K_{ZZ}^{-1})\,\tau
    \le 1` (both guarantee :math:`s_{\min} \ge \tau`; the eigendecomposition, ~40 times a Cholesky, is paid only
    when directions may have to be dropped). The basis :math:`U_r` is held fixed under differentiation.

    **Cost.** :math:`W` is applied by triangular solves with :math:`L_Z` (:class:`Whitening`), so :math:`A` costs
    two triangular solves (:math:`2K^3` flops); everything that depends on :math:`K_{ZZ}` alone comes from
    ``inducing`` (:func:`inducing_factors`) when given, so a change of the statistics refactorizes only
    :math:`I + A`.

    **Memory.** With ``overwrite_b_u=True`` and no gradient to track, :math:`A` is formed in the storage of
    ``b_u`` and :math:`I + A` in that of :math:`A`: the factorization needs :math:`2K^2` numbers beyond
    its inputs and keeps only :math:`R` (and :math:`L_Z`); without it, :math:`4K^2` transiently. The
    results are the same.

    Args:
        kzz: :math:`K_{ZZ}`, ``(nb, K, K)``; may be ``None`` when ``inducing`` is given (then
            ``inducing.kzz`` is used, and recomputed only when directions must be dropped).
        b_u: :math:`B_u`, ``(nb, K, K)``.
        y_u: :math:`\tilde y_u`, ``(nb, K)``.
        gram_factor: :math:`c_K`.
        site_factor: :math:`c_B`.
        inducing: :func:`inducing_factors` of ``kzz``, reused (and completed) when given.
        overwrite_b_u: ``b_u`` is a temporary of the caller, which may be overwritten (its content is
            undefined afterwards); ignored when a gradient is tracked.
        eps: :math:`\epsilon_K`, the unit roundoff of the precision in which :math:`K_{ZZ}` was computed (default:
            that of ``b_u``'s dtype; a float32 network's Gram stored in float64 carries float32 rounding).
        site_eps: :math:`\epsilon_B`, the unit roundoff of the sums in :math:`B_u` (default: ``eps``).
        cross_eps: :math:`\epsilon_X`, the unit roundoff of the cross-covariances :math:`K_{Zx}` (the network's
            features), when it exceeds that of :math:`K_{ZZ}` (a float32 network with :math:`K_{ZZ}` in float64);
            0 otherwise.
        cross_factor: :math:`c_X`.

    Returns:
        The :class:`WhitenedFactors`.
    """
    if kzz is None and inducing is None:
        raise ValueError("whitened_factors needs kzz or inducing")
    zz = inducing_factors(kzz) if inducing is None else inducing
    size = b_u.shape[-1]
    eps = torch.finfo(b_u.dtype).eps if eps is None else eps
    site_eps = eps if site_eps is None else site_eps
    b_trace = b_u.detach().diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0)
    gram_threshold = max(gram_factor * eps, cross_factor * cross_eps**2) * zz.k_trace
    site = site_factor * site_eps * b_trace
    threshold = torch.maximum(gram_threshold, site)  # (nb,)
    whitening = Whitening(zz.chol) if keeps_every_direction(zz, threshold) else None
    if whitening is None:
        whitening, values = _truncated_whitening(zz.kzz if kzz is None else kzz, threshold)
        _warn_lost_directions(values, whitening.rank(), gram_factor * eps * zz.k_trace,
                              cross_factor * cross_eps**2 * zz.k_trace, site, site_eps)
    tracked = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (b_u, whitening.chol, whitening.basis)
    )
    in_place = overwrite_b_u and not tracked
    a = whitening.sandwich(b_u, overwrite=in_place)
    a_diagonal = a.diagonal(dim1=-2, dim2=-1).clone()
    if in_place:  # I + A in A's storage: the same numbers as eye + a, without two more K² temporaries
        a.diagonal(dim1=-2, dim2=-1).add_(1)
        chol = cholesky(a, "I + A (whitened SFR system)")
    else:
        chol = cholesky(torch.eye(size, dtype=a.dtype, device=a.device) + a, "I + A (whitened SFR system)")
    del a
    y_white = torch.linalg.solve_triangular(chol, whitening.apply(y_u.unsqueeze(-1)), upper=False)
    alpha = whitening.apply_t(torch.linalg.solve_triangular(chol.mT, y_white, upper=True)).squeeze(-1)
    return WhitenedFactors(
        y_u=y_u, whitening=whitening, a_diagonal=a_diagonal, chol=chol, y_white=y_white.squeeze(-1), alpha=alpha,
        rank=whitening.rank(),
    )


def _symmetrize_(x: Tensor, block: int = 1024) -> Tensor:
    r"""``x ← ½(x + xᵀ)`` in place for square ``x`` ``(..., K, K)``, one pair of ``block × block`` tiles at a
    time (bit for bit the out-of-place ``0.5 * (x + x.mT)``: the sum is commutative)."""
    size = x.shape[-1]
    for i in range(0, size, block):
        rows = slice(i, min(i + block, size))
        tile = x[..., rows, rows]
        tile.copy_(0.5 * (tile + tile.mT))
        for j in range(i + block, size, block):
            cols = slice(j, min(j + block, size))
            pair = 0.5 * (x[..., rows, cols] + x[..., cols, rows].mT)
            x[..., rows, cols] = pair
            x[..., cols, rows] = pair.mT
    return x


def keeps_every_direction(zz: InducingFactors, threshold: Tensor) -> bool:
    r"""Whether every eigenvalue of :math:`K_{ZZ}` is sure to lie above ``threshold`` ``(nb,)``, so that
    :func:`whitened_factors` takes its fast path: a power-iteration estimate of :math:`\tau/s_{\min} \le \frac12`
    or :math:`\operatorname{tr}(K_{ZZ}^{-1})\,\tau \le 1` (either suffices; the power iteration, ``O(K^2)`` per step,
    is tried before the ``O(K^3)`` inverse). Both estimates are kept in ``zz`` once computed; ``False`` without a
    Cholesky factor."""
    if zz.chol is None:
        return False
    if zz.inverse_norm is None:
        zz.inverse_norm = _inverse_norm(Whitening(zz.chol.detach()))
    if bool((zz.inverse_norm * threshold <= 0.5).all()):
        return True
    if zz.inverse_trace is None:  # tr(K_ZZ⁻¹) ≥ 1/s_min
        zz.inverse_trace = torch.cholesky_inverse(zz.chol.detach()).diagonal(dim1=-2, dim2=-1).sum(-1)
    return bool((zz.inverse_trace * threshold <= 1).all())


def _inverse_norm(white: Whitening, iterations: int = 30) -> Tensor:
    r"""Power-iteration estimate of :math:`\|W\|_2^2 = 1/s_{\min}(K_{ZZ})`, ``(nb,)``, from a fixed pseudo-random
    start (products with :math:`W`, :math:`W^\top` by triangular solves); it underestimates (typically by well
    under a factor 2 after 30 iterations), hence the factor 2 margin in the test that uses it."""
    size = white.chol.shape[-1]
    start = torch.randn(size, 1, generator=torch.Generator().manual_seed(0), dtype=white.chol.dtype)
    v = start.to(white.chol.device).expand(*white.chol.shape[:-2], -1, -1)
    for _ in range(iterations):
        v = white.apply_t(white.apply(v))
        v = v / v.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(white.chol.dtype).tiny)
    return white.apply(v).square().sum((-2, -1))


def _truncated_whitening(kzz: Tensor, threshold: Tensor) -> tuple[Whitening, Tensor]:
    """``W`` with rows only for the eigen-directions of ``kzz`` above ``threshold`` (zero rows else), and the
    eigenvalues of ``kzz``."""
    values, vectors = torch.linalg.eigh(kzz.detach())
    keep = values > threshold[:, None]
    basis = vectors * keep.unsqueeze(-2).to(vectors)  # dropped columns zeroed
    reduced = basis.mT @ kzz @ basis + torch.diag_embed((~keep).to(kzz))  # identity in the dropped slots
    reduced = 0.5 * (reduced + reduced.mT)
    chol = cholesky(reduced, "K_ZZ on its leading eigenvectors")
    return Whitening(chol, basis), values


def _warn_lost_directions(
    values: Tensor, kept: Tensor, gram: Tensor, cross: Tensor, site: Tensor, site_eps: float
) -> None:
    """Warn (``NumericalWarning``) where directions that :math:`K_{ZZ}` resolves (eigenvalues ``values`` above
    ``gram``) are dropped for lack of precision elsewhere: the features of the cross-covariances (``cross``, a
    float32 network; any direction the site term ``site`` keeps) or the rounding of the summed sites (more than half
    of them).
    Their data are ignored and the predictive there falls back towards the prior."""
    resolved = (values > gram[:, None]).sum(-1)
    lost_to_features = (values > torch.maximum(gram, site)[:, None]) & (values <= cross[:, None])
    if bool(lost_to_features.any()):
        warnings.warn(
            f"SFR kept {kept.min().item()} of the {resolved.max().item()} inducing directions that K_ZZ resolves: "
            f"{lost_to_features.sum(-1).max().item()} of them have prior variances below what the network's "
            "float32 features resolve in the cross-covariances K_Zx, and their data are ignored (the predictive falls "
            "back towards the prior there). For all of them use a float64 network (net.double() and float64 "
            "inputs), or fewer (or more distinct) inducing points.",
            NumericalWarning,
            stacklevel=3,
        )
    elif bool((2 * kept < resolved).any()):
        warnings.warn(
            f"SFR kept {kept.min().item()} of the {resolved.max().item()} inducing directions that K_ZZ resolves: "
            f"the rounding of the summed site statistics B_u (unit roundoff {site_eps:.1e}; tr B_u ≫ tr K_ZZ, as "
            "with a small noise variance) hides the rest, and their data are ignored (the predictive falls back "
            "towards the prior). Keep the statistics in float64 (SFR's default, also for a float32 network: do not "
            "convert the model with .float()), use a larger noise, or fewer inducing points.",
            NumericalWarning,
            stacklevel=3,
        )
