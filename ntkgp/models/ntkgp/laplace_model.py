""":class:`LaplaceNTKGP`: :class:`~ntkgp.NTKGP` with a classification likelihood, through Gaussian sites."""

from __future__ import annotations

import torch
from gpytorch import settings as gpytorch_settings
from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import GP

from .model import NTKGP

__all__ = ["LaplaceNTKGP"]


class LaplaceNTKGP(NTKGP, gaussian=False):
    """:class:`NTKGP` with a classification likelihood: the Laplace-GGN posterior through Gaussian sites."""

    def _init_data(self, x: torch.Tensor, y: torch.Tensor, likelihood: Likelihood) -> None:
        GP.__init__(self)
        self.train_inputs = (x,)
        self.train_targets = y
        self.likelihood = likelihood

    def __call__(self, x: torch.Tensor, **kwargs) -> MultivariateNormal:
        if self.training or gpytorch_settings.prior_mode.on():
            if kwargs:
                raise TypeError(f"model(x) in train mode takes no keyword arguments, got {sorted(kwargs)}")
            return self._checked_prior(self._flat_inputs(x, "x"))
        return self._call_eval(x, **kwargs)

    def _apply(self, fn):
        # GPyTorch's GP does not convert train_inputs (ExactGP does): keep them in the model's dtype.
        super()._apply(fn)
        self.train_inputs = tuple(fn(t) for t in self.train_inputs)
        return self
