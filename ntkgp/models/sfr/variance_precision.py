r"""How far the rounding of a float32 network's features can move SFR's predictive variances.

The variance of one column (a test point and output) of :math:`V = W K_{Zx}` is (:mod:`.prediction_terms`)

.. math::
    v = K_{xx} - V^\top V + V^\top (I + A)^{-1} V = K_{xx} - V^\top \big(I - (I + A)^{-1}\big) V,

a difference that cancels where the data pin the function down (a small noise, near-duplicate inputs): the
posterior variance is then far below the prior's :math:`K_{xx}`. SFR forms :math:`K_{Zx}` and :math:`K_{xx}` as
float64 products of the float32 features of ``x`` with float64 features of ``Z``
(:mod:`~ntkgp.models.sfr.system_grams`), so the rounding of a float32 network is a perturbation :math:`\Delta J`
of the test point's Jacobian row alone, the same in both. In weight space the variance is the quadratic form
:math:`v = J\Sigma J^\top` with SFR's posterior covariance :math:`0 \preceq \Sigma \preceq P_0^{-1}`, so to first
order :math:`|\Delta v| = 2|J\Sigma\Delta J^\top| \le 2\sqrt{v}\,\lVert\Sigma^{1/2}\Delta J^\top\rVert`, and with
the row rounded normwise by :math:`\epsilon` in the prior's metric
(:math:`\lVert P_0^{-1/2}\Delta J^\top\rVert \le \epsilon\sqrt{K_{xx}}`):

.. math::
    |\Delta v| \le 2\epsilon\sqrt{v\,K_{xx}} + \epsilon^2 K_{xx} + \epsilon v + 4\epsilon_{64} K_{xx},

the last two terms the final rounding to float32 and the float64 subtraction :math:`K_{xx} - V^\top V`. The
relative error grows like :math:`\sqrt{K_{xx}/v}`, not like :math:`K_{xx}/v` (an entrywise rounding of
:math:`K_{Zx}` would cancel in the difference). Where the bound exceeds :data:`VARIANCE_ERROR_LIMIT` of the
variance at some test point, :func:`check_variance_precision` warns with a ``NumericalWarning`` stating it; it
costs two element-wise passes over the chunk's variances.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ...linalg import NumericalWarning

__all__ = ["VARIANCE_ERROR_LIMIT", "check_variance_precision"]

#: The bound on the relative error of a predictive variance above which SFR warns (two digits).
VARIANCE_ERROR_LIMIT = 1e-2


def check_variance_precision(eps: float, prior_blocks: Tensor, blocks: Tensor) -> None:
    r"""Warn when the bound above exceeds :data:`VARIANCE_ERROR_LIMIT` of a variance in this chunk.

    Args:
        eps: the unit roundoff of the network's features (:math:`\epsilon`).
        prior_blocks, blocks: the prior and posterior ``C×C`` block of each point, ``(b, C, C)``.

    Warns:
        NumericalWarning: when the bound exceeds :data:`VARIANCE_ERROR_LIMIT` of a variance, stating it.
    """
    eps64 = torch.finfo(torch.float64).eps / 2
    with torch.no_grad():
        prior = prior_blocks.detach().diagonal(dim1=-2, dim2=-1).clamp_min(0)  # K_xx, (b, C)
        variance = blocks.detach().diagonal(dim1=-2, dim2=-1).clamp_min(0)
        bound = eps * (2 * (prior * variance).sqrt() + eps * prior + variance) + 4 * eps64 * prior
        ratio = (bound / variance.clamp_min(torch.finfo(variance.dtype).tiny)).max()
    if bool(ratio > VARIANCE_ERROR_LIMIT):
        warnings.warn(
            f"SFR's predictive variances may be off by up to about {float(ratio):.2g} of their value at some test "
            "points: the network's float32 features round the test points' Jacobians, and the variance is far "
            "below the prior's there (a small noise variance, near-duplicate inputs), so their rounding weighs "
            "relatively more. Use a float64 network (net.double() and float64 inputs) for these variances.",
            NumericalWarning,
            stacklevel=4,
        )
