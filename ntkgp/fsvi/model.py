r"""``FSVI``: a network with a mean-field Gaussian over its weights, as a GPyTorch model over its outputs."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import GP
from linear_operator.operators import DiagLinearOperator, RootLinearOperator
from torch import Tensor, distributions, nn

from ..botorch import BoTorchInterface
from ..caching import ValueCache
from ..likelihoods import is_gaussian, noise_variance, num_outputs, validate_targets
from ..linalg import cholesky
from ..ntk.checks import OutputShapeError, check_fits
from ..options import choose
from .kernel import MeanFieldNTKKernel
from .kl import gaussian_kl
from .linearized import LinearizedNetwork
from .mean import VariationalNetworkMean
from .options import KLCovariance, Predictive, PriorLinearization
from .prior import GaussianParameterPrior
from .variational import MeanFieldGaussian


def _check_num_samples(num_samples: object) -> int:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    return num_samples


def _diagonal_kl(mean_q: Tensor, var_q: Tensor, mean_p: Tensor, var_p: Tensor) -> Tensor:
    r""":math:`\sum_i \mathrm{KL}(N(m_{q,i}, v_{q,i}) \,\|\, N(m_{p,i}, v_{p,i}))
    = \tfrac12 \sum_i \big[v_{q,i}/v_{p,i} + (m_{q,i} - m_{p,i})^2/v_{p,i} - 1 + \log v_{p,i} - \log v_{q,i}\big]`."""
    for name, v in (("the variational variances", var_q), ("the prior variances", var_p)):
        if not (v > 0).all():
            raise ValueError(f"{name} at the context points include zeros: the KL is undefined (use context_jitter > 0)")
    return 0.5 * (var_q / var_p + (mean_q - mean_p).square() / var_p - 1 + var_p.log() - var_q.log()).sum()


class FSVI(BoTorchInterface, GP):
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
        **kwargs: ``groups=`` (deprecated name of ``prior_structure``).

    Example:
        >>> model = FSVI(net, SoftmaxLikelihood(10), prior_precision=1.0)
        >>> probs = model.predict(x_test, method="mc", num_samples=100).probs
    """

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
        **kwargs,
    ) -> None:
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
        num_outputs(likelihood)  # raises for unsupported likelihoods
        if isinstance(context_jitter, bool) or not isinstance(context_jitter, (int, float)) or not (
            0 <= context_jitter < math.inf
        ):
            raise ValueError(f"context_jitter must be a non-negative number, got {context_jitter!r}")
        kl_covariance = choose(KLCovariance, kl_covariance, "kl_covariance")
        linearized = LinearizedNetwork(net, input_shape=input_shape, strategy=strategy, chunk_size=chunk_size)
        prior = GaussianParameterPrior(net, prior_precision, prior_structure, prior_mean, prior_linearization, **kwargs)
        variational = MeanFieldGaussian(net, init_std, max_std={n: v.sqrt() for n, v in prior.variances().items()})
        super().__init__()
        self.likelihood = likelihood
        self.variational_distribution = variational
        self.prior = prior
        self.linearized = linearized
        self.mean_module = VariationalNetworkMean(linearized, variational)
        self.covar_module = MeanFieldNTKKernel(linearized, variational)
        self.context_jitter = float(context_jitter)
        self.kl_covariance = kl_covariance
        self._observed: tuple[Tensor, Tensor] | None = None  # (x (M, D) flat, y (M, C)) after condition_on
        self._conditioning_cache = ValueCache(size=1)

    # ------------------------------------------------------------------ basic properties
    @property
    def net(self) -> nn.Module:
        """The network (held by reference, never modified)."""
        return self.linearized.net

    @property
    def num_outputs(self) -> int:
        """C, the number of network outputs (what the likelihood expects)."""
        return num_outputs(self.likelihood)

    def _reference(self) -> Tensor:
        return self.variational_distribution.mean[0]

    def _flat(self, x: Tensor, argument: str = "x", batch: bool = True) -> Tensor:
        """GPyTorch's ``(*batch, N, D)`` form of ``x`` (``D`` the product of ``input_shape``); ``batch=False``
        allows only ``(N, D)``. Checked before anything changes.

        Inputs ``(*batch, N, *input_shape)`` are flattened. While the input shape is unknown, an input with more
        than two dimensions is a batch of flat inputs if the network takes rows of its last dimension (one row is
        tried), else one set of inputs ``(N, *input_shape)`` (images): that fixes ``input_shape``, once the network
        was seen to take ``x[:1]``."""
        if not isinstance(x, Tensor):
            raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{argument} must have shape (N, ...) with a feature dimension, got {tuple(x.shape)}")
        shape = self.linearized.input_shape
        if shape is None and x.dim() > 2 and not self._takes_rows(x):
            shape = tuple(x.shape[1:])
            self._fits(self.prepare(x[:1], argument), argument)
            self.linearized.input_shape = shape
        if shape is not None and len(shape) > 1 and x.dim() > len(shape) and tuple(x.shape[-len(shape) :]) == shape:
            x = x.flatten(-len(shape))
        if shape is not None and x.shape[-1] != math.prod(shape):
            image = f" or (*batch, N, {', '.join(map(str, shape))})" if len(shape) > 1 else ""
            raise ValueError(
                f"{argument} must have shape (*batch, N, {math.prod(shape)}){image}, got {tuple(x.shape)}"
            )
        if not batch and x.dim() > 2:
            raise ValueError(f"{argument} must have shape (N, ...) without batch dimensions, got {tuple(x.shape)}")
        return x

    def _check_outputs(self, x: Tensor, argument: str = "x") -> None:
        """Raise unless the network gives the likelihood's number of outputs (one forward pass of one row of the
        flat ``x``, the first time; the routes are planned on it)."""
        row = self.prepare(x.reshape(-1, x.shape[-1])[:1], argument)
        c = self.linearized.num_outputs(self.variational_distribution.means(), row)
        if c != self.num_outputs:
            raise ValueError(
                f"net has {c} outputs but the likelihood {type(self.likelihood).__name__} expects {self.num_outputs}"
            )

    def _fits(self, x: Tensor, argument: str, num_outputs: int | None = None) -> int:
        r""":func:`~ntkgp.ntk.checks.check_fits` at :math:`\mu`: the network takes ``x[:1]`` (prepared) and gives
        ``(1, C)`` (``num_outputs`` if given); returns ``C``."""
        means = {n: t.detach() for n, t in self.variational_distribution.means().items()}
        return check_fits(self.net, means, x, argument, num_outputs)

    def _takes_rows(self, x: Tensor) -> bool:
        """Whether the network maps one row of ``x``'s last dimension, ``(1, x.shape[-1])``, to ``(1, C)``."""
        row = x.detach().reshape(-1, x.shape[-1])[:1]
        try:
            self._fits(self.prepare(row), "x")
        except (ValueError, TypeError):
            return False
        return True

    def prepare(self, x: Tensor, argument: str = "x") -> Tensor:
        """``x`` in the network's shape, dtype and device (a copy only if needed)."""
        return self.linearized.prepare(x, self._reference(), argument)

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
        conditioned model (:meth:`condition_on`) its exact posterior given the observations."""
        return self._distribution(x, None if self._observations is None else self._conditioning())

    def _distribution(self, x: Tensor, state: tuple[Tensor, Tensor, Tensor] | None) -> MultivariateNormal:
        r"""The GP at flat inputs ``x``; with ``state = (X, L, α)`` (:meth:`_conditioning`) conditioned on the
        observations: mean :math:`m(x) + K(x, X) \alpha`, covariance :math:`K(x, x) - A^\top A` with
        :math:`A = L^{-1} K(X, x)` (lazy: the diagonal never forms the ``(N·C)²`` matrix)."""
        mean, covar = self.mean_module(x), self.covar_module(x)
        if state is None:
            return self._mvn(mean, covar)
        x_obs, factor, alpha = state
        cross = self.covar_module(x, x_obs).to_dense()  # K(x, X), (N·C, M·C), interleaved
        root = torch.linalg.solve_triangular(factor, cross.mT, upper=False)  # L⁻¹ K(X, x), (M·C, N·C)
        mean = mean + (cross @ alpha).reshape(mean.shape)
        return self._mvn(mean, covar - RootLinearOperator(root.mT))

    def __call__(self, x: Tensor) -> MultivariateNormal:
        x = self._flat(x)
        self._check_outputs(x)
        return super().__call__(x)

    # ------------------------------------------------------------------ conditioning
    @property
    def _observations(self) -> tuple[Tensor, Tensor] | None:
        return getattr(self, "_observed", None)  # models pickled before conditioning existed have none

    @property
    def observations(self) -> tuple[Tensor, Tensor] | None:
        """The observations this model is conditioned on: ``(x, y)`` of shapes ``(M, D)`` (inputs flattened) and
        ``(M, C)``, detached copies, or ``None`` for a model that was not conditioned."""
        if self._observations is None:
            return None
        return tuple(t.detach().clone() for t in self._observations)

    def _check_observations(self, x_new: Tensor, y_new: Tensor) -> tuple[Tensor, Tensor, tuple[int, ...] | None]:
        """``x_new`` flat ``(M, D)`` and ``y_new`` ``(M, C)`` in the model's dtype (copies), and the input shape
        that images fix; everything is checked here, before anything is built."""
        if not is_gaussian(self.likelihood):
            raise NotImplementedError(
                f"condition_on needs a Gaussian likelihood (GaussianLikelihood or MultitaskGaussianLikelihood); "
                f"under {type(self.likelihood).__name__} the observations are not Gaussian in f, so the linearized "
                "GP has no closed-form posterior given them. Train on the union of the data instead."
            )
        if not isinstance(x_new, Tensor):
            raise TypeError(f"x_new must be a torch.Tensor, got {type(x_new).__name__}")
        if not x_new.is_floating_point():
            raise TypeError(f"x_new must be a floating-point tensor, got dtype {x_new.dtype}")
        if x_new.dim() < 2 or x_new.shape[0] == 0:
            raise ValueError(
                "x_new must have shape (M, ...) with M >= 1 and a feature dimension (no batch dimensions; "
                f"condition_on_observations handles fantasy batches), got {tuple(x_new.shape)}"
            )
        if not isinstance(y_new, Tensor):
            raise TypeError(f"y_new must be a torch.Tensor, got {type(y_new).__name__}")
        if y_new.is_complex():
            raise TypeError(f"y_new must be a real tensor, got dtype {y_new.dtype}")
        reference = self._reference()
        c = self.num_outputs
        x = self.prepare(x_new, "x_new")  # finite values, the input shape, the model's dtype
        y = validate_targets(self.likelihood, y_new, c, num_data=x.shape[0], name="y_new")  # (M, C), finite
        try:  # the network takes x_new and gives C outputs
            self._fits(x.detach(), "x_new", c)
        except OutputShapeError as error:
            raise ValueError(
                f"x_new of shape {tuple(x_new.shape)} does not give one row of network outputs per input ({error}); "
                "x_new must have shape (M, ...) without batch dimensions"
            ) from error
        input_shape = tuple(x.shape[1:]) if x.dim() > 2 and self.linearized.input_shape is None else None
        x = x.flatten(1)
        if self._observations is not None and x.shape[1] != self._observations[0].shape[1]:
            raise ValueError(
                f"x_new has {x.shape[1]} features per input (flattened), the observations this model is "
                f"conditioned on {self._observations[0].shape[1]}"
            )
        return x.clone(), y.to(reference).clone(), input_shape

    def condition_on(self, x_new: Tensor, y_new: Tensor) -> FSVI:
        r"""A new model: this one's linearized GP conditioned on ``(x_new, y_new)`` under the likelihood's noise.

        Exact GP regression with this model as the prior, :math:`\mu`, :math:`s` and the noise fixed (nothing is
        retrained). With :math:`K(x, x') = J_\mu(x) \operatorname{diag}(s^2) J_\mu(x')^\top`, :math:`m(x) =
        f(x; \mu)`, the observed inputs :math:`X` and targets :math:`Y` (``M·C`` values in GPyTorch's interleaved
        order) and :math:`\Sigma` the noise variance of each task (``noise``, or ``task_noises`` plus the global
        ``noise``), the new model's ``model(x)`` is

        .. math::
            N\big(m(x) + K(x, X) (K(X, X) + \Sigma)^{-1} (Y - m(X)),\;
                K(x, x') - K(x, X) (K(X, X) + \Sigma)^{-1} K(X, x')\big),

        from a Cholesky factor of :math:`K(X, X) + \Sigma` (jitter only if that fails, with a warning) and the
        structured cross-covariances :math:`K(x, X)` (never the Jacobian). Conditioning a conditioned model
        adds to its observations: the result equals conditioning the original once on all of them.

        The new model holds copies of :math:`\mu`, :math:`s`, the prior and the likelihood (this model is
        unchanged; changing one does not change the other) and the same network (shared, never modified). Its
        factorization is recomputed from the current values whenever :math:`\mu`, :math:`s`, the noise or the
        network's fixed weights and buffers change (e.g. after an optimizer step); it is reused between calls
        only when no gradient with respect to them is needed (under ``torch.no_grad()``, or with
        ``requires_grad_(False)``), keyed by their values. The observations keep their autograd graph:
        gradients flow to ``x_new`` (as BoTorch's look-ahead acquisition functions need).

        On the new model ``model(x)``, ``predict(x, method="linearized")`` and :meth:`posterior` are
        conditioned. ``predict(x, method="mc")`` and :meth:`function_samples` are too, by Matheron's rule in
        weight space: each draw :math:`\theta \sim q` with noise :math:`\epsilon \sim N(0, \Sigma)` becomes
        :math:`\theta' = \theta + \operatorname{diag}(s^2) J_\mu(X)^\top (K(X, X) + \Sigma)^{-1}
        (Y - f(X; \mu) - J_\mu(X)(\theta - \mu) - \epsilon)`, then goes through the network (exact draws from
        the conditioned GP for a network linear in :math:`\theta`; otherwise the linear-Gaussian update of
        :math:`q` pushed through the network). :meth:`function_space_kl` is still the KL of :math:`q`.

        Args:
            x_new: new inputs ``(M, D)`` or ``(M, *input_shape)``, floating point, finite.
            y_new: their targets ``(M, C)`` (``(M,)`` for one output), finite.

        Returns:
            A new :class:`FSVI`, in the same train/eval mode.

        Raises:
            NotImplementedError: for a classification likelihood.
            TypeError: for a non-tensor or non-floating ``x_new``, a non-tensor or complex ``y_new``.
            ValueError: for shapes (no batch dimensions), non-finite values, inputs that do not fit the network, a
                number of outputs that does not match, naming the argument.
        """
        x, y, input_shape = self._check_observations(x_new, y_new)
        if self._observations is not None:
            x_old, y_old = self._observations
            x, y = torch.cat([x_old.to(x), x]), torch.cat([y_old.to(y), y])
        # the network is shared, never copied: LinearizedNetwork.__deepcopy__ keeps the reference
        memo = {id(self._conditioning_cache): ValueCache(size=1)}
        if self._observations is not None:
            memo[id(self._observed)] = None  # replaced below (may hold an autograd graph: not deep-copyable)
        new = copy.deepcopy(self, memo)
        if input_shape is not None:
            new.linearized.input_shape = input_shape
        new._observed = (x, y)
        return new

    def _conditioning(self) -> tuple[Tensor, Tensor, Tensor]:
        r"""``(X, L, α)``: the observed inputs in the model's dtype, the lower Cholesky factor :math:`L` of
        :math:`K(X, X) + \Sigma` and :math:`\alpha = (K(X, X) + \Sigma)^{-1} (Y - m(X))`, at the current
        :math:`\mu`, :math:`s` and noise.

        Differentiable (and recomputed at every call) when gradients are enabled and one of those, or the
        observations, requires grad; otherwise computed without a graph and cached, keyed by the values of
        everything it depends on, so a change is never missed."""
        x_obs, y_obs = self._observations
        q = self.variational_distribution
        noise = noise_variance(self.likelihood)
        names = set(self.linearized.names)
        fixed = [t for n, t in self.net.named_parameters() if n not in names]
        state = [*q.means().values(), *q.variances().values(), noise, *fixed, *self.net.buffers()]

        def compute() -> tuple[Tensor, Tensor, Tensor]:
            reference = self._reference()
            x, y = x_obs.to(reference), y_obs.to(reference)
            residual = (y - self.mean_module(x).reshape(y.shape)).reshape(-1)
            k = self.covar_module(x).to_dense()
            sigma = noise.to(k).repeat(x.shape[0])  # interleaved: entry m·C + c is task c's noise
            factor = cholesky(k + torch.diag(sigma), name="K(X, X) + noise of the observations")
            return x, factor, torch.cholesky_solve(residual[:, None], factor)[:, 0]

        if torch.is_grad_enabled() and any(t.requires_grad for t in [*state, x_obs, y_obs]):
            return compute()
        with torch.no_grad():  # nothing kept holds a graph (the kernel's features build one internally)
            return self._conditioning_cache.get_or_compute("conditioning", [x_obs, y_obs], compute, state)

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
        lin, q, p = self.linearized, self.variational_distribution, self.prior
        grad = torch.is_grad_enabled()
        kind = self.kl_covariance
        means = q.means()
        feats = lin.features(means, x, create_graph=grad)
        if p.linearization is PriorLinearization.VARIATIONAL_MEAN:
            feats_p = feats
            # m_q - m_p = f(X; μ) - [f(X; μ) + J_μ (μ0 - μ)] = J_μ (μ - μ0)
            prior_means = p.means()
            mean_q = lin.jvp(feats, {n: means[n] - prior_means[n] for n in means})
            mean_p = torch.zeros_like(mean_q)
        else:
            feats_p = lin.features(p.means(), x, create_graph=False)
            mean_q, mean_p = feats.outputs, feats_p.outputs
        pairs = ((feats, q.variances()), (feats_p, p.variances()))
        if kind is KLCovariance.FULL:
            cov_q, cov_p = (lin.covariance_from_features(f, v) for f, v in pairs)
            mean_q, mean_p = mean_q.reshape(-1), mean_p.reshape(-1)
        else:  # (K, C, C) blocks, or (K, C) variances
            only = kind is KLCovariance.DIAGONAL
            cov_q, cov_p = (lin.blocks_from_features(f, v, variances_only=only) for f, v in pairs)
        if self.context_jitter > 0:
            # a constant of the step: τ times the mean prior variance at the context points
            prior_variances = cov_p if kind is KLCovariance.DIAGONAL else cov_p.diagonal(dim1=-2, dim2=-1)
            noise = self.context_jitter * prior_variances.mean().detach()
            if kind is not KLCovariance.DIAGONAL:
                noise = noise * torch.eye(cov_p.shape[-1], dtype=cov_p.dtype, device=cov_p.device)
            cov_q, cov_p = cov_q + noise, cov_p + noise
        if kind is KLCovariance.DIAGONAL:
            return _diagonal_kl(mean_q, cov_q, mean_p, cov_p)
        return gaussian_kl(mean_q, cov_q, mean_p, cov_p).sum()

    # ------------------------------------------------------------------ Monte Carlo over weights
    def function_samples(
        self, x: Tensor, num_samples: int = 100, generator: torch.Generator | None = None
    ) -> Tensor:
        r"""Network outputs :math:`f(x; \theta_s)` for draws :math:`\theta_s \sim q(\theta)`: shape ``(S, N, C)``
        (``(S, N)`` for ``C = 1``); inputs ``(*batch, N, D)`` give ``(S, *batch, N, C)``, every batch element under
        the same draws. Differentiable in :math:`\mu`, :math:`s` when gradients are enabled.

        On a conditioned model (:meth:`condition_on`) each draw is first updated by Matheron's rule in weight
        space (:class:`_MatheronUpdate`, docs/fsvi.md, "Conditioning on new observations"): with
        :math:`\epsilon \sim N(0, \Sigma)` the observation noise,

        .. math::
            \theta' = \theta + \operatorname{diag}(s^2) J_\mu(X)^\top (K(X, X) + \Sigma)^{-1}
                \big(Y - f(X; \mu) - J_\mu(X)(\theta - \mu) - \epsilon\big),

        and the outputs are :math:`f(x; \theta')`. For a network linear in :math:`\theta` these are exact draws
        from the conditioned GP ``model(x)``; otherwise they are the linear-Gaussian update of :math:`q` given the
        observations, pushed through the network.
        """
        num_samples = _check_num_samples(num_samples)
        flat = self._flat(x)
        self._check_outputs(flat)
        x = self.prepare(flat.reshape(-1, flat.shape[-1]))
        q = self.variational_distribution
        if self._observations is None:
            thetas = (q.sample(generator) for _ in range(num_samples))
        else:
            update = self._matheron()
            thetas = (update(q.sample(generator), update.noise(generator)) for _ in range(num_samples))
        samples = torch.stack([self.linearized.forward(theta, x) for theta in thetas])
        samples = samples.view(num_samples, *flat.shape[:-1], samples.shape[-1])
        return samples.squeeze(-1) if samples.shape[-1] == 1 else samples

    def _matheron(self) -> _MatheronUpdate:
        """Matheron's rule in weight space for this conditioned model, at the current μ, s and noise."""
        x_obs, factor, _ = self._conditioning()
        q = self.variational_distribution
        y = self._observations[1].to(factor)
        return _MatheronUpdate(self.linearized, q.means(), q.variances(), x_obs, y, factor,
                               noise_variance(self.likelihood).to(factor))

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


class _MatheronUpdate:
    r"""Matheron's rule in weight space: :math:`\theta \mapsto \theta + \operatorname{diag}(s^2) J_\mu(X)^\top
    (K(X, X) + \Sigma)^{-1} (Y - f(X; \mu) - J_\mu(X)(\theta - \mu) - \epsilon)`, with the features of
    :math:`X` (for :math:`J_\mu u`, never the Jacobian) and the VJP of the network at :math:`\mu` on :math:`X`
    (for :math:`J_\mu^\top v`) computed once for all draws. Differentiable in :math:`\mu`, :math:`s`, the noise
    and :math:`X` when gradients are enabled (as the factor :math:`L` from ``FSVI._conditioning`` then is)."""

    def __init__(self, linearized: LinearizedNetwork, means: Mapping[str, Tensor], variances: Mapping[str, Tensor],
                 x: Tensor, y: Tensor, factor: Tensor, noise: Tensor) -> None:
        grad = torch.is_grad_enabled()
        self.linearized, self.means, self.variances, self.factor = linearized, dict(means), dict(variances), factor
        self.features = linearized.features(self.means, x, create_graph=grad)
        # f(X; μ) and v ↦ J_μ(X)ᵀ v; torch.func composes with the surrounding autograd (and ignores no_grad)
        outputs, self._vjp = torch.func.vjp(lambda params: linearized.forward(params, x), self.means)
        self.residual = (y.reshape(outputs.shape) - outputs).reshape(-1)  # Y - f(X; μ), interleaved
        self.shape = outputs.shape
        self.scale = noise.repeat(x.shape[0]).sqrt()  # entry m·C + c: task c's noise standard deviation

    def noise(self, generator: torch.Generator | None = None) -> Tensor:
        r""":math:`\epsilon \sim N(0, \Sigma)` ``(M·C,)``, interleaved."""
        z = torch.randn(self.scale.shape, dtype=self.scale.dtype, device=self.scale.device, generator=generator)
        return self.scale * z

    def __call__(self, theta: Mapping[str, Tensor], eps: Tensor) -> dict[str, Tensor]:
        shift = self.linearized.jvp(self.features, {n: theta[n] - m for n, m in self.means.items()})
        r = self.residual - shift.reshape(-1) - eps.to(self.residual).reshape(-1)
        v = torch.cholesky_solve(r[:, None], self.factor)[:, 0]
        (pulled,) = self._vjp(v.reshape(self.shape))
        return {n: theta[n] + self.variances[n] * pulled[n] for n in self.means}
