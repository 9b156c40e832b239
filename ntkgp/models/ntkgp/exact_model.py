""":class:`ExactNTKGP`: :class:`~ntkgp.NTKGP` with a Gaussian likelihood, a ``gpytorch.models.ExactGP``."""

from __future__ import annotations

import torch
from gpytorch import settings as gpytorch_settings
from gpytorch.likelihoods import Likelihood
from gpytorch.models import ExactGP

from ...likelihoods import validate_targets
from ...ntk.inputs import is_structured
from .model import NTKGP

__all__ = ["ExactNTKGP"]


class ExactNTKGP(NTKGP, ExactGP, gaussian=True):
    """:class:`NTKGP` with a Gaussian likelihood: a ``gpytorch.models.ExactGP`` on the linearized network.

    In train mode calls go through ``ExactGP`` (the prior, for ``ExactMarginalLogLikelihood``); in eval mode
    through :meth:`NTKGP.posterior` (exact for a Gaussian likelihood), never through GPyTorch's
    ``prediction_strategy``, whose caches are not keyed by the hyperparameters' values (it is cleared at
    every eval-mode call, so that nothing built from it can be stale).
    """

    def _init_data(self, x: torch.Tensor, y: torch.Tensor, likelihood: Likelihood) -> None:
        ExactGP.__init__(self, x, y.squeeze(-1) if y.shape[-1] == 1 else y, likelihood)

    def __call__(self, *args, **kwargs):
        if self.training and len(args) == 1 and not kwargs and (torch.is_tensor(args[0]) or is_structured(args[0])):
            # ExactGP's train mode for one input, without its generic plumbing (a hyperparameter step calls it):
            # the prior at the training inputs, refused at other inputs under gpytorch.settings.debug (GPyTorch's
            # check; the training inputs themselves, the usual argument, need no comparison: x is finite here)
            x = self._flat_inputs(args[0], "x")
            train_x = self.train_x
            if gpytorch_settings.debug.on() and not (x is train_x or torch.equal(train_x, x)):
                raise RuntimeError("You must train on the training inputs!")
            return self._checked_prior(x)
        if self.training or gpytorch_settings.prior_mode.on():
            args = [self._flat_inputs(a, "x") if torch.is_tensor(a) or is_structured(a) else a for a in args]
            return ExactGP.__call__(self, *args, **kwargs)
        self.prediction_strategy = None
        if len(args) != 1:
            raise TypeError(f"ExactNTKGP takes one input tensor in eval mode, got {len(args)}")
        return self._call_eval(args[0], **kwargs)

    def set_train_data(self, inputs=None, targets=None, strict: bool = True) -> None:
        """Replace the training data (GPyTorch's method), validated; prefer :meth:`condition_on`."""
        # GPyTorch's tuple (x,) of one input, or the input itself (a tensor, a dict, or a tuple of several tensors)
        x = self.train_x if inputs is None else (inputs[0] if isinstance(inputs, tuple) and len(inputs) == 1 else inputs)
        y = self._train_y if targets is None else targets
        x = self._flat_inputs(x, "inputs")
        if x.dim() != 2:
            raise ValueError(f"inputs must have shape (N, {self.train_x.shape[-1]}), got {tuple(x.shape)}")
        y = validate_targets(self.likelihood, y, self.num_outputs, num_data=x.shape[0], name="targets")
        if strict and (x.shape != self.train_x.shape):
            raise RuntimeError(f"inputs of shape {tuple(x.shape)} differ from the training inputs {tuple(self.train_x.shape)} (strict=True)")
        ExactGP.set_train_data(self, x, y.squeeze(-1) if y.shape[-1] == 1 else y, strict=False)
        self._train_y = y.to(device=x.device)
