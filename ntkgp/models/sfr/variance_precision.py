r"""How far the rounding of a float32 network's features can move SFR's predictive variances.

The variance of one column (a test point and output) of :math:`V = W K_{Zx}` is (:mod:`.prediction_terms`)

.. math::
    v = K_{xx} - V^\top V + V^\top (I + A)^{-1} V = K_{xx} - V^\top \big(I - (I + A)^{-1}\big) V,

a difference that cancels where the data pin the function down (a small noise, near-duplicate inputs): the
posterior variance is then far below the prior's :math:`K_{xx}`. The bound below treats each entry of
:math:`K_{Zx}` as rounded by up to :math:`\epsilon\sqrt{K_{xx}[K_{ZZ}]_{kk}}` and :math:`K_{xx}` by
:math:`\epsilon K_{xx}`, independently: an upper estimate. SFR forms them as float64 products of the float32
features of ``x`` with float64 features of ``Z`` (:mod:`~ntkgp.models.sfr.system_grams`), whose rounding is a
perturbation of the Jacobian row alone, the same in :math:`K_{Zx}` and :math:`K_{xx}`, so the actual error is far
below the bound (near-duplicate inputs, :math:`\sigma^2 = 10^{-3}`: 1e-5 of the variance where it says 0.16).
To first order, with the gradient
:math:`\partial v / \partial K_{Zx} = -2\,W^\top\big(V - R^{-\top}R^{-1}V\big)` (:math:`R R^\top = I + A`),

.. math::
    |\Delta v| \le \epsilon \Big(K_{xx} + 2\sqrt{K_{xx}}\sum_k
    \big|[W^\top(V - R^{-\top}R^{-1}V)]_k\big|\,\sqrt{[K_{ZZ}]_{kk}}\Big),

two more triangular solves per chunk (as many as :math:`V` and :math:`R^{-1}V` cost). Where this exceeds
:data:`VARIANCE_ERROR_LIMIT` of the variance at some test point, :func:`check_variance_precision` warns with a
``NumericalWarning`` stating the bound.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ...linalg import NumericalWarning
from ...options import OutputCoupling
from .whitening import WhitenedFactors

__all__ = ["VARIANCE_ERROR_LIMIT", "check_variance_precision"]

#: The bound on the relative error of a predictive variance above which SFR warns (two digits).
VARIANCE_ERROR_LIMIT = 1e-2


def check_variance_precision(
    rounding: tuple[float, Tensor], factors: WhitenedFactors, low_z: Tensor, low_s: Tensor, prior_blocks: Tensor,
    blocks: Tensor, coupling: OutputCoupling,
) -> None:
    r"""Warn when the bound above exceeds :data:`VARIANCE_ERROR_LIMIT` of a variance in this chunk.

    Args:
        rounding: :math:`\epsilon` of the features and :math:`\sqrt{[K_{ZZ}]_{kk}}` per system, ``(nb, K)``
            (:attr:`~ntkgp.models.sfr.prediction_terms.PosteriorState.cross_rounding`).
        factors: the whitened factors (:math:`W`, :math:`R`).
        low_z, low_s: :math:`V` and :math:`R^{-1}V`, ``(nb, K, R)``.
        prior_blocks, blocks: the prior and posterior ``C×C`` block of each point, ``(b, C, C)``.
        coupling: the output coupling (the column order of ``low_z``: point-major joint, one system per output
            independent).

    Warns:
        NumericalWarning: when the bound exceeds :data:`VARIANCE_ERROR_LIMIT` of a variance, stating it.
    """
    eps, k_root = rounding
    with torch.no_grad():
        back = torch.linalg.solve_triangular(factors.chol.mT, low_s.detach(), upper=True)
        gradient = factors.whitening.apply_t(low_z.detach() - back)  # ∂v/∂K_Zx up to the factor −2, (nb, K, R)
        prior = prior_blocks.detach().diagonal(dim1=-2, dim2=-1).clamp_min(0)  # K_xx, (b, C)
        variance = blocks.detach().diagonal(dim1=-2, dim2=-1)
        joint = coupling is OutputCoupling.JOINT or low_z.shape[0] == 1
        prior, variance = (prior.reshape(1, -1), variance.reshape(1, -1)) if joint else (prior.T, variance.T)
        crossed = (gradient.abs() * k_root.unsqueeze(-1)).sum(-2)  # (nb, R)
        bound = eps * (prior + 2 * prior.sqrt() * crossed)
        ratio = (bound / variance.clamp_min(torch.finfo(variance.dtype).tiny)).max()
    if bool(ratio > VARIANCE_ERROR_LIMIT):
        warnings.warn(
            f"SFR's predictive variances may be off by up to about {float(ratio):.2g} of their value at some test "
            "points: the network's float32 features round the cross-covariances K_xZ and K_xx, and the variance "
            "K_xx − VᵀV + ‖R⁻¹V‖² cancels them down to a posterior variance far below the prior's (a small noise "
            "variance, near-duplicate inputs). Use a float64 network (net.double() and float64 inputs) for these "
            "variances.",
            NumericalWarning,
            stacklevel=4,
        )
