"""The Laplace-GGN evidence as a GPyTorch marginal log likelihood."""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood
from gpytorch.mlls import MarginalLogLikelihood

from .laplace_ggn_evidence import CURVATURES, SPACES


class LaplaceGGNMarginalLogLikelihood(MarginalLogLikelihood):
    r"""The Laplace-GGN evidence of an :class:`~ntkgp.NTKGP`, divided by N, as GPyTorch's MLLs are.

    .. math::
        \frac1N \Big[\sum_n \log p(y_n \mid f_n) - \tfrac12 \theta^{*\top} P_0 \theta^*
        - \tfrac12 \log\lvert I + \Lambda^{1/2} K_{XX} \Lambda^{1/2}\rvert + \sum \log p(\text{hyper})\Big]

    with any priors registered on the hyperparameters added, as in ``ExactMarginalLogLikelihood``. The
    evidence is a function of :math:`\theta^*`, the data and the hyperparameters: the output distribution
    passed in is not used (the call signature is GPyTorch's, so the usual loop works unchanged)::

        mll = ntkgp.LaplaceGGNMarginalLogLikelihood(model.likelihood, model)
        optimizer = torch.optim.Adam(model.hyperparameters(), lr=0.1)
        for _ in range(100):
            optimizer.zero_grad()
            loss = -mll(model(train_x), train_y)
            loss.backward()
            optimizer.step()

    Args:
        likelihood: the model's likelihood.
        model: an :class:`~ntkgp.NTKGP`.
        curvature: ``"ggn"`` or ``"ef"`` (empirical Fisher).
        space: ``"auto"`` (by cost), ``"function"`` or ``"weight"``.
    """

    def __init__(self, likelihood: Likelihood, model, curvature: str = "ggn", space: str = "auto") -> None:
        if curvature not in CURVATURES:
            raise ValueError(f"curvature must be one of {CURVATURES}, got {curvature!r}")
        if space not in SPACES:
            raise ValueError(f"space must be one of {SPACES}, got {space!r}")
        if not hasattr(model, "log_marginal_likelihood"):
            raise TypeError(f"model must be an ntkgp.NTKGP, got {type(model).__name__}")
        super().__init__(likelihood, model)
        self.curvature = curvature
        self.space = space

    def forward(self, function_dist, target: torch.Tensor | None = None, *params, **kwargs) -> torch.Tensor:
        evidence = self.model.log_marginal_likelihood(target=target, curvature=self.curvature, space=self.space)
        for _, module, prior, closure, _ in self.named_priors():
            evidence = evidence + prior.log_prob(closure(module)).sum()
        return evidence / self.model.num_data
