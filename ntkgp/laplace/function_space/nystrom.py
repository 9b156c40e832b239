r"""The randomized Nyström preconditioner of the evidence's site matrix, differentiable in its hyperparameters."""

from __future__ import annotations

import torch
from linear_operator.operators import LinearOperator

from .algebra import block_apply

__all__ = ["NystromPreconditioner"]


class NystromPreconditioner(LinearOperator):
    r"""The preconditioner :math:`P(L, \delta) = I + L^\top \hat K(\delta) L` of :math:`B = I + L^\top K L`,
    differentiable in the site factor and the prior precisions.

    :math:`\hat K` is the randomized Nyström approximation of the kernel for a test matrix :math:`\Omega`
    (Frangella, Tropp & Udell 2023): with the sketches :math:`Y_g = K_g \Omega` and a small shift
    :math:`\nu`, :math:`Y = \sum_g \delta_g^{-1} Y_g + \nu\Omega`, :math:`\Omega^\top Y = R R^\top` and
    :math:`\hat K = Y R^{-\top} R^{-1} Y^\top \preceq K + \nu I`, so :math:`P = I + W W^\top` with
    :math:`W = L^\top Y R^{-\top}` (``N·k × r``). With :math:`\Omega = L Q` at the current factor,
    :math:`L^\top \hat K L` is the Nyström approximation of :math:`L^\top K L` for the test matrix
    :math:`Q`. Because :math:`\log|P| = \log|I_r + W^\top W|` and :math:`P`'s bilinear derivative carry the
    graph to :math:`(L, \delta)`, GPyTorch's estimator of :math:`\partial\log|B|` becomes the exact
    :math:`\partial\log|P|` plus a stochastic estimate of :math:`\operatorname{tr}(B^{-1}\partial B) -
    \operatorname{tr}(P^{-1}\partial P)`, small when :math:`P` captures the top of the spectrum (the
    variance reduction of Wenger et al. 2022), in every hyperparameter.

    Args:
        factor: :math:`L`, blocks ``(N, C, k)`` (with its graph).
        prior_precision: :math:`\delta`, ``(G,)`` (with its graph).
        sketches: :math:`Y_g = K_g\Omega`, ``(G, N·C, r)``.
        test_matrix: :math:`\Omega`, ``(N·C, r)``.
        shift: :math:`\nu`, a non-negative scalar.
    """

    def __init__(self, factor, prior_precision, sketches, test_matrix, shift) -> None:
        shift = torch.as_tensor(shift, dtype=sketches.dtype, device=sketches.device)
        super().__init__(factor, prior_precision, sketches, test_matrix, shift)
        self.factor, self.prior_precision = factor, prior_precision
        self.sketches, self.test_matrix, self.shift = sketches, test_matrix, shift
        self._detached: tuple[torch.Tensor, torch.Tensor] | None = None

    def _size(self) -> torch.Size:
        n, _, k = self.factor.shape
        return torch.Size([n * k, n * k])

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def root(self) -> torch.Tensor:
        r""":math:`W` (``N·k × r``) with :math:`P = I + W W^\top`, with its graph to :math:`(L, \delta)`."""
        omega = self.test_matrix
        y = torch.einsum("g,gmr->mr", self.prior_precision.to(omega).reciprocal(), self.sketches)
        y = y + self.shift * omega
        core = omega.mT @ y
        core = (core + core.mT) / 2
        eye = torch.eye(core.shape[-1], dtype=core.dtype, device=core.device)
        scale = core.diagonal().abs().mean().clamp_min(torch.finfo(core.dtype).tiny)
        for attempt in range(4):  # the shifted core is PD in exact arithmetic; round-off may need a nudge
            jitter = 0.0 if attempt == 0 else scale * torch.finfo(core.dtype).eps * 10 ** (2 * attempt)
            chol, info = torch.linalg.cholesky_ex(core + jitter * eye)
            if int(info) == 0:
                break
        else:  # no usable sketch: P = I
            return self.factor.new_zeros(self.shape[-1], 0)
        kroot = torch.linalg.solve_triangular(chol, y.mT, upper=False).mT  # Y R^{-T}: K̂ = kroot krootᵀ
        return block_apply(self.factor.to(kroot), kroot, transpose=True)

    def _woodbury(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._detached is None:
            with torch.no_grad():
                w = self.root()
                inner = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device) + w.mT @ w
                self._detached = (w, torch.linalg.cholesky(inner))
        return self._detached

    def detached_root(self) -> torch.Tensor:
        """:meth:`root` without a graph (computed once)."""
        return self._woodbury()[0]

    def solve_closure(self):
        r"""A function ``v ↦ P⁻¹ v = v − W (I + WᵀW)⁻¹ Wᵀ v`` (detached)."""
        w, chol = self._woodbury()

        def closure(rhs: torch.Tensor) -> torch.Tensor:
            return rhs - w @ torch.cholesky_solve(w.mT @ rhs, chol)

        return closure

    def log_det(self) -> torch.Tensor:
        r""":math:`\log|P| = \log|I_r + W^\top W|`, differentiable in :math:`(L, \delta)`."""
        w = self.root()
        inner = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device) + w.mT @ w
        return torch.linalg.slogdet(inner)[1]

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        w = self.root()
        return rhs + w @ (w.mT @ rhs)
