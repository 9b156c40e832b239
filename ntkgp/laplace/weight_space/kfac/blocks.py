r"""One layer's Kronecker block :math:`H_l \approx G_l \otimes A_l` of KFAC
(:mod:`~ntkgp.laplace.weight_space.kfac.curvature`): its two factors, their eigendecompositions (computed once, at
the first use that needs them: linear_operator's, in double precision, rounding-negative eigenvalues chopped at 0),
the block as a linear_operator ``KroneckerProductLinearOperator`` and its exact log-determinant with the prior,
:math:`\log|G \otimes A + \delta I| = \sum_{ij} \log(w_j q_i + \delta)` (no damping). Memory: the factors,
:math:`d_a^2 + K d_{out}^2` numbers, and their eigenvectors once decomposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from linear_operator import settings
from linear_operator.operators import (
    DenseLinearOperator,
    KroneckerProductLinearOperator,
)
from torch import Tensor

__all__ = ["KroneckerFactor", "KroneckerFactors", "symmetric_eigh"]


def symmetric_eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """The eigenvalues (negative rounding chopped at 0) and eigenvectors of a symmetric ``matrix``, as
    linear_operator computes them (``_symeig``: in its symeig dtype, double by default, then back to
    ``matrix``'s dtype), without its operators' bookkeeping."""
    dtype, work = matrix.dtype, settings._linalg_dtype_symeig.value()
    if dtype == work:
        evals, evecs = torch.linalg.eigh(matrix)
        return evals.clamp_min(0.0), evecs
    evals, evecs = torch.linalg.eigh(matrix.to(dtype=work))
    return evals.clamp_min(0.0).to(dtype=dtype), evecs.to(dtype=dtype)


class KroneckerFactor(DenseLinearOperator):
    """A symmetric positive semi-definite Kronecker factor whose eigendecomposition is computed once.

    linear_operator's ``KroneckerProductLinearOperator`` asks each factor for its eigendecomposition
    whenever a log-determinant is evaluated; this factor keeps linear_operator's own (double precision,
    negative rounding eigenvalues chopped at 0) after the first request, so re-evaluations for new prior
    precisions or likelihood hyperparameters cost :math:`O(d_{out} d_a)` per block. ``decomposition``: that
    of :func:`symmetric_eigh`, when already computed.
    """

    def __init__(self, matrix: Tensor, decomposition: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__(matrix)
        if decomposition is not None:
            self.__dict__["_ntkgp_symeig"] = (decomposition[0], DenseLinearOperator(decomposition[1]))

    def _symeig(self, eigenvectors: bool = False, return_evals_as_lazy: bool | None = False):
        cached = self.__dict__.get("_ntkgp_symeig")
        if cached is None:
            evals, evecs = symmetric_eigh(self.to_dense())
            cached = (evals, DenseLinearOperator(evecs))
            self.__dict__["_ntkgp_symeig"] = cached
        return cached[0], cached[1] if eigenvectors else None


@dataclass
class KroneckerFactors:
    r"""The Kronecker block :math:`G \otimes A` of one layer.

    Attributes:
        module: the module's name in ``net.named_modules()``.
        weight: the weight's parameter name; ``bias`` the bias's, or ``None`` when it is absent or frozen.
        group: the prior group of the block.
        input_factor: :math:`A = \sum_n \sum_t \bar a_{nt} \bar a_{nt}^\top`, shape ``(d_a, d_a)`` with
            :math:`d_a` = fan-in (+1 with a bias).
        output_factors: the components :math:`G_k`, shape ``(K, d_out, d_out)``.
        input_eigenvalues: eigenvalues of :math:`A`, ``(d_a,)``; ``None`` until :meth:`decompose` (at the first
            use, :meth:`eigenvalues`).
        output_eigenvalues: eigenvalues of :math:`\sum_k G_k`, ``(d_out,)``; likewise.
        input_eigenvectors, output_eigenvectors: their eigenvectors (columns), computed with them.
    """

    module: str
    weight: str
    bias: str | None
    group: int
    input_factor: Tensor
    output_factors: Tensor
    input_eigenvalues: Tensor | None = None
    output_eigenvalues: Tensor | None = None
    input_eigenvectors: Tensor | None = field(default=None, repr=False)
    output_eigenvectors: Tensor | None = field(default=None, repr=False)
    _operators: tuple[KroneckerFactor, KroneckerFactor] | None = field(default=None, repr=False)

    def decompose(self) -> None:
        r"""Eigendecompositions of :math:`A` and :math:`\sum_k G_k` (linear_operator's, clamped at 0:
        :func:`symmetric_eigh`), once: the first call computes them, later ones return at once (the factors are
        fixed)."""
        if self.input_eigenvalues is not None:
            return
        q, u_a = symmetric_eigh(self.input_factor)
        w, u_g = symmetric_eigh(self.output_factors.sum(dim=0))
        self.input_eigenvectors, self.output_eigenvectors = u_a, u_g
        self.input_eigenvalues, self.output_eigenvalues = q, w

    @property
    def input_operator(self) -> KroneckerFactor:
        r""":math:`A` as a :class:`KroneckerFactor` holding its decomposition (:meth:`decompose`)."""
        return self._factor_operators()[0]

    @property
    def output_operator(self) -> KroneckerFactor:
        r""":math:`\sum_k G_k` as a :class:`KroneckerFactor` holding its decomposition (:meth:`decompose`)."""
        return self._factor_operators()[1]

    def _factor_operators(self) -> tuple[KroneckerFactor, KroneckerFactor]:
        if self._operators is None:  # formed at the first request only: the evidence needs the eigenvalues only
            self.decompose()
            self._operators = (
                KroneckerFactor(self.input_factor, (self.input_eigenvalues, self.input_eigenvectors)),
                KroneckerFactor(self.output_factors.sum(dim=0), (self.output_eigenvalues, self.output_eigenvectors)),
            )
        return self._operators

    def eigenvalues(self) -> tuple[Tensor, Tensor]:
        r"""The eigenvalues of :math:`A` and of :math:`\sum_k G_k` (:meth:`decompose`, at the first call)."""
        self.decompose()
        return self.input_eigenvalues, self.output_eigenvalues

    def eigenbases(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        r"""The eigenvalues (clamped at 0) and eigenvectors of :math:`A` and, with one output-scale component, of
        :math:`G`: the decompositions of :meth:`decompose` (computed once, in double precision), not a second
        ``eigh`` of each factor (for a 3,137-wide input factor that second decomposition was most of a CNN
        posterior's construction)."""
        self.decompose()
        if self.output_factors.shape[0] != 1:
            return self.input_eigenvalues, self.input_eigenvectors, None, None
        return self.input_eigenvalues, self.input_eigenvectors, self.output_eigenvalues, self.output_eigenvectors

    def output_factor(self, scale: Tensor) -> Tensor:
        r""":math:`G = \sum_k s_k G_k`, ``(d_out, d_out)``."""
        return torch.einsum("k,kij->ij", scale, self.output_factors)

    def operator(self, scale: Tensor) -> KroneckerProductLinearOperator:
        r"""The block :math:`H_l = G \otimes A` as a ``KroneckerProductLinearOperator`` (row-major order of
        :math:`\operatorname{vec}([W \mid b])`)."""
        if scale.shape[0] == 1:
            return KroneckerProductLinearOperator(self.output_operator * scale.reshape(()), self.input_operator)
        return KroneckerProductLinearOperator(KroneckerFactor(self.output_factor(scale)), self.input_operator)

    def log_det(self, scale: Tensor, delta: Tensor) -> Tensor:
        r""":math:`\log|G \otimes A + \delta I| = \sum_{ij} \log(w_j q_i + \delta)` from the eigenvalues of the
        factors (exact, no damping), :math:`O(d_{out} d_a)`; differentiable in :math:`s` and :math:`\delta`. With
        one component :math:`w = s\,\tilde w` from the eigenvalues computed once; with several (per-output
        Gaussian noise) the eigenvalues of :math:`\sum_k s_k G_k`, :math:`O(d_{out}^3)`."""
        q, w = self.eigenvalues()
        if scale.shape[0] == 1:
            w = scale.reshape(()) * w
        else:
            w = torch.linalg.eigvalsh(self.output_factor(scale)).clamp_min(0)
        return torch.log(w[:, None] * q[None, :] + delta).sum()
