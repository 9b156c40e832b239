"""What :func:`~ntkgp.training.train_marglik` returns: the trained network, its learned hyperparameters and
the record of every hyperparameter round."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gpytorch.likelihoods import Likelihood
from torch import nn

from ..kernels import NTKKernel
from ..models import NTKGP
from ..laplace.weight_space.posterior.weight_posterior import WeightPosterior

__all__ = ["MarglikResult"]


@dataclass
class MarglikResult:
    """What :func:`~ntkgp.training.train_marglik` returns (also attached to a ``KeyboardInterrupt`` that stops
    it, as ``marglik_result``: the state the network was left in).

    Attributes:
        net: the trained network (the one passed in, at its best-evidence checkpoint).
        kernel: an :class:`~ntkgp.NTKKernel` carrying the learned prior precisions.
        likelihood: the likelihood with the learned noise / temperature.
        log_evidence: the best log marginal likelihood, divided by N (``-inf`` if no round gave a finite one).
        best_epoch: the epoch of the best checkpoint (``-1`` if none).
        history: one dict per hyperparameter round: ``epoch``, ``log_evidence`` (/N), ``prior_precision``,
            the likelihood's hyperparameters as :func:`~ntkgp.likelihoods.hyperparameter_values` reads them
            (``noise`` and ``task_noises`` hold the noise **variances** σ², ``temperature`` T), and
            ``train_loss`` (the MAP objective per data point).
        train_loss: the MAP objective per data point, per epoch.
        structure: the curvature structure the hyperparameters were learned with
            (:class:`ntkgp.options.Structure` value).

    The predictive of the structure that was trained is :meth:`posterior` (a weight-space Laplace posterior,
    for :func:`ntkgp.laplace.predict`); :meth:`model` is the function-space GP of the full GGN (exact GLM
    predictive), whatever the structure.
    """

    net: nn.Module
    kernel: NTKKernel
    likelihood: Likelihood
    log_evidence: float
    best_epoch: int
    history: list[dict] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    structure: str = "full_ggn"

    @property
    def prior_precision(self) -> torch.Tensor:
        """The learned prior precisions δ, ``(G,)``."""
        return self.kernel.prior_precision.detach()

    @property
    def log_marginal_likelihood(self) -> float:
        """The best log marginal likelihood per data point (same as :attr:`log_evidence`)."""
        return self.log_evidence

    def model(self, train_x: torch.Tensor, train_y: torch.Tensor, **kwargs) -> NTKGP:
        """An :class:`~ntkgp.NTKGP` of the trained network with the learned hyperparameters: the GP of the
        **full GGN** (its evidence and GLM predictive are exact). For ``structure="full_ggn"`` that is the
        trained structure; for the others use :meth:`posterior`."""
        return NTKGP(self.net, train_x, train_y, self.likelihood, prior_precision=self.prior_precision,
                     prior_structure=self.kernel.prior_structure, input_shape=self.kernel.engine.input_shape, **kwargs)

    def posterior(self, train_x: torch.Tensor, train_y: torch.Tensor | None, **kwargs) -> WeightPosterior:
        r"""The weight-space Laplace posterior of the **structure that was trained** (``"full_ggn"`` /
        ``"full_ef"``: :class:`~ntkgp.laplace.weight_space.FullLaplace`; ``"kfac"``: :class:`~ntkgp.laplace.weight_space.KFACLaplace`
        without damping, as the training evidence; ``"diag_ggn"`` / ``"diag_ef"``:
        :class:`~ntkgp.laplace.weight_space.DiagLaplace`) with the learned :math:`\delta` and the learned likelihood:
        its ``log_det_precision`` is the one of the training evidence, and
        ``ntkgp.laplace.predict(result.posterior(x, y), x_test)`` its predictive
        (:func:`ntkgp.laplace.laplace_posterior`; ``kwargs`` are passed to it)."""
        from ..laplace.weight_space.laplace_posterior import laplace_posterior

        kwargs.setdefault("input_shape", self.kernel.engine.input_shape)
        return laplace_posterior(self.net, train_x, train_y, self.likelihood, structure=self.structure,
                                 prior_precision=self.prior_precision, prior_structure=self.kernel.prior_structure,
                                 **kwargs)

