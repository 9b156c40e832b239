r"""SFR's collapsed (Titsias / DTC) evidence lower bound, from the statistics alone.

.. math::
    \mathcal L = c_0 + \tfrac12 \tilde y_u^\top (K_{ZZ} + B_u)^{-1} \tilde y_u
    - \tfrac12 \log\frac{|K_{ZZ} + B_u|}{|K_{ZZ}|}
    - \tfrac12 \textstyle\sum_n \operatorname{tr}(\Lambda_n K_{nn}) + \tfrac12 \operatorname{tr}(K_{ZZ}^{-1} B_u),

computed in whitened form: :math:`\tfrac12\lVert R^{-1}W\tilde y_u\rVert^2 - \sum_i \log R_{ii}
- \tfrac12\sum_n\operatorname{tr}(\Lambda_n K_{nn}) + \tfrac12\operatorname{tr}A`, with :math:`c_0` =
:meth:`~ntkgp.models.sfr.statistics.DualStatistics.data_fit` (docs/sfr.md, "Sparse evidence").
"""

from __future__ import annotations

from gpytorch.likelihoods import Likelihood
from torch import Tensor

from .prediction_terms import PosteriorState
from .statistics import DualStatistics

__all__ = ["collapsed_bound"]


def collapsed_bound(state: PosteriorState, statistics: DualStatistics, likelihood: Likelihood) -> Tensor:
    """The bound :math:`\\mathcal L` (a scalar, differentiable through ``state`` and the likelihood)."""
    fac = state.factors
    log_det = 2 * fac.chol.diagonal(dim1=-2, dim2=-1).log().sum()  # log|I + A| = log(|K_ZZ + B_u| / |K_ZZ|)
    nystrom_trace = fac.a_diagonal.sum()  # tr(A) = tr(K_ZZ⁻¹ B_u)
    return (
        statistics.data_fit(likelihood, state.slots)
        + 0.5 * fac.y_white.square().sum()
        - 0.5 * log_det
        - 0.5 * statistics.trace_term(state.weights, state.slots)
        + 0.5 * nystrom_trace
    )
