r"""The collapsed sparse evidence of an SFR model, as a GPyTorch marginal log likelihood."""

from __future__ import annotations

from gpytorch.likelihoods import Likelihood
from gpytorch.mlls import MarginalLogLikelihood
from torch import Tensor

from ..models.sfr import SFR


class SparseLaplaceEvidence(MarginalLogLikelihood):
    r"""Titsias / DTC collapsed bound with SFR's Gaussian sites, divided by :math:`N`.

    .. math::
        \frac1N \Big[ c_0 + \tfrac12 \tilde y_u^\top (K_{ZZ} + B_u)^{-1} \tilde y_u
        - \tfrac12 \log\frac{|K_{ZZ} + B_u|}{|K_{ZZ}|}
        - \tfrac12 \sum_n \operatorname{tr}(\Lambda_n (K_{nn} - Q_{nn})) \Big],
        \qquad Q = K_{XZ} K_{ZZ}^{-1} K_{ZX},

    computed from the streamed statistics only (:meth:`ntkgp.models.sfr.SFR.sparse_evidence`): no pass over
    the data and no Jacobian per evaluation, ``O(G²(MC)² + (MC)³)``. For a Gaussian likelihood it is a lower
    bound on the linearised GP's evidence :math:`\log N(y; m(X), K_{XX} + \sigma^2 I)`, with equality at
    ``Z = X``. For classification it bounds the Laplace (Gaussian-site) approximation of the linearised
    model's evidence; with the linearised mean, ``Z = X`` and a stationary :math:`\theta^*` that is the
    Laplace-GGN evidence :math:`\log q(D)` of MATH.md.

    Differentiable w.r.t. the prior precisions :math:`\delta` (``model.covar_module``), the Gaussian noise and
    the temperature; call ``model.train()`` first. Use it in a GPyTorch loop::

        sfr.train()
        mll = SparseLaplaceEvidence(sfr.likelihood, sfr)
        optimizer = torch.optim.Adam(sfr.hyperparameters(), lr=0.1)
        for _ in range(100):
            optimizer.zero_grad()
            loss = -mll()
            loss.backward()
            optimizer.step()
        sfr.eval()

    Args:
        likelihood: the model's likelihood (must be ``model.likelihood``).
        model: an :class:`~ntkgp.models.sfr.SFR`.
    """

    def __init__(self, likelihood: Likelihood, model: SFR) -> None:
        if not isinstance(model, SFR):
            raise TypeError(f"SparseLaplaceEvidence needs an SFR model, got {type(model).__name__}")
        if likelihood is not model.likelihood:
            raise ValueError("likelihood must be the SFR model's own likelihood (model.likelihood)")
        super().__init__(likelihood, model)

    def forward(self) -> Tensor:
        """The bound divided by the number of data points summarised, a scalar."""
        return self.model.sparse_evidence() / self.model.num_data
