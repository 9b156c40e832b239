r"""The one log-determinant of the exact Laplace evidence, in either space, with a fused backward pass.

Both exact representations of :math:`\log|H + P_0| - \log|P_0|` (``docs/math.md``, "Laplace-GGN evidence")
are the log-determinant of a matrix of one shape,

.. math::
    B = I + D_r \Bigl(\sum_k c_k M_k\Bigr) D_r, \qquad D_r = \operatorname{diag}(r), \qquad
    \log|B| = 2 \sum_i \log L_{ii}, \quad L L^\top = B,

with fixed positive semi-definite :math:`M_k` computed once per :math:`\theta^*` and the hyperparameters in
the coefficients :math:`c` and the row scales :math:`r > 0`:

- **weight space** (:class:`~ntkgp.laplace.weight_space.FullCurvature`): :math:`M_k = D_k` the GGN / EF
  components (``P × P``), :math:`c = w(s)` their weights in the likelihood's output scale, :math:`r_p =
  \delta_{g(p)}^{-1/2}`, so :math:`B = P_0^{-1/2} (H + P_0) P_0^{-1/2}`;
- **function space** (:class:`~ntkgp.laplace.weight_space.FunctionSpaceCurvature`): :math:`M_g = U_g U_g^\top`
  the per-group Grams of the unit rows (``R × R``), :math:`c_g = 1/\delta_g`, :math:`r_i = \sqrt{w_i(s)}`, so
  :math:`B = I + W^{1/2} U P_0^{-1} U^\top W^{1/2}` (matrix determinant lemma).

The eigenvalues of :math:`B` are at least 1: the factorization cannot fail for finite hyperparameters, and no
result is formed by cancellation. Forward: one Cholesky factorization, :math:`O(R^3/3)`. Backward, from the
same factor: :math:`L^{-1}` (:func:`~ntkgp.linalg.triangular_inverse`, :math:`R^3/6` multiply-adds, as many as
the factorization), then

.. math::
    \frac{\partial \log|B|}{\partial c_k} = \langle B^{-1} \circ r r^\top, M_k\rangle, \qquad
    \frac{\partial \log|B|}{\partial r_i} = \frac{2\,(1 - [B^{-1}]_{ii})}{r_i}

(since :math:`B^{-1}(B - I) = I - B^{-1}`), exact and several times cheaper than differentiating through the
factorization. The row scales need only :math:`\operatorname{diag}(B^{-1})`, the column sums of squares of
:math:`L^{-1}`; so does a single matrix, :math:`c\,\langle B^{-1} \circ r r^\top, M\rangle = R -
\operatorname{tr} B^{-1}` (taken when it is not a difference of nearly equal numbers); several matrices form
:math:`B^{-1}` from the factor (``torch.cholesky_inverse``, LAPACK ``potri``: :math:`2R^3/3` flops, against
:math:`7R^3/3` for :math:`L^{-1}` and the product :math:`L^{-\top} L^{-1}`). Memory: :math:`B`, its factor and (backward) :math:`L^{-1}` and
:math:`B^{-1}`, :math:`4 R^2` numbers besides the :math:`M_k`, which are not copied.
"""

from __future__ import annotations

import torch
from linear_operator.utils.errors import NotPSDError
from torch import Tensor

from ...linalg import triangular_inverse

__all__ = ["diagonal_log_det", "scaled_log_det", "spectral_log_det_ratio"]


class _ScaledLogDet(torch.autograd.Function):
    r""":math:`\log|I + D_r (\sum_k c_k M_k) D_r|` (module docstring), differentiable in ``coefficients`` and
    ``root``; the matrices are fixed data."""

    @staticmethod
    def forward(ctx, coefficients: Tensor, root: Tensor, matrices: Tensor) -> Tensor:
        if root is None:  # D_r = I (a uniform root folded into the coefficients by the caller): one pass
            matrix = (torch.mul(matrices[0], coefficients[0]) if matrices.shape[0] == 1
                      else torch.tensordot(coefficients, matrices, dims=1))
        elif matrices.shape[0] == 1:  # c D_r M D_r in two passes over M
            matrix = torch.mul(matrices[0], (coefficients[0] * root)[:, None]).mul_(root)
        else:
            matrix = torch.tensordot(coefficients, matrices, dims=1).mul_(root[:, None]).mul_(root)
        matrix.diagonal().add_(1)
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) != 0:
            raise NotPSDError(
                f"I + D (Σ c M) D of size {matrix.shape[-1]} is not positive definite (leading minor {int(info)}): "
                "are the hyperparameters finite?"
            )
        ctx.save_for_backward(factor, root, matrices)
        ctx.coefficients = coefficients.detach()
        return 2 * factor.diagonal().log().sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        factor, root, matrices = ctx.saved_tensors
        size = factor.shape[-1]
        several = ctx.needs_input_grad[0] and matrices.shape[0] > 1
        inverse = inverse_factor = None
        if several:  # B⁻¹ from the factor (LAPACK potri: 2R³/3 flops; L⁻¹ and L⁻ᵀ L⁻¹ would be 7R³/3)
            inverse = torch.cholesky_inverse(factor)
            inverse_diagonal = inverse.diagonal()
        else:  # diag B⁻¹ only: the column sums of squares of L⁻¹ (R³/3 flops)
            inverse_factor = triangular_inverse(factor)
            inverse_diagonal = torch.linalg.vector_norm(inverse_factor, dim=0).square()
        grad_root = grad * 2 * (1 - inverse_diagonal) / root if root is not None and ctx.needs_input_grad[1] else None
        grad_coefficients = None
        if ctx.needs_input_grad[0]:
            coefficients = ctx.coefficients
            touched = size - inverse_diagonal.sum()  # ⟨B⁻¹, B − I⟩ = c ⟨B⁻¹ ∘ r rᵀ, M⟩ for one matrix
            if not several and touched > 1e-3 * size:
                grad_coefficients = (grad * touched / coefficients).reshape(1)
            else:  # several matrices (or almost no curvature: no cancellation): the full B⁻¹
                if inverse is None:
                    inverse = inverse_factor.mT @ inverse_factor
                if root is not None:  # B⁻¹ is this pass's own: scaled in place
                    inverse.mul_(root[:, None]).mul_(root[None, :])
                grad_coefficients = grad * torch.tensordot(matrices, inverse, dims=([1, 2], [0, 1]))
        return grad_coefficients, grad_root, None


