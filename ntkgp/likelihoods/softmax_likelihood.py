"""Multiclass classification with a softmax link: the likelihood of ``CrossEntropyLoss``."""

from __future__ import annotations

from typing import Any

import gpytorch
import torch
from gpytorch.constraints import Interval
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.priors import Prior
from torch import Tensor
from torch.distributions import Categorical

from ..options import OptionAttribute
from ..validation import integer
from .link_approximation import LinkApproximation, output_covariance_blocks, softmax_monte_carlo, softmax_probit
from .temperature import TemperatureMixin


def _num_classes(value: object, argument: str) -> int:
    return integer(value, argument, minimum=2)


class SoftmaxLikelihood(LinkApproximation, TemperatureMixin, gpytorch.likelihoods.SoftmaxLikelihood):
    r"""Categorical likelihood with the softmax link on the network's :math:`C` logits (no mixing weights).

    .. math::
        p(y \mid \mathbf f) = \operatorname{softmax}(\mathbf f)_y, \quad y \in \{0, \dots, C - 1\},

    so that :math:`-\log p` is ``CrossEntropyLoss``. With temperature :math:`T` the Laplace quantities are
    those of :math:`p(y \mid \mathbf f)^{1/T}`: :math:`g = (\operatorname{onehot}(y) - \mathbf p)/T`,
    :math:`\Lambda = (\operatorname{diag}(\mathbf p) - \mathbf p \mathbf p^\top)/T`,
    :math:`\mathbf p = \operatorname{softmax}(\mathbf f)`; :math:`\Lambda` has rank :math:`C - 1`.

    Calling it on logits of shape ``(N, C)`` gives ``Categorical(logits=f)`` (unlike the GPyTorch parent,
    it never transposes its input when ``N == C``). Calling it on a
    :class:`~gpytorch.distributions.MultitaskMultivariateNormal` of shape ``(N, C)`` gives the predictive
    ``Categorical`` by the probit approximation
    :math:`\operatorname{softmax}(\mu / \sqrt{1 + \frac{\pi}{8}\operatorname{diag}\Sigma})`
    (``link_approx="probit"``, marginal variances only) or by Monte Carlo (``link_approx="mc"``, with the
    full :math:`C \times C` block of each point). Both use the untempered link.

    Args:
        num_classes: :math:`C \ge 2`, an integer (any ``numbers.Integral``, e.g. ``numpy.int64``; not ``bool``).
        temperature: :math:`T > 0` (default 1), a real number (any ``numbers.Real``; not ``bool``) or a
            one-element tensor.
        learn_temperature: whether ``raw_temperature`` requires grad (default ``False``; see
            :class:`~ntkgp.likelihoods.LogisticLikelihood` and ``docs/math.md``, "Temperature").
        temperature_prior: optional prior on :math:`T`.
        temperature_constraint: constraint on :math:`T` (default ``Positive()``).
        link_approx: ``"probit"`` or ``"mc"``, the default approximation of the predictive.
        num_samples: default number of Monte Carlo samples for ``link_approx="mc"``.

    Attributes:
        temperature (torch.Tensor): :math:`T`, shape ``()``.
        link_approx, num_samples, learn_temperature: as given; each may be assigned later, validated as here,
            and the likelihood is then the one built with that value.
        num_classes (int): :math:`C`; cannot be changed (build a new likelihood).

    Raises:
        ValueError: for ``num_classes`` that is not an integer >= 2, a non-positive ``temperature``, an
            unknown ``link_approx`` or an invalid ``num_samples``.

    Example:
        >>> likelihood = SoftmaxLikelihood(num_classes=3)
        >>> likelihood(torch.zeros(2, 3)).probs  # the conditional Categorical(logits=f)
        tensor([[0.3333, 0.3333, 0.3333],
                [0.3333, 0.3333, 0.3333]])
    """

    num_classes = OptionAttribute(_num_classes, fixed="the network and the model were built for that many logits")

    def __init__(
        self,
        num_classes: int,
        temperature: float = 1.0,
        learn_temperature: bool = False,
        temperature_prior: Prior | None = None,
        temperature_constraint: Interval | None = None,
        link_approx: str = "probit",
        num_samples: int = 100,
    ) -> None:
        super().__init__(num_classes=_num_classes(num_classes, "num_classes"), mixing_weights=False)
        self._register_temperature(temperature, learn_temperature, temperature_prior, temperature_constraint)
        self.link_approx = link_approx
        self.num_samples = num_samples

    def __call__(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        """GPyTorch's ``likelihood(input)``: the predictive for a distribution over the logits, the conditional
        for samples. A plain ``MultivariateNormal`` (no batch dimension of tasks for GPyTorch to convert) is a
        ``TypeError`` here, not GPyTorch's message about its ``task_dim``."""
        if (isinstance(input, MultivariateNormal) and not isinstance(input, MultitaskMultivariateNormal)
                and len(input.batch_shape) == 0):
            raise TypeError(
                f"SoftmaxLikelihood expects a MultitaskMultivariateNormal over the logits, of shape (N, C) with "
                f"C = {self.num_classes} (function_dist), got a MultivariateNormal over {input.event_shape[0]} "
                "values; a model with C outputs returns the multitask form"
            )
        return super().__call__(input, *args, **kwargs)

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> Categorical:
        """The conditional :math:`p(y \\mid f)`.

        Args:
            function_samples: logits ``f`` of shape ``(..., C)``.

        Returns:
            ``Categorical(logits=f)``.

        Raises:
            ValueError: if the last dimension is not ``num_classes``.
        """
        if function_samples.shape[-1] != self.num_classes:
            raise ValueError(
                f"expected logits with {self.num_classes} classes in the last dimension, got shape "
                f"{tuple(function_samples.shape)}"
            )
        return Categorical(logits=function_samples)

    def _check_logits(self, function_dist: MultitaskMultivariateNormal) -> None:
        """A ``MultitaskMultivariateNormal`` over ``(N, C)`` logits, ``C = num_classes``."""
        if not isinstance(function_dist, MultitaskMultivariateNormal):
            raise TypeError(
                "SoftmaxLikelihood.marginal expects a MultitaskMultivariateNormal of shape (N, C), got "
                f"{type(function_dist).__name__}"
            )
        if function_dist.mean.shape[-1] != self.num_classes:
            raise ValueError(
                f"expected a distribution over {self.num_classes} logits per point, got event shape "
                f"{tuple(function_dist.event_shape)}"
            )

    def _probit(self, function_dist: MultitaskMultivariateNormal) -> Tensor:
        return softmax_probit(function_dist.mean, function_dist.variance)

    def _monte_carlo(
        self, function_dist: MultitaskMultivariateNormal, num_samples: int, generator: torch.Generator | None
    ) -> Tensor:
        return softmax_monte_carlo(function_dist.mean, output_covariance_blocks(function_dist), num_samples, generator)

    def _predictive(self, probs: Tensor) -> Categorical:
        return Categorical(probs=probs)

    def _labels(self, observations: Tensor, predictive: Categorical) -> Tensor:
        return observations.long()
