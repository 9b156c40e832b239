r"""FSVI's variational objective: expected log-likelihood of a mini-batch minus the function-space KL."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..likelihoods import log_likelihood, validate_targets
from ..validation import positive_int
from .model import FSVI


class ELBOTerms(NamedTuple):
    """One estimate of the objective (what :class:`FunctionSpaceELBO` returns)."""

    value: Tensor
    """The ELBO divided by the number of data points N (maximize it; ``-value`` is the loss)."""
    expected_log_likelihood: Tensor
    r""":math:`\frac{N}{B} \sum_b \frac1S \sum_s \log p(y_b \mid f(x_b; \theta_s))`, the estimate of
    :math:`E_q[\log p(D \mid \theta)]` (total, not divided by N)."""
    kl: Tensor
    r""":math:`\mathrm{KL}(q(f_C) \,\|\, p(f_C))` on the context points (total)."""


class FunctionSpaceELBO:
    r"""The FSVI objective (Rudner et al. 2022) for one mini-batch and one set of context points:

    .. math::
        \mathcal L(\mu, s) = \frac{N}{B} \sum_{b=1}^{B} \frac1S \sum_{s=1}^{S} \log p\big(y_b \mid f(x_b; \mu + s
        \odot \epsilon_s)\big) - \mathrm{KL}\big(q(f_{X_C}) \,\|\, p(f_{X_C})\big), \qquad \epsilon_s \sim N(0, I),

    the reparameterized Monte Carlo estimate of the expected log-likelihood through the network itself (not
    linearized), scaled to the data-set size ``N``, minus the closed-form KL between the linearized Gaussians
    over the ``K·C`` outputs at the context points (:meth:`FSVI.function_space_kl`). Calling it returns
    :class:`ELBOTerms` whose ``value`` is :math:`\mathcal L / N` (as GPyTorch's ``VariationalELBO``); the
    gradient of ``-value`` w.r.t. the model's parameters is an unbiased estimate of that of
    :math:`-\mathcal L / N` for fixed context points.

    Args:
        model: the :class:`~ntkgp.fsvi.FSVI` model.
        num_data: ``N``, the number of training points.
        num_samples: ``S``, weight draws per step for the expected log-likelihood.

    Raises:
        TypeError: ``model`` is not an :class:`~ntkgp.fsvi.FSVI`.
        ValueError: ``num_data`` or ``num_samples`` is not a positive integer.

    Example:
        >>> elbo = FunctionSpaceELBO(model, num_data=len(x_train))
        >>> loss = -elbo(x_batch, y_batch, x_context).value
    """

    def __init__(self, model: FSVI, num_data: int, num_samples: int = 1) -> None:
        if not isinstance(model, FSVI):
            raise TypeError(f"model must be an ntkgp.fsvi.FSVI, got {type(model).__name__}")
        self.num_data = positive_int(num_data, "num_data")
        self.num_samples = positive_int(num_samples, "num_samples")
        self.model = model

    def expected_log_likelihood(
        self, x: Tensor, y: Tensor, generator: torch.Generator | None = None
    ) -> Tensor:
        """The Monte Carlo term, scaled to ``N`` (see :class:`ELBOTerms`)."""
        model = self.model
        x = model.prepare(x)
        q = model.variational_distribution
        f = torch.stack([model.linearized.forward(q.sample(generator), x) for _ in range(self.num_samples)])
        y = validate_targets(model.likelihood, y, f.shape[-1], num_data=x.shape[0], name="y")
        return log_likelihood(model.likelihood, f, y.to(f.device)).mean(0).sum() * (self.num_data / x.shape[0])

    def __call__(
        self, x: Tensor, y: Tensor, x_context: Tensor, generator: torch.Generator | None = None
    ) -> ELBOTerms:
        """The objective at a mini-batch ``(x, y)`` and context inputs ``x_context``.

        Args:
            x: mini-batch inputs ``(B, ...)``.
            y: their targets (any form :func:`~ntkgp.likelihoods.validate_targets` accepts).
            x_context: ``(K, ...)`` context inputs.
            generator: random number generator for the weight draws.
        """
        ell = self.expected_log_likelihood(x, y, generator)
        kl = self.model.function_space_kl(x_context)
        return ELBOTerms((ell - kl) / self.num_data, ell, kl)