def scaled_log_det(coefficients: Tensor, root: Tensor | None, matrices: Tensor) -> Tensor:
    r""":math:`\log|I + D_r (\sum_k c_k M_k) D_r|` by one Cholesky factorization (module docstring).

    Args:
        coefficients: :math:`c`, ``(K,)``.
        root: :math:`r > 0`, ``(R,)``, or ``None`` for :math:`D_r = I` (a uniform root is the coefficients'
            business: :math:`c_k r^2`; two passes over the ``R × R`` matrix fewer in each direction).
        matrices: :math:`M_k`, ``(K, R, R)``, symmetric positive semi-definite (fixed: no gradient).

    Returns:
        A scalar tensor, differentiable in ``coefficients`` and ``root``.

    Raises:
        NotPSDError: when the factorization fails (non-finite hyperparameters).
    """
    return _ScaledLogDet.apply(coefficients, root, matrices)


def spectral_log_det_ratio(eigenvalues: Tensor, ratio: Tensor) -> Tensor:
    r""":math:`\sum_i \log(1 + \rho \lambda_i)`: :math:`\log|I + \rho M|` from the eigenvalues of :math:`M`,
    for one matrix and one scalar hyperparameter ratio :math:`\rho` (:math:`c\,r^2`), :math:`O(R)`."""
    return torch.log1p(ratio * eigenvalues).sum()


class _DiagonalLogDet(torch.autograd.Function):
    r""":math:`\sum_p \log t_p`, :math:`t = w^\top U + \delta_{g(\cdot)}`, as one node of the graph: the
    gradients :math:`U t^{-1}` (``(K,)``) and :math:`\sum_{p \in g} t_p^{-1}` (``(G,)``) from the saved
    :math:`t^{-1}`."""

    @staticmethod
    def forward(ctx, weights: Tensor, delta: Tensor, components: Tensor, groups: Tensor) -> Tensor:
        terms = delta[groups]
        if components.shape[0] > 1:
            terms = terms.addmv_(components.mT, weights)
        else:
            terms = terms.add_(components[0] * weights)
        ctx.save_for_backward(components, terms.reciprocal(), groups)
        ctx.num_groups = delta.shape[0]
        return terms.log().sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        components, reciprocal, groups = ctx.saved_tensors
        grad_weights = grad * (components @ reciprocal) if ctx.needs_input_grad[0] else None
        grad_delta = None
        if ctx.needs_input_grad[1]:
            grad_delta = grad * reciprocal.new_zeros(ctx.num_groups).index_add_(0, groups, reciprocal)
        return grad_weights, grad_delta, None, None


def diagonal_log_det(weights: Tensor, delta: Tensor, components: Tensor, groups: Tensor) -> Tensor:
    r""":math:`\log|\operatorname{diag}(w^\top U) + P_0| = \sum_p \log(\sum_k w_k U_{kp} + \delta_{g(p)})`: the
    diagonal curvatures, and KFAC with one output-scale component on its eigenvalues. :math:`O(KP)` forward
    and backward, one node of the graph (the steps of these structures cost little else).

    Args:
        weights: :math:`w \ge 0`, ``(K,)``, differentiable.
        delta: :math:`\delta > 0`, ``(G,)``, differentiable.
        components: :math:`U \ge 0`, ``(K, P)`` (fixed: no gradient).
        groups: :math:`g(p)`, ``(P,)`` long.

    Returns:
        A scalar tensor (first-order differentiable).
    """
    return _DiagonalLogDet.apply(weights, delta, components, groups)
