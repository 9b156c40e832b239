r"""Class probabilities under a Gaussian over the logits: :math:`\mathbb E[\mathrm{link}(f)]`,
:math:`f \sim N(\mu, \Sigma)` (``docs/math.md``, "GLM predictive").

Two approximations, chosen by ``link_approx``:

- ``"probit"`` (default): :math:`\mathrm{link}(\mu / \sqrt{1 + \frac{\pi}{8} \operatorname{diag} \Sigma})`,
  the probit approximation of the sigmoid (MacKay 1992), applied per class for the softmax.
  Uses the marginal variances only.
- ``"mc"``: the average of :math:`\mathrm{link}(f_s)` over ``num_samples`` draws
  :math:`f_s \sim N(\mu_n, \Sigma_n)` per data point, with the full :math:`C \times C` block
  :math:`\Sigma_n` of each point (points are independent here: only per-point marginals matter).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.warnings import NumericalWarning
from torch import Tensor
from torch.distributions import Distribution

from ..options import Link, OptionAttribute
from ..validation import positive_int

LINK_APPROXIMATIONS = ("probit", "mc")


def check_link_approx(link_approx: object, argument: str = "link_approx") -> Link:
    """Validate ``link_approx``: ``"probit"`` or ``"mc"`` (strings or :class:`~ntkgp.options.Link` members).

    Returns:
        The :class:`~ntkgp.options.Link` member (equal to its string).

    Raises:
        ValueError: naming ``argument`` and the accepted values.
    """
    if isinstance(link_approx, str) and link_approx in LINK_APPROXIMATIONS:
        return Link(link_approx)
    raise ValueError(f"{argument} must be one of {LINK_APPROXIMATIONS}, got {link_approx!r}")


def check_num_samples(num_samples: object, argument: str = "num_samples") -> int:
    """Validate ``num_samples``: a positive integer (any ``numbers.Integral``; ``bool`` is rejected).

    Raises:
        ValueError: naming ``argument``.
    """
    return positive_int(num_samples, argument)


class LinkApproximation:
    r"""The predictive of a classification likelihood, :math:`p(y) \approx \mathbb E[\mathrm{link}(f)]` under a
    Gaussian over the logits, by ``link_approx`` (a mixin of :class:`~ntkgp.likelihoods.LogisticLikelihood` and
    :class:`~ntkgp.likelihoods.SoftmaxLikelihood`: one ``marginal`` and one dispatch for both).

    ``link_approx`` and ``num_samples`` are the defaults of :meth:`marginal` (per-call arguments override them);
    assigning either validates it as the constructor does, and nothing depends on them but the next call,
    so the likelihood is then the one built with that value. A likelihood defines ``_check_logits(dist)``,
    ``_probit(dist)``, ``_monte_carlo(dist, num_samples, generator)``, ``_predictive(probs)`` and
    ``_labels(observations, predictive)``."""

    link_approx = OptionAttribute(check_link_approx, on_change="_link_option_changed")
    num_samples = OptionAttribute(check_num_samples, on_change="_link_option_changed")

    def _link_option_changed(self, name: str) -> None:
        """Nothing is cached from ``link_approx`` or ``num_samples``: every call reads them."""

    def marginal(
        self,
        function_dist: MultivariateNormal,
        *args: Any,
        link_approx: str | None = None,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> Distribution:
        r"""The predictive :math:`p(y) \approx \mathbb E_{f \sim N(\mu_n, \Sigma_n)}[\mathrm{link}(f)]` per point.

        Args:
            function_dist: the distribution over the logits: for ``LogisticLikelihood`` a ``MultivariateNormal``
                over ``N`` points or a ``MultitaskMultivariateNormal`` of shape ``(N, 1)`` (marginal variances
                only); for ``SoftmaxLikelihood`` a ``MultitaskMultivariateNormal`` of shape ``(N, C)`` (the
                marginal variances for ``"probit"``, each point's ``C × C`` block for ``"mc"``).
            link_approx: ``"probit"`` or ``"mc"``; default ``self.link_approx``.
            num_samples: Monte Carlo samples; default ``self.num_samples``.
            generator: optional random number generator for ``"mc"``.

        Returns:
            ``Bernoulli`` with ``probs`` of the shape of ``function_dist.mean`` (logistic), or ``Categorical``
            with ``probs`` of shape ``(N, C)`` (softmax).

        Raises:
            TypeError: a softmax likelihood given another distribution than a ``MultitaskMultivariateNormal``.
            ValueError: a wrong number of logits, an unknown ``link_approx`` or an invalid ``num_samples``.
        """
        self._check_logits(function_dist)
        link_approx = self.link_approx if link_approx is None else check_link_approx(link_approx)
        if link_approx == Link.PROBIT:
            return self._predictive(self._probit(function_dist))
        num_samples = self.num_samples if num_samples is None else check_num_samples(num_samples)
        return self._predictive(self._monte_carlo(function_dist, num_samples, generator))

    def log_marginal(self, observations: Tensor, function_dist: MultivariateNormal, *args: Any, **kwargs: Any) -> Tensor:
        r""":math:`\log p(y)` under :meth:`marginal`, per point.

        Args:
            observations: labels in {0, 1} of the shape of ``function_dist.mean`` (logistic), or integer labels
                ``(N,)`` (softmax).
            function_dist: as :meth:`marginal`; ``kwargs`` are passed to it.

        Returns:
            The log predictive probabilities, the shape of ``observations``.
        """
        predictive = self.marginal(function_dist, *args, **kwargs)
        return predictive.log_prob(self._labels(observations, predictive))


def probit_scaled_mean(mean: Tensor, variance: Tensor) -> Tensor:
    r""":math:`\mu / \sqrt{1 + \frac{\pi}{8} \sigma^2}`, elementwise.

    Args:
        mean: :math:`\mu`, any shape.
        variance: :math:`\sigma^2 \ge 0`, broadcastable to ``mean``.

    Returns:
        The scaled means, the broadcast shape.
    """
    return mean / torch.sqrt(1.0 + (math.pi / 8.0) * variance)


def sigmoid_probit(mean: Tensor, variance: Tensor) -> Tensor:
    r"""Binary probit approximation :math:`\operatorname{sigmoid}(\mu / \sqrt{1 + \frac{\pi}{8}\sigma^2})`.

    Args:
        mean: :math:`\mu`, shape ``(N,)`` (or any shape).
        variance: :math:`\sigma^2`, same shape.

    Returns:
        :math:`p(y = 1)`, same shape.

    Example:
        >>> sigmoid_probit(torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0]))
        tensor([0.5000, 0.8808])
    """
    return torch.sigmoid(probit_scaled_mean(mean, variance))


def softmax_probit(mean: Tensor, variance: Tensor) -> Tensor:
    r"""Multiclass probit approximation, softmax of the probit-scaled means.

    :math:`p = \operatorname{softmax}(\mu / \sqrt{1 + \frac{\pi}{8}\operatorname{diag}\Sigma})`.

    Args:
        mean: :math:`\mu`, shape ``(N, C)``.
        variance: the marginal variances :math:`\operatorname{diag} \Sigma_n`, shape ``(N, C)``.

    Returns:
        Class probabilities, shape ``(N, C)``.

    Example:
        >>> softmax_probit(torch.zeros(1, 3), torch.ones(1, 3))
        tensor([[0.3333, 0.3333, 0.3333]])
    """
    return torch.softmax(probit_scaled_mean(mean, variance), dim=-1)


def _standard_normal(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    return torch.randn(shape, dtype=like.dtype, device=like.device, generator=generator)


def sigmoid_monte_carlo(
    mean: Tensor, variance: Tensor, num_samples: int, generator: torch.Generator | None = None
) -> Tensor:
    r"""Monte Carlo average of the sigmoid.

    :math:`p = \frac1S \sum_s \operatorname{sigmoid}(\mu + \sigma \epsilon_s)` with
    :math:`\epsilon_s \sim N(0, 1)`.

    Args:
        mean: :math:`\mu`, shape ``(N,)`` (or any shape).
        variance: :math:`\sigma^2`, same shape (negative rounding errors are clamped to 0).
        num_samples: :math:`S`, a positive integer.
        generator: optional random number generator.

    Returns:
        :math:`p(y = 1)`, same shape as ``mean``.

    Raises:
        ValueError: for an invalid ``num_samples``.

    Example:
        >>> sigmoid_monte_carlo(torch.zeros(2), torch.ones(2), 1000, torch.Generator().manual_seed(0)).shape
        torch.Size([2])
    """
    eps = _standard_normal((check_num_samples(num_samples), *mean.shape), mean, generator)
    return torch.sigmoid(mean + variance.clamp_min(0.0).sqrt() * eps).mean(dim=0)


def softmax_monte_carlo(
    mean: Tensor, covariance: Tensor, num_samples: int, generator: torch.Generator | None = None
) -> Tensor:
    r"""Monte Carlo average of the softmax.

    :math:`p_n = \frac1S \sum_s \operatorname{softmax}(\mu_n + L_n \epsilon_s)` with
    :math:`\epsilon_s \sim N(0, I)`,
    with :math:`L_n` the Cholesky factor of :math:`\Sigma_n` (with jitter where it is singular, e.g. logits
    with a shared offset; the ``NumericalWarning`` of that jitter is silenced here).

    Args:
        mean: :math:`\mu`, shape ``(N, C)``.
        covariance: per-point blocks :math:`\Sigma_n`, shape ``(N, C, C)``.
        num_samples: :math:`S`, a positive integer.
        generator: optional random number generator.

    Returns:
        Class probabilities, shape ``(N, C)``.

    Raises:
        ValueError: for an invalid ``num_samples``.

    Example:
        >>> probs = softmax_monte_carlo(torch.zeros(1, 3), torch.eye(3).expand(1, 3, 3), 500)
        >>> probs.shape, bool(torch.allclose(probs.sum(-1), torch.ones(1)))
        (torch.Size([1, 3]), True)
    """
    with warnings.catch_warnings():
        # jitter on singular blocks is expected here (e.g. logits with a shared offset) and harmless
        warnings.simplefilter("ignore", NumericalWarning)
        factor = psd_safe_cholesky(covariance)
    eps = _standard_normal((check_num_samples(num_samples), *mean.shape), mean, generator)
    samples = mean + torch.einsum("...ij,s...j->s...i", factor, eps)
    return torch.softmax(samples, dim=-1).mean(dim=0)


def output_covariance_blocks(function_dist: MultitaskMultivariateNormal) -> Tensor:
    r"""The :math:`C \times C` covariance block :math:`\Sigma_n` of each point, shape ``(..., N, C, C)``.

    Reads only those :math:`N C^2` entries of the (lazy) covariance, for either task ordering
    (interleaved: row :math:`nC + c`; not interleaved: row :math:`cN + n`).

    Args:
        function_dist: a distribution over ``(N, C)`` logits.

    Returns:
        Shape ``(..., N, C, C)``.

    Example:
        >>> from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
        >>> dist = MultitaskMultivariateNormal(torch.zeros(2, 3), torch.eye(6))
        >>> output_covariance_blocks(dist).shape
        torch.Size([2, 3, 3])
    """
    num_data, num_tasks = function_dist.mean.shape[-2:]
    device = function_dist.mean.device
    point = torch.arange(num_data, device=device).view(-1, 1, 1)
    task_row = torch.arange(num_tasks, device=device).view(1, -1, 1)
    task_col = torch.arange(num_tasks, device=device).view(1, 1, -1)
    if function_dist._interleaved:
        rows, cols = point * num_tasks + task_row, point * num_tasks + task_col
    else:
        rows, cols = task_row * num_data + point, task_col * num_data + point
    rows, cols = torch.broadcast_tensors(rows, cols)
    return function_dist.lazy_covariance_matrix[..., rows, cols]
