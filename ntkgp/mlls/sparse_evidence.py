r"""The collapsed sparse evidence of an SFR model, as a GPyTorch marginal log likelihood."""

from __future__ import annotations

from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.mlls import MarginalLogLikelihood
from torch import Tensor

from ..models.sfr import SFR

__all__ = ["SparseLaplaceMarginalLogLikelihood"]


class SparseLaplaceMarginalLogLikelihood(MarginalLogLikelihood):
    r"""Titsias / DTC collapsed bound with SFR's Gaussian sites, divided by :math:`N`, plus the log priors.

    .. math::
        \frac1N \Big[ c_0 + \tfrac12 \tilde y_u^\top (K_{ZZ} + B_u)^{-1} \tilde y_u
        - \tfrac12 \log\frac{|K_{ZZ} + B_u|}{|K_{ZZ}|}
        - \tfrac12 \sum_n \operatorname{tr}(\Lambda_n (K_{nn} - Q_{nn})) + \sum_k \log p(\eta_k) \Big],
        \qquad Q = K_{XZ} K_{ZZ}^{-1} K_{ZX},

    (:meth:`ntkgp.models.sfr.SFR.log_marginal_likelihood`; :math:`\log p(\eta_k)` are the GPyTorch priors
    registered on the model's hyperparameters, as in ``ExactMarginalLogLikelihood``). For a Gaussian
    likelihood it is a lower bound on the linearized GP's evidence :math:`\log N(y; m(X), K_{XX} + \sigma^2 I)`,
    with equality at ``Z = X``; for classification it bounds the Laplace (Gaussian-site) approximation of the
    linearized model's evidence (docs/sfr.md, "Sparse evidence").

    **GPyTorch's signature, computed from the statistics.** ``forward(function_dist, target)`` follows
    ``ExactMarginalLogLikelihood``, but the bound is a function of SFR's sufficient statistics
    (:math:`B_u`, :math:`\tilde y_u`, the traces and data-fit sums, accumulated once over the training data
    and by :meth:`~ntkgp.models.sfr.SFR.update`), not of a distribution over the training outputs: SFR keeps
    no training data, and the bound needs the data only through those sums. So ``function_dist`` and
    ``target`` must be the model's output at its training inputs and the training targets, or ``None``
    (recommended: computing ``model(train_x)`` costs a prediction over all ``N`` points and is not used).
    When given, they are checked for their number of points (``N``); their values are not read. Each
    evaluation costs ``O(G²(MC)² + (MC)³)``, with no pass over the data and no Jacobian.

    Differentiable w.r.t. the prior precisions :math:`\delta` (``model.covar_module``), the Gaussian noise and
    the temperature; call ``model.train()`` first::

        sfr.train()
        mll = SparseLaplaceMarginalLogLikelihood(sfr.likelihood, sfr)
        optimizer = torch.optim.Adam(sfr.hyperparameters(), lr=0.1)
        for _ in range(100):
            optimizer.zero_grad()
            loss = -mll()                      # or -mll(None, None)
            loss.backward()
            optimizer.step()
        sfr.eval()

    Args:
        likelihood: the model's likelihood (must be ``model.likelihood``).
        model: an :class:`~ntkgp.models.sfr.SFR`.

    Raises:
        TypeError: if ``model`` is not an SFR.
        ValueError: if ``likelihood`` is not ``model.likelihood``.
    """

    def __init__(self, likelihood: Likelihood, model: SFR) -> None:
        if not isinstance(model, SFR):
            raise TypeError(f"{type(self).__name__} needs an SFR model, got {type(model).__name__}")
        if likelihood is not model.likelihood:
            raise ValueError("likelihood must be the SFR model's own likelihood (model.likelihood)")
        super().__init__(likelihood, model)

    def forward(self, function_dist: MultivariateNormal | None = None, target: Tensor | None = None, *params) -> Tensor:
        """The bound plus the log priors, divided by the number of data points summarized, a scalar.

        Args:
            function_dist: ``model(train_x)`` or ``None`` (not read; see the class doc).
            target: the training targets or ``None`` (not read).
            *params: ignored (GPyTorch's signature).

        Raises:
            TypeError: if ``function_dist`` is not a ``MultivariateNormal``.
            ValueError: if ``function_dist`` or ``target`` does not have ``N`` points.
        """
        num_data = self.model.num_data
        if function_dist is not None:
            if not isinstance(function_dist, MultivariateNormal):
                raise TypeError(f"function_dist must be a MultivariateNormal or None, got {type(function_dist).__name__}")
            points = function_dist.mean.shape[-2] if self.model.num_outputs > 1 else function_dist.mean.shape[-1]
            if points != num_data:
                raise ValueError(
                    f"function_dist must be the model's output at its {num_data} training inputs (or None), got "
                    f"{points} points"
                )
        if target is not None and (target.dim() == 0 or target.shape[0] != num_data):
            raise ValueError(
                f"target must hold the {num_data} training targets the model summarizes (or be None), got shape "
                f"{tuple(target.shape)}"
            )
        value = self.model.log_marginal_likelihood()
        for _, module, prior, closure, _ in self.model.named_priors():
            value = value + prior.log_prob(closure(module)).sum()
        return value / num_data
