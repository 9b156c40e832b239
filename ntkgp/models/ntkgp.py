"""``NTKGP``: the Laplace-GGN linearized network as a GPyTorch GP."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from gpytorch import settings as gpytorch_settings
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import GP, ExactGP
from linear_operator.operators import DiagLinearOperator
from torch import nn

from ..botorch import BoTorchInterface, gradient_settings, to_posterior
from ..caching import ValueCache
from ..kernels import NTKKernel
from ..laplace.function_space import (
    GLMPredictiveCovariance,
    PredictiveContext,
    SitePosterior,
    fit_site_posterior,
    laplace_log_marginal_likelihood,
)
from ..likelihoods import is_gaussian, noise_variance, num_outputs, validate_targets
from ..means import LinearizedNetworkMean, NetworkMean
from ..ntk import GroupSpec
from ..ntk.checks import OutputShapeError
from ..options import PredictiveMean, choose, renamed_argument

#: Numbers one chunk of test points may occupy in the predictive (``(G + 3)·chunk·C·N·C`` ≤ this), 256 MB in float64.
PREDICTION_BUDGET = 2**25

#: The default ``predictive_mean=`` of :class:`NTKGP`, chosen by measurement (benchmarks/predictive_mean.py,
#: docs/ntkgp.md, "Predictive mean"): the lower NLPD with evidence-learned hyperparameters on classification.
DEFAULT_PREDICTIVE_MEAN = "gp"


def _positive_int(value: object, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument} must be a positive integer, got {value!r}")
    return value


def _check_floating(x: object, argument: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{argument} must be a floating-point tensor, got dtype {x.dtype} (convert it with .to(torch.float64))"
        )
    return x


class NTKGP(BoTorchInterface, GP):
    r"""The Laplace-GGN posterior of a trained network, as a Gaussian process over its outputs.

    The linearized network :math:`f_{lin}(x) = f(x;\theta^*) + J(x)(\theta - \theta^*)` with prior
    :math:`\theta_g \sim N(0, \delta_g^{-1} I)` is the GP :math:`GP(m, K)` with mean
    :math:`m(x) = f(x;\theta^*) - J(x)\theta^*` and the NTK kernel :math:`K` (:class:`~ntkgp.NTKKernel`).
    Conditioning it on the data through the likelihood's Gaussian sites at :math:`f_n = f(x_n;\theta^*)`,
    natural parameters :math:`(\Lambda_n f_n + g_n, \Lambda_n)`, gives the Laplace-GGN GLM predictive
    (docs/math.md, "GLM predictive"):

    .. math::
        f(x_*) \sim N\big(\mu(x_*),\; J_* H^{-1} J_*^\top\big), \qquad
        H = \textstyle\sum_n J_n^\top \Lambda_n J_n + P_0,

    computed in function space as :math:`K_{**} - K_{*X}\Lambda^{1/2}(I + \Lambda^{1/2}K_{XX}\Lambda^{1/2})^{-1}
    \Lambda^{1/2}K_{X*}` (:mod:`ntkgp.laplace`). The mean :math:`\mu(x_*)` is the linearized network at the
    posterior mean :math:`\theta^* + H^{-1}\nabla_\theta \log p(D, \theta^*)`: it equals :math:`f(x_*;\theta^*)`
    when :math:`\theta^*` is a stationary point of the regularized loss under these hyperparameters (a MAP),
    and it is what makes conditioning on new data an exact Bayesian update of the linearized model.
    ``predictive_mean="nn"`` uses :math:`f(x_*;\theta^*)` itself instead (laplace-torch's and the papers'
    GLM predictive; the covariance is the same), see docs/ntkgp.md, "Predictive mean".

    ``NTKGP(net, train_x, train_y, likelihood)`` returns

    * for a Gaussian likelihood (``GaussianLikelihood``, C = 1, or ``MultitaskGaussianLikelihood(rank=0)``)
      an :class:`ExactNTKGP`, a ``gpytorch.models.ExactGP``: GPyTorch's ``ExactMarginalLogLikelihood`` is
      the linearized-GP evidence;
    * for :class:`~ntkgp.likelihoods.LogisticLikelihood` / :class:`~ntkgp.likelihoods.SoftmaxLikelihood` a
      :class:`LaplaceNTKGP` with the same interface.

    **Calls.** In train mode ``model(x)`` is the prior :math:`N(m(x), K(x,x))` (an :class:`ExactNTKGP`, as
    every ``ExactGP``, accepts only its training inputs in train mode; ``model.forward(x)`` gives the prior
    anywhere). In eval mode ``model(x)`` is :meth:`posterior`: a ``MultivariateNormal`` (C = 1) or an
    interleaved ``MultitaskMultivariateNormal`` ``(n, C)``, computed in chunks of test points, whose
    covariance stays lazy (``.variance`` never forms the joint matrix). ``model.likelihood(model(x))`` is the
    predictive over ``y``.

    **Live view of the network.** Everything (network outputs at the training inputs, Grams, the site
    posterior, the mean) is cached by the *values* of the network's weights and buffers and of the
    hyperparameters: after a change by a setter, ``.data``, ``load_state_dict``, an optimizer step or a new
    network weight, the next call recomputes what depends on it. Nothing is ever served stale.

    **dtype.** The model computes in the network's dtype (data of another dtype are converted);
    ``model.double()`` / ``.float()`` convert the hyperparameters and the GP algebra, while Jacobians keep
    the network's precision (the user's network is never converted).

    Args:
        net: the trained network ``(N, *input_shape) → (N, C)``, in eval mode if it has BatchNorm/dropout.
            Held by reference, never modified.
        train_x: training inputs ``(N, ...)``, floating point; inputs with more than one feature dimension
            are flattened for GPyTorch and reshaped for the network.
        train_y: targets (see :func:`ntkgp.likelihoods.validate_targets`).
        likelihood: a supported likelihood (its number of outputs must match the network's).
        prior_precision: initial :math:`\delta` (float or one per group).
        prior_structure: which parameters share a :math:`\delta`: ``"layer"``, ``"network"``, ``"parameter"``
            or a mapping (``groups=`` is its deprecated name).
        prediction_chunk_size: test points per chunk of the predictive (default: as many as fit
            :data:`PREDICTION_BUDGET` numbers, see docs/ntkgp.md, "Prediction at scale").
        predictive_mean: the predictive's mean (:class:`ntkgp.options.PredictiveMean`, as SFR's): ``"gp"``, the
            linearized model's posterior mean :math:`\mu(x_*)` (one Newton step from :math:`\theta^*`; moves
            with :meth:`condition_on`), or ``"nn"``, the network output :math:`f(x_*;\theta^*)` (what
            laplace-torch and the papers use; conditioning on new data changes only the covariance). Default
            :data:`DEFAULT_PREDICTIVE_MEAN`, chosen by measurement (docs/ntkgp.md, "Predictive mean").
        **kernel_kwargs: passed to :class:`~ntkgp.NTKKernel` (``chunk_size``, ``strategy``, ``space``,
            ``input_shape``, ``progress``, ...).

    Raises:
        TypeError: for a non-tensor or non-floating ``train_x``, a non-likelihood.
        ValueError: for shapes, non-finite values, a mismatch of outputs and likelihood, bad targets.
        NotImplementedError: for an unsupported likelihood.
        ValueError: for an unknown ``predictive_mean``, before anything is computed.

    Example:
        >>> reg_net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        >>> y_reg = torch.sin(x.sum(-1))                 # a trained regression network and its targets
        >>> model = ntkgp.NTKGP(reg_net, x, y_reg, gpytorch.likelihoods.GaussianLikelihood()).eval()
        >>> pred = model(x_test)                     # the GLM predictive over f
        >>> pred.mean.shape, pred.variance.shape
        (torch.Size([1000]), torch.Size([1000]))
    """

    def __new__(cls, *args, **kwargs):
        if cls is NTKGP:
            likelihood = kwargs.get("likelihood", args[3] if len(args) > 3 else None)
            if likelihood is None:
                raise TypeError("NTKGP needs a likelihood")
            if not isinstance(likelihood, Likelihood):
                raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
            return super().__new__(ExactNTKGP if is_gaussian(likelihood) else LaplaceNTKGP)
        return super().__new__(cls)

    def __init__(
        self,
        net: nn.Module,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        likelihood: Likelihood,
        prior_precision: float | torch.Tensor = 1.0,
        prior_structure: GroupSpec = "layer",
        prediction_chunk_size: int | None = None,
        predictive_mean: str = DEFAULT_PREDICTIVE_MEAN,
        **kernel_kwargs,
    ) -> None:
        prior_structure = renamed_argument(kernel_kwargs, "groups", "prior_structure", prior_structure, "layer")
        if prediction_chunk_size is not None:
            _positive_int(prediction_chunk_size, "prediction_chunk_size")
        predictive_mean = choose(PredictiveMean, predictive_mean, "predictive_mean")
        x, y, kernel, f = self._setup(net, train_x, train_y, likelihood, prior_precision, prior_structure, kernel_kwargs)
        self._init_data(x, y, likelihood)
        self._train_y = y
        self._num_outputs = f.shape[1]
        self._init_args = {
            "prior_precision": prior_precision,
            "prior_structure": prior_structure,
            "prediction_chunk_size": prediction_chunk_size,
            "predictive_mean": predictive_mean,
            "input_shape": kernel.engine.input_shape,
            **kernel_kwargs,
        }
        self.prediction_chunk_size = prediction_chunk_size
        self.covar_module = kernel
        self.mean_module = LinearizedNetworkMean(kernel.engine)
        self._predictive_mean = predictive_mean
        self._network_mean = NetworkMean(kernel.engine)
        self._train_cache = ValueCache(size=1)
        self._posterior_cache = ValueCache(size=1)
        self._train_cache.get_or_compute("train_outputs", [x], lambda: f, state=self._network_state())

    def _init_data(self, x: torch.Tensor, y: torch.Tensor, likelihood: Likelihood) -> None:
        """Initialize the GPyTorch base class with the training data (differs between exact and Laplace)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _setup(
        net: nn.Module,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        likelihood: Likelihood,
        prior_precision: float | torch.Tensor,
        prior_structure: GroupSpec,
        kernel_kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor, NTKKernel, torch.Tensor]:
        """Check everything and build the kernel; returns ``x`` (flat), ``y`` (validated), the kernel and ``f(x)``."""
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
        expected = num_outputs(likelihood)  # raises for unsupported likelihoods
        _check_floating(train_x, "train_x")
        if train_x.dim() < 2 or train_x.shape[0] == 0:
            raise ValueError(
                f"train_x must have shape (N, ...) with N ≥ 1 and a feature dimension, got {tuple(train_x.shape)}"
            )
        input_shape = kernel_kwargs.pop("input_shape", None)
        inferred = train_x.dim() > 2 and input_shape is None
        if inferred:
            input_shape = tuple(train_x.shape[1:])
        # GPyTorch's batch-mode training data (*batch, N, D) is not supported: train_x (N, *input_shape) is N
        # inputs of the network's shape. When that reading fails, say so naming train_x.
        batch_hint = (
            f" (train_x of shape {tuple(train_x.shape)} is read as {train_x.shape[0]} inputs of shape "
            f"{tuple(train_x.shape[1:])}; batches of training sets, GPyTorch's (*batch, N, D), are not supported: "
            "build one model per training set)" if inferred else ""
        )
        try:
            kernel = NTKKernel(
                net, prior_precision=prior_precision, prior_structure=prior_structure, input_shape=input_shape,
                **kernel_kwargs,
            )
        except OutputShapeError as error:
            if not inferred:
                raise
            raise ValueError(f"net could not be applied to train_x: {error}{batch_hint}") from None
        engine = kernel.engine
        x = train_x.flatten(1).to(dtype=kernel.raw_prior_precision.dtype, device=kernel.raw_prior_precision.device)
        try:
            f = engine.outputs(x, "train_x")
        except (RuntimeError, ValueError) as error:  # the network rejects the inputs (wrong feature count, ...)
            if isinstance(error, ValueError) and not inferred:
                raise
            raise ValueError(
                f"net could not be applied to train_x of shape {tuple(train_x.shape)}: {error}{batch_hint}"
            ) from None
        if f.shape[1] != expected:
            raise ValueError(
                f"net has {f.shape[1]} outputs but the likelihood {type(likelihood).__name__} expects {expected}"
            )
        y = validate_targets(likelihood, train_y, f.shape[1], num_data=x.shape[0], name="train_y")
        y = y.to(device=x.device)
        return x, y, kernel, f.to(x)

    # ------------------------------------------------------------------ public properties
    @property
    def net(self) -> nn.Module:
        """The network (held by reference)."""
        return self.covar_module.engine.net

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the GP algebra (the hyperparameters'; the network's unless the model was converted)."""
        return self.covar_module.raw_prior_precision.dtype

    @property
    def predictive_mean(self) -> PredictiveMean:
        r"""The mean of the predictive, ``"gp"`` or ``"nn"`` (settable, validated).

        ``"gp"`` is the linearized model's posterior mean, ``"nn"`` the network's output
        :math:`f(x_*;\theta^*)`; the covariance is the same for both (docs/ntkgp.md, "Predictive mean")."""
        return self._predictive_mean

    @predictive_mean.setter
    def predictive_mean(self, value: str) -> None:
        self._predictive_mean = choose(PredictiveMean, value, "predictive_mean")
        self._init_args["predictive_mean"] = self._predictive_mean

    @property
    def num_outputs(self) -> int:
        """``C``, the network's number of outputs."""
        return self._num_outputs

    @property
    def num_data(self) -> int:
        """``N``, the number of training points."""
        return self.train_inputs[0].shape[0]

    @property
    def train_x(self) -> torch.Tensor:
        """Training inputs ``(N, D)`` as the kernel takes them (flattened)."""
        return self.train_inputs[0]

    @property
    def train_y(self) -> torch.Tensor:
        """Training targets as validated by :func:`~ntkgp.likelihoods.validate_targets`."""
        return self._train_y

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        """The shape of one input as the network takes it (``None``: flat ``(D,)``)."""
        return self.covar_module.engine.input_shape

    @property
    def train_outputs(self) -> torch.Tensor:
        r"""The network's outputs :math:`f(X;\theta^*)` at the training inputs, ``(N, C)``, at its current weights."""
        engine = self.covar_module.engine
        x = self.train_x
        f = self._train_cache.get_or_compute(
            "train_outputs", [x], lambda: engine.outputs(x, "train_x"), state=self._network_state()
        )
        return f.to(dtype=self.dtype, device=x.device)

    def _network_state(self) -> list[torch.Tensor]:
        return self.covar_module.engine.network_state()

    def _state(self) -> list[torch.Tensor]:
        """Every tensor a prediction depends on besides the data: hyperparameters, buffers, network."""
        return [*self.parameters(), *self.buffers(), *self._network_state()]

    # ------------------------------------------------------------------ inputs
    def _flat_inputs(self, x: torch.Tensor, argument: str) -> torch.Tensor:
        """``x`` as ``(*batch, n, D)`` in the model's dtype (trailing ``input_shape`` dimensions flattened)."""
        _check_floating(x, argument)
        d = self.train_x.shape[-1]
        shape = self.input_shape
        if shape is not None and len(shape) > 1 and x.dim() > len(shape) and tuple(x.shape[-len(shape) :]) == shape:
            x = x.flatten(-len(shape))
        if x.dim() < 2 or x.shape[-1] != d:
            expected = f"(*batch, n, {d})"
            if shape is not None and len(shape) > 1:
                expected += f" or (*batch, n, {', '.join(map(str, shape))})"
            raise ValueError(f"{argument} must have shape {expected}, got {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            raise ValueError(f"{argument} contains NaN or Inf values")
        return x.to(dtype=self.dtype, device=self.train_x.device)

    def _output_indices(self, output_indices: Sequence[int] | None) -> tuple[int, ...] | None:
        if output_indices is None:
            return None
        if isinstance(output_indices, int) or not isinstance(output_indices, Sequence) or not output_indices:
            raise ValueError(f"output_indices must be a non-empty list of output indices, got {output_indices!r}")
        for i in output_indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_outputs:
                raise ValueError(f"output_indices must hold integers in [0, {self.num_outputs}), got {list(output_indices)}")
        indices = tuple(output_indices)
        return None if indices == tuple(range(self.num_outputs)) else indices

    def prediction_chunk(self, chunk_size: int | None = None) -> int:
        """Test points per chunk: ``chunk_size``, else :attr:`prediction_chunk_size`, else the largest chunk
        whose working set ``(G + 3)·chunk·C·N·C`` fits :data:`PREDICTION_BUDGET` numbers (at least 1)."""
        if chunk_size is None:
            chunk_size = self.prediction_chunk_size
        if chunk_size is not None:
            return _positive_int(chunk_size, "chunk_size")
        n, c = self.num_data, self.num_outputs
        groups = self.covar_module.engine.num_groups
        return max(1, PREDICTION_BUDGET // ((groups + 3) * c * n * c))

    # ------------------------------------------------------------------ the prior
    def _mvn(self, mean: torch.Tensor, covar) -> MultivariateNormal:
        """``mean`` of shape ``(*batch, n, C)``: an MVN (C = 1) or an interleaved MTMVN."""
        if mean.shape[-1] == 1:
            return MultivariateNormal(mean.squeeze(-1), covar)
        return MultitaskMultivariateNormal(mean, covar, interleaved=True)

    def forward(self, x: torch.Tensor) -> MultivariateNormal:
        """The prior of the linearized network at ``x`` ``(*batch, n, D)``: ``N(m(x), K(x, x))``."""
        mean = self.mean_module.values(x).to(dtype=self.dtype, device=self.train_x.device)
        return self._mvn(mean, self.covar_module(x))

    def _targets(self, target: torch.Tensor | None) -> torch.Tensor:
        if target is None:
            return self._train_y
        y = validate_targets(self.likelihood, target, self.num_outputs, num_data=self.num_data, name="target")
        return y.to(device=self.train_x.device)

    # ------------------------------------------------------------------ evidence
    def log_marginal_likelihood(
        self,
        target: torch.Tensor | None = None,
        curvature: str = "ggn",
        space: str = "auto",
        method: str = "auto",
        options=None,
    ) -> torch.Tensor:
        r"""The Laplace-GGN log marginal likelihood :math:`\log q(D)` (total, not divided by N).

        See :func:`ntkgp.laplace.laplace_log_marginal_likelihood`. Differentiable w.r.t. every hyperparameter;
        the Jacobians and Grams are computed once and reused across hyperparameter steps.

        Args:
            target: targets (default: the training targets).
            curvature: ``"ggn"`` or ``"ef"`` (empirical Fisher).
            space: ``"auto"``, ``"function"`` or ``"weight"``.
            method: ``"auto"``, ``"cholesky"``, ``"eigen"`` or ``"matrix_free"`` (``docs/scaling.md``).
            options: an :class:`ntkgp.laplace.EvidenceOptions` (memory limit of ``"auto"``, settings of the
                matrix-free route).
        """
        return laplace_log_marginal_likelihood(
            self.covar_module,
            self.likelihood,
            self.train_x,
            self.train_outputs,
            self._targets(target),
            curvature,
            space,
            method=method,
            options=options,
        )

    # ------------------------------------------------------------------ posterior in function space
    #: Whether the sites are iterated to the mode (set by :meth:`condition_on`; see :attr:`iterated_sites`).
    _iterated_sites = False

    @property
    def iterated_sites(self) -> bool:
        """Whether the site posterior sits at the mode of the linearized log joint (``condition_on(..., iterate=True)``)
        rather than at the network's outputs :math:`f(X;\theta^*)`."""
        return self._iterated_sites

    def _fit_site_posterior(self) -> SitePosterior:
        x = self.train_x
        prior_mean = self.mean_module.values(x).to(dtype=self.dtype, device=x.device)
        return fit_site_posterior(
            self.covar_module, self.likelihood, x, self.train_outputs, self._train_y, prior_mean,
            iterate=self._iterated_sites,
        )

    def site_posterior(self) -> SitePosterior:
        """The Gaussian-site posterior over the training outputs.

        As GPyTorch does for its prediction caches (``gpytorch.settings.detach_test_caches``, on by default),
        it is computed without a graph and cached by the values of the hyperparameters, the network's weights
        and buffers and the training data; with the setting off and gradients enabled it is recomputed with
        its graph to the hyperparameters at every call.
        """
        if torch.is_grad_enabled() and not gpytorch_settings.detach_test_caches.on():
            return self._fit_site_posterior()

        def fit() -> SitePosterior:
            with torch.no_grad():
                return self._fit_site_posterior()

        return self._posterior_cache.get_or_compute(
            "site_posterior", [self.train_x, self._train_y], fit, state=self._state()
        )

    def posterior(
        self,
        X: torch.Tensor,
        output_indices: Sequence[int] | None = None,
        observation_noise: bool | torch.Tensor = False,
        posterior_transform=None,
        chunk_size: int | None = None,
        **kwargs,
    ):
        r"""BoTorch's ``Model.posterior``: the GLM predictive over :math:`f` at ``X`` as a ``GPyTorchPosterior``.

        :meth:`predictive_distribution` wrapped by :func:`ntkgp.botorch.to_posterior` (BoTorch is imported
        only here; ``pip install 'ntkgp[botorch]'``), then ``posterior_transform`` applied as BoTorch does.
        ``X`` of shape ``(b, q, d)`` gives a posterior of mean ``(b, q, m)``.

        Raises:
            ImportError: without BoTorch.
            TypeError, ValueError: as :meth:`predictive_distribution`.
        """
        with gradient_settings():
            dist = self.predictive_distribution(X, output_indices, observation_noise, chunk_size=chunk_size, **kwargs)
        return to_posterior(dist, posterior_transform)

    def predictive_distribution(
        self,
        X: torch.Tensor,
        output_indices: Sequence[int] | None = None,
        observation_noise: bool | torch.Tensor = False,
        chunk_size: int | None = None,
        **kwargs,
    ) -> MultivariateNormal:
        r"""The GLM predictive over :math:`f` at ``X`` as a GPyTorch distribution (what eval-mode ``model(X)`` returns).

        The mean is the one :attr:`predictive_mean` names (``"gp"``: the linearized posterior mean, one
        cross-Gram per chunk; ``"nn"``: the network's output). Test points are processed in chunks of
        ``chunk_size``: the mean is computed at once, the covariance is a lazy
        :class:`~ntkgp.laplace.GLMPredictiveCovariance` that evaluates what is asked for (``.variance``,
        per-point blocks, products) chunk by chunk. Memory is bounded by about
        ``(G + 3)·chunk·C·N·C`` numbers whatever the number of test points (docs/ntkgp.md).

        When ``X`` requires grad the mean and (co)variance are differentiable w.r.t. ``X`` (including the
        :math:`f(x)` term of the mean).

        Args:
            X: test inputs ``(*batch, n, D)`` (or ``(*batch, n, *input_shape)``); ``(b, q, d)`` is a batch of
                ``b`` joint distributions over ``q`` points each.
            output_indices: the outputs to return (default all ``C``).
            observation_noise: ``True`` adds the Gaussian likelihood's noise variances; a tensor broadcastable
                to the mean's shape ``(*batch, n, C')`` adds those variances. Gaussian likelihoods only.
            chunk_size: test points per chunk (default :meth:`prediction_chunk`).

        Returns:
            A ``MultivariateNormal`` with mean ``(*batch, n)`` when one output is returned, else an interleaved
            ``MultitaskMultivariateNormal`` with mean ``(*batch, n, C')``.

        Raises:
            TypeError: for unknown keyword arguments or a non-floating ``X``.
            ValueError: for shapes, non-finite inputs, bad ``output_indices`` or ``observation_noise``.
        """
        if kwargs:
            raise TypeError(f"predictive_distribution got unexpected keyword arguments {sorted(kwargs)}")
        x = self._flat_inputs(X, "X")
        outputs = self._output_indices(output_indices)
        chunk = self.prediction_chunk(chunk_size)
        noise = self._observation_noise(observation_noise)
        batch, n, d = x.shape[:-2], x.shape[-2], x.shape[-1]
        post = self.site_posterior()
        context = PredictiveContext(self.covar_module, post, self.train_x, self.num_outputs, outputs, chunk)
        points = x.reshape(-1, d)
        means = []
        for s, e in context.chunks(points.shape[0]):
            xs = points[s:e]
            if self._predictive_mean is PredictiveMean.NN:
                means.append(self._network_mean.values(xs).to(post.dtype))
                continue
            cross = self.covar_module(xs, self.train_x).to_dense().to(post.dtype)
            prior = self.mean_module.values(xs).to(post.dtype).reshape(-1)
            means.append((prior + post.mean_correction(cross)).reshape(e - s, self.num_outputs))
        c = self.num_outputs
        mean = torch.cat(means) if means else torch.zeros(0, c, dtype=post.dtype, device=x.device)
        if outputs is not None:
            mean = mean[:, list(outputs)]
        mean = mean.reshape(*batch, n, mean.shape[-1])
        covar = GLMPredictiveCovariance(x.to(post.dtype), context)
        if noise is not None:
            covar = covar + DiagLinearOperator(self._noise_diagonal(noise, outputs, mean.shape).to(post.dtype))
        return self._mvn(mean, covar)

    def _observation_noise(self, observation_noise: bool | torch.Tensor) -> bool | torch.Tensor | None:
        if isinstance(observation_noise, bool):
            if not observation_noise:
                return None
        elif not isinstance(observation_noise, torch.Tensor):
            raise TypeError(f"observation_noise must be a bool or a tensor, got {type(observation_noise).__name__}")
        elif not (torch.isfinite(observation_noise).all() and (observation_noise >= 0).all()):
            raise ValueError("observation_noise must hold finite non-negative variances")
        if not is_gaussian(self.likelihood):
            raise ValueError(
                "observation_noise is defined for Gaussian likelihoods only; for class probabilities use "
                "model.likelihood(model(x))"
            )
        return observation_noise

    def _noise_diagonal(self, noise: bool | torch.Tensor, outputs: tuple[int, ...] | None, shape: torch.Size) -> torch.Tensor:
        """The added variances in the covariance's interleaved order, ``(*batch, n·C')``."""
        if isinstance(noise, bool):
            variances = noise_variance(self.likelihood).detach()
            if outputs is not None:
                variances = variances[list(outputs)]
            values = variances.expand(shape)
        else:
            try:
                values = noise.expand(shape)
            except RuntimeError:
                raise ValueError(f"observation_noise of shape {tuple(noise.shape)} does not broadcast to {tuple(shape)}") from None
        return values.reshape(*shape[:-2], -1)

    # ------------------------------------------------------------------ GPyTorch calls
    def _call_eval(self, x: torch.Tensor, **kwargs) -> MultivariateNormal:
        return self.predictive_distribution(x, **kwargs)

    # ------------------------------------------------------------------ conditioning
    def _new_data(self, x_new: torch.Tensor, y_new: torch.Tensor, x_name: str, y_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._flat_inputs(x_new, x_name)
        if x.dim() != 2 or x.shape[0] == 0:
            raise ValueError(
                f"{x_name} must have shape (M, {self.train_x.shape[-1]}) with M ≥ 1 (no batch dimensions), got {tuple(x_new.shape)}"
            )
        y = validate_targets(self.likelihood, y_new, self.num_outputs, num_data=x.shape[0], name=y_name)
        return x.to(self.train_x), y.to(self._train_y)

    def condition_on(self, x_new: torch.Tensor, y_new: torch.Tensor, iterate: bool | None = None) -> NTKGP:
        r"""A new model conditioned on the union of the training data and ``(x_new, y_new)``, same θ*.

        A Bayesian update of the linearized model: the network is not retrained. The current
        hyperparameters and :attr:`predictive_mean` are copied; the network is shared (never copied). All
        inputs are checked before anything is built. With ``predictive_mean="nn"`` the new data move the
        covariance only (the mean stays :math:`f(x_*;\theta^*)`).

        **Sites.** With a Gaussian likelihood the sites are exact and the update is the exact GP posterior
        (``iterate`` changes nothing). With a classification likelihood the new points enter through Gaussian
        sites, placed

        * ``iterate=False`` (one step): at the network's outputs ``f(x; θ*)``, as for the training data, i.e. one
          Newton step from θ*. New points that the network gets confidently wrong overshoot: the step is
          taken with the curvature at θ*, where the likelihood of those points is flat.
        * ``iterate=True`` (default): at the mode of the linearized model's log joint on the union of the
          data (all sites move), found by damped Newton steps in the function values
          (:func:`ntkgp.laplace.function_space.site_mode`; Newton/IRLS of GP classification with the Laplace approximation,
          with a backtracking line search, θ* and the hyperparameters fixed). When θ* is a MAP of the
          training data, the mode on the training data alone is θ* itself, so the model before conditioning
          is unchanged by the choice. The default was chosen by measurement (docs/guarantees.md, "Iterated
          sites"): on two moons with a held-out moon tip, one step lowered the accuracy from 0.93 to 0.74
          after conditioning on the tip, the iterated sites raised it.

        The iterated model recomputes its mode whenever its hyperparameters or the network change (the
        site posterior is cached by value like everything else); :attr:`iterated_sites` tells which kind a
        model is, and its :meth:`log_marginal_likelihood` stays the Laplace-GGN evidence at θ*.

        Args:
            x_new: new inputs ``(M, D)`` (or ``(M, *input_shape)``).
            y_new: their targets.
            iterate: iterate the sites to the mode (``None``: the default, ``True``).

        Returns:
            A new model of the same class, in the same mode.

        Raises:
            TypeError: for a non-tensor or non-floating ``x_new``, or a non-bool ``iterate``.
            ValueError: for shapes, non-finite values and invalid targets (naming the argument).
        """
        if iterate is None:
            iterate = True
        if not isinstance(iterate, bool):
            raise TypeError(f"iterate must be True, False or None, got {iterate!r}")
        x_new, y_new = self._new_data(x_new, y_new, "x_new", "y_new")
        x_all = torch.cat([self.train_x, x_new])
        y_all = torch.cat([self._train_y, y_new])
        args = copy.deepcopy(self._init_args)
        args["prior_precision"] = self.covar_module.prior_precision.detach().clone()
        new = type(self)(self.net, x_all, y_all, copy.deepcopy(self.likelihood), **args)
        if new.dtype != self.dtype:
            new.to(self.dtype)
        new.load_state_dict(self.state_dict())
        new._iterated_sites = iterate and not is_gaussian(self.likelihood)
        new.train(self.training)
        return new

    def get_fantasy_model(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs) -> NTKGP:
        """GPyTorch's name for :meth:`condition_on` (every likelihood, multi-output included).

        Batched fantasies (targets with extra leading dimensions) and per-point noise are not supported.

        Raises:
            NotImplementedError: for keyword arguments such as ``noise``.
        """
        if kwargs:
            raise NotImplementedError(f"get_fantasy_model does not support {sorted(kwargs)}; use condition_on")
        expected = 1 if self.num_outputs == 1 else 2
        if (isinstance(targets, torch.Tensor) and targets.dim() == 2 and self.num_outputs == 1
                and isinstance(inputs, torch.Tensor) and inputs.dim() == 2
                and targets.shape[0] == inputs.shape[0] != targets.shape[1] != 1):
            # one output, M unbatched inputs: (M, k) targets are a wrong shape, not k fantasies ((k, M) would be)
            raise ValueError(f"targets must have shape (M,) or (M, 1) for one output, got {tuple(targets.shape)}")
        if isinstance(targets, torch.Tensor) and targets.dim() > expected and not (self.num_outputs == 1 and targets.dim() == 2 and targets.shape[-1] == 1):
            raise NotImplementedError(
                f"batched fantasies are not supported: targets must have shape (M,) or (M, C), got {tuple(targets.shape)}"
            )
        return self.condition_on(inputs, targets)


class ExactNTKGP(NTKGP, ExactGP):
    """:class:`NTKGP` with a Gaussian likelihood: a ``gpytorch.models.ExactGP`` on the linearized network.

    In train mode calls go through ``ExactGP`` (the prior, for ``ExactMarginalLogLikelihood``); in eval mode
    through :meth:`NTKGP.posterior` (exact for a Gaussian likelihood), never through GPyTorch's
    ``prediction_strategy``, whose caches are not keyed by the hyperparameters' values (it is cleared at
    every eval-mode call, so that nothing built from it can be stale).
    """

    def _init_data(self, x: torch.Tensor, y: torch.Tensor, likelihood: Likelihood) -> None:
        ExactGP.__init__(self, x, y.squeeze(-1) if y.shape[-1] == 1 else y, likelihood)

    def __call__(self, *args, **kwargs):
        if self.training or gpytorch_settings.prior_mode.on():
            args = [self._flat_inputs(a, "x") if torch.is_tensor(a) else a for a in args]
            return ExactGP.__call__(self, *args, **kwargs)
        self.prediction_strategy = None
        if len(args) != 1:
            raise TypeError(f"ExactNTKGP takes one input tensor in eval mode, got {len(args)}")
        return self._call_eval(args[0], **kwargs)

    def set_train_data(self, inputs=None, targets=None, strict: bool = True) -> None:
        """Replace the training data (GPyTorch's method), validated; prefer :meth:`condition_on`."""
        x = self.train_x if inputs is None else (inputs[0] if isinstance(inputs, tuple) else inputs)
        y = self._train_y if targets is None else targets
        x = self._flat_inputs(x, "inputs")
        if x.dim() != 2:
            raise ValueError(f"inputs must have shape (N, {self.train_x.shape[-1]}), got {tuple(x.shape)}")
        y = validate_targets(self.likelihood, y, self.num_outputs, num_data=x.shape[0], name="targets")
        if strict and (x.shape != self.train_x.shape):
            raise RuntimeError(f"inputs of shape {tuple(x.shape)} differ from the training inputs {tuple(self.train_x.shape)} (strict=True)")
        ExactGP.set_train_data(self, x, y.squeeze(-1) if y.shape[-1] == 1 else y, strict=False)
        self._train_y = y.to(device=x.device)


class LaplaceNTKGP(NTKGP):
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
            return self.forward(self._flat_inputs(x, "x"))
        return self._call_eval(x, **kwargs)

    def _apply(self, fn):
        # GPyTorch's GP does not convert train_inputs (ExactGP does): keep them in the model's dtype.
        super()._apply(fn)
        self.train_inputs = tuple(fn(t) for t in self.train_inputs)
        return self
