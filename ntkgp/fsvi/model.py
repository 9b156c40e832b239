r"""``FSVI``: a network with a mean-field Gaussian over its weights, as a GPyTorch model over its outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import GP
from linear_operator.operators import DiagLinearOperator
from torch import Tensor, distributions, nn

from ..botorch import BoTorchInterface
from ..caching import fingerprint
from ..likelihoods import is_gaussian, noise_variance, num_outputs
from ..ntk.outputs import with_output
from ..ntk.private_copy import model_lock
from ..options import KLCovariance, OptionAttribute, Predictive, choice, choose
from ..validation import positive_int, real_number
from .conditioning import Conditioning
from .inputs import NetworkInputs
from .kernel import MeanFieldNTKKernel
from .kl import context_kl
from .linearized import LinearizedNetwork
from .mean import VariationalNetworkMean
from .prior import GaussianParameterPrior
from .variational import MeanFieldGaussian


def _context_jitter(value: object, argument: str) -> float:
    return real_number(value, argument)


class VariationalValues:
    r"""The :math:`\mu` and :math:`s^2` of a :class:`~ntkgp.fsvi.MeanFieldGaussian` as they are now, read by a
    :class:`~ntkgp.fsvi.MeanFieldNTKKernel` in its place: the covariance of ``model(x)`` is that of the moment it was
    made, whatever an optimizer step or a ``.data`` write does afterwards (docs/guarantees.md, "Distributions are
    snapshots"). :math:`\mu` is copied (``P`` numbers; the copy keeps its graph to :math:`\mu` when gradients are
    on), :math:`s^2` is computed now (a new tensor). What the network itself contributes (its buffers and the
    parameters outside :math:`\mu`) is fingerprinted (:func:`~ntkgp.caching.fingerprint`): if it changed, reading
    the covariance raises ``RuntimeError`` instead of mixing.

    Args:
        q: the live variational distribution.
        net: the network.
    """

    def __init__(self, q: MeanFieldGaussian, net: nn.Module) -> None:
        self._means = {n: m.clone() for n, m in q.means().items()}
        self._variances = q.variances()
        self.mean = list(self._means.values())
        self._net, self._names = net, frozenset(q.names)
        self._key = self._held()

    def _held(self) -> Tensor:
        held = [p for n, p in self._net.named_parameters() if n not in self._names]
        return fingerprint([*held, *self._net.buffers()])

    def means(self) -> dict[str, Tensor]:
        r""":math:`\mu` per parameter name, as it was.

        Raises:
            RuntimeError: the network's buffers or parameters outside :math:`\mu` changed since.
        """
        if not torch.equal(self._held(), self._key):
            raise RuntimeError(
                "the network's buffers or frozen parameters changed after this FSVI distribution was made: its "
                "covariance cannot be evaluated at the old ones. Read the distribution before changing the "
                "network, or make it again"
            )
        return dict(self._means)

    def variances(self) -> dict[str, Tensor]:
        r""":math:`s^2` per parameter name, as it was."""
        return dict(self._variances)


class FSVI(Conditioning, NetworkInputs, BoTorchInterface, GP):
    r"""Function-space variational inference (Rudner et al. 2022) for a whole network, as a GPyTorch model.

    The variational distribution over the trainable weights is mean-field Gaussian,
    :math:`q(\theta) = N(\mu, \operatorname{diag}(s^2))` (:class:`~ntkgp.fsvi.MeanFieldGaussian`, initialized from
    the network's weights), the prior :math:`p(\theta) = N(\mu_0, \operatorname{diag}(s_0^2))`
    (:class:`~ntkgp.fsvi.GaussianParameterPrior`). Linearizing the network about :math:`\mu` gives the model's
    distribution over outputs, a GP:

    .. math:: f(\cdot) \sim GP\big(f(\cdot\,; \mu),\; J_\mu(\cdot) \operatorname{diag}(s^2) J_\mu(\cdot)^\top\big),

    with mean :class:`~ntkgp.fsvi.VariationalNetworkMean` and kernel :class:`~ntkgp.fsvi.MeanFieldNTKKernel`.
    ``model(x)`` returns it (a ``MultivariateNormal`` for ``C = 1``, else an interleaved
    ``MultitaskMultivariateNormal`` of shape ``(N, C)``), in train and eval mode alike; its covariance is lazy,
    so ``.variance`` costs one forward and backward pass per chunk. Inputs ``(*batch, N, D)`` (GPyTorch's batch
    mode, e.g. BoTorch's ``(b, q, d)``) give a distribution of batch shape ``batch``, one joint Gaussian per
    element (docs/fsvi.md, "The result as a GPyTorch model", says how inputs of more dimensions are read).
    ``model.likelihood(model(x))`` is the linearized predictive over ``y``; :meth:`predict` with ``method="mc"``
    is the paper's predictive, Monte Carlo over :math:`\theta \sim q` through the network itself.

    :meth:`condition_on` (BoTorch: ``condition_on_observations``, ``fantasize``) returns a new model whose
    ``model(x)`` is the exact posterior of this GP given further observations under a Gaussian likelihood's
    noise, without retraining (docs/fsvi.md, "Conditioning on new observations").

    Train it with :func:`~ntkgp.fsvi.train_fsvi` (or your own loop over :class:`~ntkgp.fsvi.FunctionSpaceELBO`).
    The network is held by reference and never modified: ``model.parameters()`` are :math:`\mu` and the raw
    standard deviations (``variational_distribution.*``; :math:`s \le s_0`, see
    :class:`~ntkgp.fsvi.MeanFieldGaussian`) and the likelihood's; the prior lives in buffers.

    Args:
        net: the network ``(N, *input_shape) → (N, C)``; BatchNorm and dropout in eval mode.
        likelihood: ``GaussianLikelihood``, ``MultitaskGaussianLikelihood(rank=0)``,
            :class:`~ntkgp.likelihoods.LogisticLikelihood` or :class:`~ntkgp.likelihoods.SoftmaxLikelihood`.
        prior_precision: :math:`\delta`, float or one value per group; :math:`s_0^2 = 1/\delta_g`.
        prior_structure: prior groups: ``"network"``, ``"layer"`` (default), ``"parameter"`` or a mapping.
        prior_mean: ``"zero"`` (default), ``"initial"`` or a mapping name → tensor, see
            :class:`~ntkgp.fsvi.GaussianParameterPrior`.
        prior_linearization: ``"variational_mean"`` (default) or ``"prior_mean"`` (the paper's equation).
        init_std: initial :math:`s` of every weight (below the prior's :math:`s_0`).
        input_shape: the shape of one input as the network expects it (inputs with more than one feature
            dimension are flattened for GPyTorch and reshaped for the network; inferred from the first such input).
        strategy: ``"auto"`` (structured route for linear layers) or ``"contraction"``.
        chunk_size: examples per chunk when predicting.
        context_jitter: :math:`\tau`, the relative variance of a noise shared by both Gaussians of the
            function-space KL: :math:`\tau \bar\sigma_p^2 I` (:math:`\bar\sigma_p^2` the mean prior variance at the
            context points, held constant within a step: no gradient flows through it, or inflating the prior's
            variance would lower the KL) is added to both covariances, so that a direction contributes at most
            :math:`\tfrac12 \log(1 + \sigma_p^2 / \tau\bar\sigma_p^2)`. ``0`` gives the exact KL. The noise is
            needed because (1) the linearized covariances are singular whenever ``K·C`` exceeds their rank (a
            ReLU network is affine between its kinks, so context points share few Jacobian directions), and (2)
            with the prior linearized about :math:`\mu`, a network whose Jacobian collapses (all ReLUs off) makes
            both covariances low-rank and the exact KL rewards it: on two moons with a ReLU network,
            :math:`\tau \le 10^{-3}` ended in a constant classifier, :math:`10^{-2}` (the default) did not. With a
            Gaussian likelihood the data pin the network, and a near-exact KL (``1e-6``) gives the larger
            in-between uncertainty (docs/fsvi.md, "Context jitter").
        kl_covariance: which covariance over the ``K·C`` context outputs the KL keeps: ``"full"`` (default: the
            exact KL of the linearized Gaussians), ``"block"`` (each point's ``C`` outputs jointly, points
            independent) or ``"diagonal"`` (every output independent, as the public JAX code of FSVI does by
            default). The last two cost :math:`O(K)` instead of :math:`O(K^2)` per layer (docs/fsvi.md, "Which
            covariance the KL keeps").
        output: for a network returning a dict or a tuple, the key or index of the output to use
            (:mod:`ntkgp.ntk.outputs`).

    ``context_jitter`` and ``kl_covariance`` may be assigned afterwards (validated as here; the next KL uses
    them, as a model built with them would); ``model.prior.prior_linearization`` cannot be changed.

    Example:
        >>> model = FSVI(net, SoftmaxLikelihood(10), prior_precision=1.0)
        >>> probs = model.predict(x_test, method="mc", num_samples=100).probs
    """

    context_jitter = OptionAttribute(_context_jitter, on_change="_option_changed")
    kl_covariance = OptionAttribute(choice(KLCovariance), on_change="_option_changed")

    def __init__(
        self,
        net: nn.Module,
        likelihood: Likelihood,
        prior_precision: float | Tensor = 1.0,
        prior_structure: str | Mapping[str, str] = "layer",
        prior_mean: str | Mapping[str, Tensor] = "zero",
        prior_linearization: str = "variational_mean",
        init_std: float = 1e-3,
        input_shape: Sequence[int] | None = None,
        strategy: str = "auto",
        chunk_size: int = 256,
        context_jitter: float = 1e-2,
        kl_covariance: str = "full",
        output: str | int | None = None,
    ) -> None:
        net = with_output(net, output)  # a network returning a dict or tuple: its output output= (ntkgp.ntk.outputs)
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
        num_outputs(likelihood)  # raises for unsupported likelihoods
        context_jitter = _context_jitter(context_jitter, "context_jitter")
        kl_covariance = choose(KLCovariance, kl_covariance, "kl_covariance")
        linearized = LinearizedNetwork(net, input_shape=input_shape, strategy=strategy, chunk_size=chunk_size)
        prior = GaussianParameterPrior(net, prior_precision, prior_structure, prior_mean, prior_linearization)
        variational = MeanFieldGaussian(net, init_std, max_std={n: v.sqrt() for n, v in prior.variances().items()})
        super().__init__()
        self.likelihood = likelihood
        self.variational_distribution = variational
        self.prior = prior
        self.linearized = linearized
        self.mean_module = VariationalNetworkMean(linearized, variational)
        self.covar_module = MeanFieldNTKKernel(linearized, variational)
        self.context_jitter = context_jitter
        self.kl_covariance = kl_covariance
        self._init_conditioning()

    def _option_changed(self, name: str) -> None:
        """Nothing is cached from ``context_jitter`` or ``kl_covariance``: every KL reads them."""

    # ------------------------------------------------------------------ basic properties
    @property
    def net(self) -> nn.Module:
        """The network (held by reference, never modified)."""
        return self.linearized.net

    @property
    def num_outputs(self) -> int:
        """C, the number of network outputs (what the likelihood expects)."""
        return num_outputs(self.likelihood)

    def named_variational_parameters(self):
        r""":math:`\mu` and the raw :math:`s` (GPyTorch's split: ``model.variational_parameters()``)."""
        yield from self.variational_distribution.named_parameters(prefix="variational_distribution")

    def named_hyperparameters(self):
        """Every other parameter (the likelihood's): ``model.hyperparameters()``."""
        variational = {id(p) for p in self.variational_distribution.parameters()}
        for name, p in self.named_parameters():
            if id(p) not in variational:
                yield name, p

    # ------------------------------------------------------------------ the GP
    def _mvn(self, mean: Tensor, covar) -> MultivariateNormal:
        if self.num_outputs == 1:
            return MultivariateNormal(mean, covar)
        return MultitaskMultivariateNormal(mean, covar, interleaved=True)

    def forward(self, x: Tensor) -> MultivariateNormal:
        r""":math:`q(f(x)) = N(f(x; \mu), J_\mu(x) \operatorname{diag}(s^2) J_\mu(x)^\top)`, lazy covariance; on a
        conditioned model (:meth:`condition_on`) its exact posterior given the observations. The covariance is
        evaluated at the :math:`\mu` and :math:`s` of this call (:class:`VariationalValues`), whenever it is read."""
        return self._distribution(x)

    def _kernel_now(self) -> MeanFieldNTKKernel:
        r"""The covariance kernel at :math:`\mu` and :math:`s` as they are now (what a lazy covariance reads later)."""
        return MeanFieldNTKKernel(self.linearized, VariationalValues(self.variational_distribution, self.net))

    def __call__(self, x: Tensor) -> MultivariateNormal:
        x = self._flat(x)
        with model_lock(self):  # one prediction (and cache fill) at a time per model: docs/guarantees.md, "Threads"
            self._check_outputs(x)
            return super().__call__(x)

    # ------------------------------------------------------------------ function-space KL
    def function_space_kl(self, x_context: Tensor) -> Tensor:
        r"""KL from the prior to the variational distribution over the outputs at context points,
        :math:`\mathrm{KL}(q(f_C) \,\|\, p(f_C))` on the ``K·C`` outputs (docs/fsvi.md, "The function-space KL").

        .. math::
            q(f_C) = N\big(f(X_C; \mu),\, J_\mu \operatorname{diag}(s^2) J_\mu^\top\big), \qquad
            p(f_C) = N\big(f(X_C; \theta_p) + J_{\theta_p}(\mu_0 - \theta_p),\,
                J_{\theta_p} \operatorname{diag}(s_0^2) J_{\theta_p}^\top\big),

        the prior linearized about :math:`\theta_p = \mu` (default) or :math:`\mu_0` (``prior_linearization``; its
        mean is then :math:`f(X_C; \mu_0)`). About :math:`\mu` the mean difference is :math:`J_\mu(\mu - \mu_0)`, one
        product with the same features. The covariances come from the structured form
        (:class:`~ntkgp.fsvi.linearized.LinearizedNetwork`), never from ``J``; about :math:`\mu` both share one
        forward and one backward pass. With ``kl_covariance="block"`` both Gaussians keep only their ``K`` blocks
        ``C × C`` (the KL is the sum of the points' KLs), with ``"diagonal"`` only their variances (the sum of
        ``K·C`` one-dimensional KLs). Differentiable in :math:`\mu` and :math:`s`.

        Args:
            x_context: ``K`` context inputs ``(K, ...)``.

        Returns:
            A 0-dim tensor.
        """
        flat = self._flat(x_context, "x_context", batch=False)
        self._check_outputs(flat, "x_context")
        x = self.prepare(flat, "x_context")
        return context_kl(self.linearized, self.variational_distribution, self.prior, x, self.kl_covariance,
                          self.context_jitter)

    # ------------------------------------------------------------------ Monte Carlo over weights
    def function_samples(
        self, x: Tensor, num_samples: int = 100, generator: torch.Generator | None = None
    ) -> Tensor:
        r"""Network outputs :math:`f(x; \theta_s)` for draws :math:`\theta_s \sim q(\theta)`: shape ``(S, N, C)``
        (``(S, N)`` for ``C = 1``); inputs ``(*batch, N, D)`` give ``(S, *batch, N, C)``, every batch element under
        the same draws. Differentiable in :math:`\mu`, :math:`s` when gradients are enabled.

        On a conditioned model (:meth:`condition_on`) each draw is first updated by Matheron's rule in weight
        space (:class:`~ntkgp.fsvi.conditioning.MatheronUpdate`; docs/fsvi.md, "Conditioning on new
        observations"): with :math:`\epsilon \sim N(0, \Sigma)` the observation noise,

        .. math::
            \theta' = \theta + \operatorname{diag}(s^2) J_\mu(X)^\top (K(X, X) + \Sigma)^{-1}
                \big(Y - f(X; \mu) - J_\mu(X)(\theta - \mu) - \epsilon\big),

        and the outputs are :math:`f(x; \theta')`. For a network linear in :math:`\theta` these are exact draws
        from the conditioned GP ``model(x)``; otherwise they are the linear-Gaussian update of :math:`q` given the
        observations, pushed through the network.
        """
        num_samples = positive_int(num_samples, "num_samples")
        flat = self._flat(x)
        self._check_outputs(flat)
        x = self.prepare(flat.reshape(-1, flat.shape[-1]))
        q = self.variational_distribution
        if self._observed is None:
            thetas = (q.sample(generator) for _ in range(num_samples))
        else:
            update = self._matheron()
            thetas = (update(q.sample(generator), update.noise(generator)) for _ in range(num_samples))
        samples = torch.stack([self.linearized.forward(theta, x) for theta in thetas])
        samples = samples.view(num_samples, *flat.shape[:-1], samples.shape[-1])
        return samples.squeeze(-1) if samples.shape[-1] == 1 else samples

    def predict(
        self,
        x: Tensor,
        method: str = "mc",
        num_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> distributions.Distribution:
        r"""The predictive distribution over ``y`` at ``x``.

        * ``method="mc"`` (default, the paper's predictive): Monte Carlo over :math:`\theta_s \sim q` through the
          network. Classification: ``Bernoulli`` / ``Categorical`` with probabilities
          :math:`\frac1S \sum_s \operatorname{link}(f(x; \theta_s))`. Gaussian likelihoods: the moment-matched
          Gaussian (mean and variance of the samples plus the noise variance), a ``MultivariateNormal`` with
          diagonal covariance (``MultitaskMultivariateNormal`` for ``C > 1``).
        * ``method="linearized"``: ``likelihood(model(x))``, the linearized GP through the likelihood (probit
          or the likelihood's own approximation for classes; Gaussian noise added for regression).

        On a conditioned model (:meth:`condition_on`, Gaussian likelihoods only) ``"linearized"`` is the exact
        posterior of the linearized GP plus the noise, and ``"mc"`` uses draws conditioned by Matheron's rule in
        weight space (:meth:`function_samples`): exact for a network linear in its weights, otherwise the
        linear-Gaussian update of :math:`q` given the observations pushed through the network.

        Args:
            x: inputs ``(N, ...)`` or ``(*batch, N, D)``.
            method: ``"mc"`` or ``"linearized"``.
            num_samples: ``S`` for ``"mc"``.
            generator: random number generator for ``"mc"``.
        """
        method = choose(Predictive, method, "method")
        if method is Predictive.LINEARIZED:
            return self.likelihood(self(x))
        samples = self.function_samples(x, num_samples, generator)
        if is_gaussian(self.likelihood):
            mean, var = samples.mean(0), samples.var(0, unbiased=False)
            noise = noise_variance(self.likelihood).to(var)
            c = self.num_outputs
            var = var + noise if c > 1 else var + noise.squeeze(-1)
            return self._mvn(mean, DiagLinearOperator(var.flatten(-2) if c > 1 else var))
        conditional = self.likelihood(samples)
        return type(conditional)(probs=conditional.probs.mean(0))

    # ------------------------------------------------------------------ BoTorch
    def posterior(
        self,
        X: Tensor,
        output_indices: Sequence[int] | None = None,
        observation_noise: bool | Tensor = False,
        posterior_transform=None,
        **kwargs,
    ):
        r"""BoTorch's ``Model.posterior``: the linearized GP over :math:`f` at ``X`` as a ``GPyTorchPosterior``.

        ``X`` of shape ``(*batch, q, d)`` (flat inputs; ``d`` the product of ``input_shape``) gives ``batch``
        joint distributions over ``q`` points, mean ``(*batch, q, m)``, each that of ``model(X[b])``. BoTorch's
        acquisition functions (``LogExpectedImprovement``, ``UpperConfidenceBound``, ...) and ``optimize_acqf``
        take the model itself (:func:`ntkgp.botorch.botorch_posterior`; BoTorch is imported only here). On a
        conditioned model it is the conditioned GP (the factorization computed once for all batch elements).
        ``condition_on_observations(X, Y)`` is :meth:`condition_on` (``Y`` of shape ``(n, m)``; with batch
        dimensions a :class:`~ntkgp.botorch.FantasyModel`) and ``fantasize(X, sampler)`` conditions on
        observations sampled from this posterior with the noise (:class:`~ntkgp.botorch.BoTorchInterface`);
        both need a Gaussian likelihood.

        Args:
            X: inputs ``(*batch, q, d)``.
            output_indices: outputs to keep (default all).
            observation_noise: ``True`` adds the Gaussian likelihood's noise; a tensor adds those variances.
            posterior_transform: applied to the posterior, as BoTorch does.

        Raises:
            ImportError: without BoTorch.
            TypeError, ValueError: for invalid inputs.
        """
        from ..botorch import botorch_posterior

        if kwargs:
            raise TypeError(f"posterior got unexpected keyword arguments {sorted(kwargs)}")
        return botorch_posterior(self, self._flat(X, "X"), output_indices, observation_noise, posterior_transform)
