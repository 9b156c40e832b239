r"""The predictive of a weight-space Laplace posterior, by every estimator of the GLM predictive.

One call, :func:`predict`, turns a posterior :math:`N(\theta^*, \Sigma)` (:mod:`ntkgp.laplace.weight_space`) into a
GPyTorch distribution over the network outputs :math:`f(x)` at test inputs, and for classification into class
probabilities (``docs/math.md``, "GLM predictive"; ``docs/predictive.md`` measures each method against the
exact one). "The review" below is *A Short Review of Estimators for the GLM Predictive of Laplace Bayesian
Neural Networks* (``docs/predictive.md``, "References"). The methods (``method=``):

- ``"glm"``: the closed form of the linearized network, :math:`f(x) \sim N(f(x; \theta^*), J \Sigma J^\top)`,
  dense, KFAC (the review's eq. 16, per layer in the Kronecker eigenbases) or diagonal, as the posterior's
  structure dictates;
- ``"glm_mc"``: samples of the linearized network, :math:`f(x; \theta^*) + J(x) \eta_s`,
  :math:`\eta_s \sim N(0, \Sigma)`, with exact Jacobian-vector products (forward mode, ``torch.func.jvp``),
  never forming :math:`J`; covariance :math:`\frac1S \sum_s (J \eta_s)(J \eta_s)^\top` (the mean
  :math:`f(x; \theta^*)` is known);
- ``"mc_glm"``: the review's MC-GLM, the same with finite-difference directional derivatives
  :math:`A_s = (f(x; \theta^* + t_s \eta_s) - f(x; \theta^* - t_s \eta_s)) / (2 t_s)` (``"central"``,
  default) or :math:`(f(x; \theta^* + t_s \eta_s) - f(x; \theta^*)) / t_s` (``"forward"``, as in the review),
  with the step :math:`t_s = h \max(1, \|\theta^*\|_\infty) / \|\eta_s\|_\infty`, so that no weight moves
  by more than :math:`h \max(1, \|\theta^*\|_\infty)`; :math:`h = \epsilon^{1/3}` (central) or
  :math:`\epsilon^{1/2}` (forward) by default, :math:`\epsilon` the machine epsilon of the network's dtype:
  :math:`h = 6.1 \cdot 10^{-6}` / :math:`1.5 \cdot 10^{-8}` in float64, :math:`4.9 \cdot 10^{-3}` /
  :math:`3.5 \cdot 10^{-4}` in float32;
- ``"nn_sampling"``: the network itself at sampled weights, :math:`f(x; \theta^* + \eta_s)`, with the sample
  mean and the sample covariance (:math:`\frac{1}{S-1}`): not a GLM estimator, the Laplace posterior pushed
  through the nonlinear network.

The same draws :math:`\eta_s` serve every test point, so ``joint=True`` gives the joint covariance across
test points of the sampling methods as the root of the samples, ``(N·C, S)``.

Class probabilities (``link=``): ``"probit"`` (:math:`\mathrm{sigmoid}(\mu/\sqrt{1 + \pi\sigma^2/8})`, per
class for the softmax), ``"bridge"`` (the Laplace bridge to a Dirichlet, softmax only), ``"mc"`` (the average
link over samples: from :math:`N(\mu_n, \Sigma_n)` for ``"glm"``, over the method's own samples otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import Likelihood
from linear_operator.operators import (
    BlockDiagLinearOperator,
    DenseLinearOperator,
    DiagLinearOperator,
    RootLinearOperator,
)
from torch import Tensor

from ....likelihoods import (
    LogisticLikelihood,
    is_gaussian,
    sigmoid_monte_carlo,
    sigmoid_probit,
    softmax_monte_carlo,
    softmax_probit,
)
from ....ntk.inputs import num_rows, split
from ....options import FiniteDifference, Link, Method, choose
from ....progress import check_progress, progress_bar
from ....memory import SAMPLE_EVALUATIONS
from ....validation import positive_int

#: What :func:`predict` uses of a posterior (:class:`~ntkgp.laplace.weight_space.WeightPosterior`'s interface; checked
#: by name, so that the posterior's own ``predict`` can call this module without an import circle).
POSTERIOR_INTERFACE = ("function", "likelihood", "sample", "glm_covariance", "glm_root")

#: Network evaluations (samples × test points) vectorized at once by the sampling methods (bounds memory;
#: :data:`ntkgp.memory.SAMPLE_EVALUATIONS`).
SAMPLE_BUDGET = SAMPLE_EVALUATIONS

__all__ = [
    "FiniteDifference",
    "Link",
    "Method",
    "Prediction",
    "default_step_size",
    "laplace_bridge",
    "predict",
]


@dataclass
class Prediction:
    """What :func:`predict` returns.

    Attributes:
        f: the distribution over :math:`f(x)`: a ``MultivariateNormal`` ``(N,)`` for one output, else an
            interleaved ``MultitaskMultivariateNormal`` ``(N, C)``; its covariance is a lazy operator
            (block-diagonal per point, or a root for ``joint=True``).
        probs: class probabilities for classification (``(N,)`` :math:`p(y = 1)` for the logistic likelihood,
            ``(N, C)`` for the softmax), ``None`` for regression.
        samples: the function samples ``(S, N, C)`` of a sampling method (``None`` for ``"glm"``).
        method: the method used; ``link`` the link approximation (``None`` for regression).
    """

    f: MultivariateNormal | MultitaskMultivariateNormal
    probs: Tensor | None
    samples: Tensor | None
    method: str
    link: str | None


def default_step_size(dtype: torch.dtype, scheme: FiniteDifference | str = "central") -> float:
    r"""The default relative step :math:`h` of ``"mc_glm"``: :math:`\epsilon^{1/3}` (central) or
    :math:`\epsilon^{1/2}` (forward), :math:`\epsilon` = ``torch.finfo(dtype).eps``."""
    scheme = choose(FiniteDifference, scheme, "finite_difference")
    eps = torch.finfo(dtype).eps
    return eps ** (1 / 3) if scheme is FiniteDifference.CENTRAL else eps**0.5


def laplace_bridge(mean: Tensor, variance: Tensor) -> Tensor:
    r"""Class probabilities of the Laplace bridge: the Dirichlet :math:`\mathrm{Dir}(\alpha)` whose Laplace
    approximation in the softmax basis has means :math:`\mu` and variances :math:`\sigma^2`
    (Hennig et al. 2012),

    .. math::
        \alpha_k = \frac{1}{\sigma_k^2}\Big(1 - \frac{2}{C} + \frac{e^{\mu_k}}{C^2} \sum_l e^{-\mu_l}\Big),
        \qquad p_k = \alpha_k / \textstyle\sum_l \alpha_l,

    computed in log space (no overflow for large logits). Invariant to a shift of all logits.

    Args:
        mean: :math:`\mu`, ``(N, C)`` with ``C ≥ 2``.
        variance: the marginal variances :math:`\sigma^2`, ``(N, C)``, positive.

    Returns:
        the Dirichlet means :math:`p`, ``(N, C)``.
    """
    c = mean.shape[-1]
    if c < 2:
        raise ValueError(f"the Laplace bridge needs C >= 2 logits, got mean of shape {tuple(mean.shape)}")
    u = mean + torch.logsumexp(-mean, dim=-1, keepdim=True) - 2 * math.log(c)
    base = torch.full_like(u, math.log(1 - 2 / c) if c > 2 else -math.inf)
    log_alpha = torch.logaddexp(base, u) - variance.clamp_min(torch.finfo(variance.dtype).tiny).log()
    return torch.softmax(log_alpha, dim=-1)


def _check_args(posterior, x, num_samples, joint, step_size, generator, progress) -> None:
    if not all(hasattr(posterior, name) for name in POSTERIOR_INTERFACE):
        raise TypeError(
            f"posterior must be an ntkgp.laplace.weight_space.WeightPosterior, got {type(posterior).__name__}"
        )
    if not torch.is_tensor(x) and not isinstance(x, dict):  # a tensor, or a dict of tensors (ntkgp.ntk.inputs)
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    positive_int(num_samples, "num_samples")
    if not isinstance(joint, bool):
        raise TypeError(f"joint must be a bool, got {type(joint).__name__}")
    if step_size is not None and not (
        isinstance(step_size, (int, float)) and not isinstance(step_size, bool) and math.isfinite(step_size)
        and step_size > 0
    ):
        raise ValueError(f"step_size must be a positive number or None, got {step_size!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    check_progress(progress)


def _link_for(likelihood: Likelihood, link: str | None) -> Link | None:
    if is_gaussian(likelihood):
        if link is not None:
            raise ValueError(
                f"link must be None for the regression likelihood {type(likelihood).__name__}, got {link!r}"
            )
        return None
    chosen = choose(Link, "probit" if link is None else link, "link")
    if chosen is Link.BRIDGE and isinstance(likelihood, LogisticLikelihood):
        raise ValueError(
            "link='bridge' needs a softmax over C >= 2 logits (with one logit the bridge returns the MAP "
            "probability whatever the variance); use 'probit' or 'mc' with LogisticLikelihood"
        )
    return chosen


def _sample_outputs(
    posterior, x: Tensor, eta: Tensor, method: Method, scheme, step_size
) -> Tensor:
    """Function samples minus :math:`f(x;\\theta^*)` (GLM methods) or the network's outputs (``nn_sampling``),
    ``(S, n, C)``, for a prepared chunk ``x`` and draws ``eta`` ``(S, P)``."""
    fn = posterior.function
    if method is Method.GLM_MC:
        return fn.jvp(x, eta)
    forward = torch.vmap(lambda d: fn.forward(x, d))
    if method is Method.NN_SAMPLING:
        return forward(eta)
    h = default_step_size(fn.dtype, scheme) if step_size is None else float(step_size)
    scale = max(1.0, fn.theta().abs().max().item())
    t = (h * scale / eta.abs().amax(dim=-1).clamp_min(torch.finfo(eta.dtype).tiny))[:, None]  # (S, 1)
    plus = forward(t * eta)
    minus = forward(-t * eta) if scheme is FiniteDifference.CENTRAL else fn.forward(x).unsqueeze(0)
    width = 2 * t if scheme is FiniteDifference.CENTRAL else t
    return (plus - minus) / width[:, :, None]


def _covariance(blocks: Tensor | None, root: Tensor | None, c: int):
    """A lazy covariance from per-point blocks ``(N, C, C)`` or a joint root ``(N·C, R)``."""
    if root is not None:
        return RootLinearOperator(root)
    if c == 1:
        return DiagLinearOperator(blocks[:, 0, 0].clamp_min(0))
    return BlockDiagLinearOperator(DenseLinearOperator(blocks))


def predict(
    posterior,
    x: Tensor,
    method: str = "glm",
    link: str | None = None,
    num_samples: int = 100,
    joint: bool = False,
    step_size: float | None = None,
    finite_difference: str = "central",
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> Prediction:
    r"""The predictive of ``posterior`` at the test inputs ``x`` by the estimator ``method`` (module
    docstring).

    Args:
        posterior: a weight-space Laplace posterior (:mod:`ntkgp.laplace.weight_space`).
        x: test inputs ``(N, ...)`` (flat ``(N, D)`` with the posterior's ``input_shape``).
        method: ``"glm"`` (default), ``"glm_mc"``, ``"mc_glm"`` or ``"nn_sampling"``.
        link: for classification ``"probit"`` (default), ``"bridge"`` (softmax only) or ``"mc"``; must be
            ``None`` for regression.
        num_samples: :math:`S`, draws of :math:`\eta` for the sampling methods, and of :math:`f` for
            ``link="mc"`` with ``"glm"``.
        joint: return the joint covariance across test points (``glm``: a root :math:`R(X)` of
            :math:`J \Sigma J^\top`, memory :math:`O(NCP)`; sampling methods: the root of the samples,
            :math:`O(NCS)`) instead of one :math:`C \times C` block per point.
        step_size: the relative finite-difference step :math:`h` of ``"mc_glm"`` (default
            :func:`default_step_size`).
        finite_difference: ``"central"`` (default) or ``"forward"`` (``"mc_glm"`` only).
        generator: random number generator for the draws (reproducible results).
        progress: over the chunks of test points: ``None`` (default, auto: a bar on a terminal, else one line
            when the pass will be long), ``True`` (a bar) or ``False`` (silent): :mod:`ntkgp.progress`.

    Returns:
        a :class:`Prediction` (distribution over :math:`f`, class probabilities, samples).

    Raises:
        TypeError: for a posterior that is not a :class:`~ntkgp.laplace.weight_space.WeightPosterior`, or arguments of
            the wrong type.
        ValueError: for an unknown ``method``, ``link`` or ``finite_difference``, a link for a regression
            likelihood, ``link="bridge"`` with one logit, non-positive ``num_samples`` or ``step_size``,
            ``num_samples=1`` with ``"nn_sampling"``, or inputs the network does not accept.

    Example:
        >>> posterior = KFACLaplace(net, x_train, y_train, SoftmaxLikelihood(10), prior_precision=1.0)
        >>> prediction = predict(posterior, x_test, method="glm", link="probit")
        >>> prediction.f.variance.shape, prediction.probs.shape
        (torch.Size([1000, 10]), torch.Size([1000, 10]))
    """
    _check_args(posterior, x, num_samples, joint, step_size, generator, progress)
    method = choose(Method, method, "method")
    scheme = choose(FiniteDifference, finite_difference, "finite_difference")
    link = _link_for(posterior.likelihood, link)
    if method is Method.NN_SAMPLING and num_samples < 2:
        raise ValueError("method='nn_sampling' estimates a covariance from samples: num_samples must be >= 2")
    fn = posterior.function
    x = fn.prepare(x)
    chunks = split(x, fn.chunk_size)
    bar = progress_bar(chunks, len(chunks), f"predict ({method.value})", progress, unit="chunk")
    samples = blocks = root = None
    with torch.no_grad():
        mean = torch.cat([fn.forward(xc) for xc in chunks]) if method is not Method.NN_SAMPLING else None
        if method is Method.GLM:
            if joint:
                root = torch.cat([posterior.glm_root(xc) for xc in bar])
            else:
                blocks = torch.cat([posterior.glm_covariance(xc) for xc in bar])
        else:
            eta = posterior.sample(num_samples, generator)
            draws = torch.cat(
                [
                    torch.cat(
                        [
                            _sample_outputs(posterior, xc, e, method, scheme, step_size)
                            for e in eta.split(max(1, SAMPLE_BUDGET // num_rows(xc)))
                        ]
                    )
                    for xc in bar
                ],
                dim=1,
            )
            if method is Method.NN_SAMPLING:
                mean = draws.mean(dim=0)
                deviations, divisor = draws - mean, num_samples - 1
                samples = draws
            else:
                deviations, divisor = draws, num_samples
                samples = mean + draws
            if joint:
                root = deviations.permute(1, 2, 0) / math.sqrt(divisor)  # (N, C, S)
            else:
                blocks = torch.einsum("snc,snd->ncd", deviations, deviations) / divisor
    c = mean.shape[1]
    covariance = _covariance(blocks, None if root is None else root.reshape(-1, root.shape[-1]), c)
    f = (
        MultivariateNormal(mean.reshape(-1), covariance)
        if c == 1
        else (MultitaskMultivariateNormal(mean, covariance, interleaved=True))
    )
    probs = None
    if link is not None:
        blocks = root @ root.mT if blocks is None else blocks
        probs = _probabilities(mean, blocks, samples, link, num_samples, generator)
    return Prediction(
        f=f, probs=probs, samples=samples, method=method.value, link=None if link is None else link.value
    )


def _probabilities(
    mean: Tensor, blocks: Tensor, samples: Tensor | None, link: Link, num_samples: int, generator
) -> Tensor:
    """Class probabilities from the means ``(N, C)`` and per-point blocks ``(N, C, C)`` (module docstring)."""
    binary = mean.shape[1] == 1
    if link is Link.MC and samples is not None:
        return torch.sigmoid(samples[..., 0]).mean(0) if binary else torch.softmax(samples, dim=-1).mean(0)
    variance = blocks.diagonal(dim1=-2, dim2=-1).clamp_min(0)
    if link is Link.PROBIT:
        return sigmoid_probit(mean[:, 0], variance[:, 0]) if binary else softmax_probit(mean, variance)
    if link is Link.BRIDGE:
        return laplace_bridge(mean, variance)
    if binary:
        return sigmoid_monte_carlo(mean[:, 0], variance[:, 0], num_samples, generator)
    return softmax_monte_carlo(mean, blocks, num_samples, generator)
