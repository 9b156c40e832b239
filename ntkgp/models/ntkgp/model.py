"""``NTKGP``: the Laplace-GGN linearized network as a GPyTorch GP (construction, options, data, prior, evidence,
site posterior); its predictive is in :mod:`.prediction`, its conditioning in :mod:`.conditioning`."""

from __future__ import annotations

import torch
from gpytorch import settings as gpytorch_settings
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import GP
from torch import nn

from ...botorch import BoTorchInterface
from ...caching import ValueCache
from ...laplace.function_space import SitePosterior, fit_site_posterior, laplace_log_marginal_likelihood
from ...laplace.weight_space.posterior.prior_tuning import optimize_parameter_precision
from ...likelihoods import is_gaussian, validate_targets
from ...means import LinearizedNetworkMean, NetworkMean
from ...ntk import GroupSpec
from ...ntk.private_copy import model_lock
from ...options import OptionAttribute, PredictiveMean, choice, choose
from ...persistence import CheckedLoad
from .arguments import optional_positive_int, setup
from .conditioning import ConditioningMixin
from .kernel_options import KernelOption
from .newton_step import newton_step
from .prediction import PredictionMixin

#: The default ``predictive_mean=`` of :class:`NTKGP`, chosen by measurement (benchmarks/predictive_mean.py,
#: docs/ntkgp.md, "Predictive mean"): the lower NLPD with evidence-learned hyperparameters on classification.
DEFAULT_PREDICTIVE_MEAN = "gp"


class NTKGP(CheckedLoad, PredictionMixin, ConditioningMixin, BoTorchInterface, GP):
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
    \Lambda^{1/2}K_{X*}` or in weight space (:mod:`ntkgp.laplace`). The mean :math:`\mu(x_*)` is the linearized
    network at the posterior mean :math:`\theta^* + s`, :math:`s = H^{-1}\nabla_\theta \log p(D, \theta^*)`,
    computed as the network output plus a correction, :math:`f(x_*;\theta^*) + J_* s`, never as the difference
    :math:`m + K_{*X}(\dots)` that cancels in float32 (:mod:`ntkgp.models.ntkgp.newton_step`): it equals
    :math:`f(x_*;\theta^*)` when :math:`\theta^*` is a stationary point of the regularized loss under these
    hyperparameters (a MAP), and it is what makes conditioning on new data an exact Bayesian update of the
    linearized model.
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

    **dtype.** The model computes in the network's dtype, float32 or float64 (data of another dtype are
    converted; float16/bfloat16 networks are refused); ``model.double()`` / ``.float()`` convert the
    hyperparameters and the GP algebra, while Jacobians keep the network's precision (the user's network is
    never converted).

    **Options** (:class:`ntkgp.options.OptionAttribute`): ``predictive_mean``, ``prediction_chunk_size`` and
    the kernel's ``space``, ``strategy``, ``chunk_size``, ``cache_size``, ``progress`` (stored once, in
    ``covar_module``) can be assigned after construction, validated as the constructor does, and the model
    then predicts as one built with the new value; ``prior_structure`` and ``input_shape`` are fixed
    (``AttributeError``: build a new model). A parameter frozen or unfrozen after construction is refused at the
    next call (``RuntimeError``).

    Args:
        net: the trained network ``(N, *input_shape) → (N, C)``, in eval mode if it has BatchNorm/dropout.
            Held by reference, never modified.
        train_x: training inputs ``(N, ...)`` (floating point, or integer token ids); inputs with more than one
            feature dimension are flattened for GPyTorch and reshaped for the network. A dict (or tuple) of tensors
            with a common leading dimension is kept as packed rows and rebuilt for the network; test inputs and new
            data are then such dicts (docs/networks.md, "Dict and tuple inputs in the GPyTorch models").
        train_y: targets (see :func:`ntkgp.likelihoods.validate_targets`).
        likelihood: a supported likelihood (its number of outputs must match the network's).
        prior_precision: initial :math:`\delta` (float or one per group).
        prior_structure: which parameters share a :math:`\delta`: ``"layer"``, ``"network"``, ``"parameter"``
            or a mapping.
        prediction_chunk_size: test points per chunk of the predictive (default: as many as fit
            :data:`ntkgp.memory.PREDICTION_BYTES`, see docs/ntkgp.md, "Prediction at scale").
        predictive_mean: the predictive's mean (:class:`ntkgp.options.PredictiveMean`, as SFR's): ``"gp"``, the
            linearized model's posterior mean :math:`\mu(x_*)` (one Newton step from :math:`\theta^*`; moves
            with :meth:`condition_on`), or ``"nn"``, the network output :math:`f(x_*;\theta^*)` (what
            laplace-torch and the papers use; conditioning on new data changes only the covariance). Default
            :data:`DEFAULT_PREDICTIVE_MEAN`, chosen by measurement (docs/ntkgp.md, "Predictive mean").
        **kernel_kwargs: passed to :class:`~ntkgp.NTKKernel` (``chunk_size``, ``strategy``, ``space``,
            ``input_shape``, ``progress``, ...).

    Raises:
        TypeError: for a non-tensor or non-floating ``train_x``, a non-likelihood, a float16/bfloat16 network.
        ValueError: for shapes, non-finite values, a mismatch of outputs and likelihood, bad targets, an unknown
            ``predictive_mean`` (before anything is computed), a random network (functional dropout), and
            GPyTorch's batch-mode training data (a batched likelihood or kernel, ``train_x`` ``(*batch, N, D)``
            that the network cannot take as ``N`` inputs): build one model per training set.
        NotImplementedError: for an unsupported likelihood.

    Example:
        >>> reg_net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        >>> y_reg = torch.sin(x.sum(-1))                 # a trained regression network and its targets
        >>> model = ntkgp.NTKGP(reg_net, x, y_reg, gpytorch.likelihoods.GaussianLikelihood()).eval()
        >>> pred = model(x_test)                     # the GLM predictive over f
        >>> pred.mean.shape, pred.variance.shape
        (torch.Size([1000]), torch.Size([1000]))
    """

    predictive_mean = OptionAttribute(choice(PredictiveMean), on_change="_option_changed")
    prediction_chunk_size = OptionAttribute(optional_positive_int, on_change="_option_changed")
    space = KernelOption()
    strategy = KernelOption()
    chunk_size = KernelOption()
    cache_size = KernelOption()
    progress = KernelOption()
    prior_structure = KernelOption()
    input_shape = KernelOption()

    #: The concrete classes by likelihood: ``{True: Gaussian (exact), False: classification}``, filled by
    #: the subclasses (``class ExactNTKGP(NTKGP, gaussian=True)``).
    _variants: dict[bool, type] = {}

    def __init_subclass__(cls, gaussian: bool | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if gaussian is not None:
            NTKGP._variants[gaussian] = cls

    def __new__(cls, *args, **kwargs):
        if cls is NTKGP:
            likelihood = kwargs.get("likelihood", args[3] if len(args) > 3 else None)
            if likelihood is None:
                raise TypeError("NTKGP needs a likelihood")
            if not isinstance(likelihood, Likelihood):
                raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
            return super().__new__(NTKGP._variants[is_gaussian(likelihood)])
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
        prediction_chunk_size = optional_positive_int(prediction_chunk_size, "prediction_chunk_size")
        predictive_mean = choose(PredictiveMean, predictive_mean, "predictive_mean")
        x, y, kernel, f = setup(net, train_x, train_y, likelihood, prior_precision, prior_structure, kernel_kwargs)
        self._init_data(x, y, likelihood)
        self._train_y = y
        self._num_outputs = f.shape[1]
        self.predictive_mean = predictive_mean
        self.prediction_chunk_size = prediction_chunk_size
        self.covar_module = kernel
        self.mean_module = LinearizedNetworkMean(kernel.engine)
        self._network_mean = NetworkMean(kernel.engine)
        self._train_cache = ValueCache(size=1)
        self._posterior_cache = ValueCache(size=1)
        self._train_cache.get_or_compute("train_outputs", [x], lambda: f, state=self._network_state())

    def _init_data(self, x: torch.Tensor, y: torch.Tensor, likelihood: Likelihood) -> None:
        """Initialize the GPyTorch base class with the training data (differs between exact and Laplace)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ options
    def _option_changed(self, name: str) -> None:
        """``predictive_mean`` and ``prediction_chunk_size`` are read at every prediction; nothing cached depends
        on them (the site posterior and the Newton step serve both means, every chunking)."""

    def _kernel_option_changed(self, name: str) -> None:
        """After the kernel took a new option: its engine may be new (``strategy``, ``chunk_size``), so the
        means follow it, and the site posterior (which depends on the space) is dropped."""
        engine = self.covar_module.engine
        self.mean_module = LinearizedNetworkMean(engine, self.mean_module.cache_size)
        self._network_mean = NetworkMean(engine, self._network_mean.cache_size)
        self._posterior_cache.clear()

    def _kernel_options(self) -> tuple:
        """The kernel's options a site posterior depends on (part of its cache key: a kernel option assigned on
        ``covar_module`` directly is seen too)."""
        kernel = self.covar_module
        return (kernel.space.value, kernel.strategy.value)

    # ------------------------------------------------------------------ public properties
    @property
    def net(self) -> nn.Module:
        """The network (held by reference)."""
        return self.covar_module.engine.net

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the GP algebra (the hyperparameters'; the network's unless the model was converted)."""
        # read through the registries nn.Module's attribute lookup would search (each call of a step reads it)
        return self._modules["covar_module"]._parameters["raw_prior_precision"].dtype

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
        """Training inputs ``(N, D)`` as the kernel takes them (flattened; a dict or tuple of tensors as packed rows
        ``(N, B)`` of bytes, :mod:`ntkgp.ntk.packed_inputs`)."""
        return self.train_inputs[0]

    @property
    def train_y(self) -> torch.Tensor:
        """Training targets as validated by :func:`~ntkgp.likelihoods.validate_targets`."""
        return self._train_y

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
        return self.covar_module.network_state()

    def _state(self) -> list[torch.Tensor]:
        """Every tensor a prediction depends on besides the data: hyperparameters, buffers, network."""
        return [*self.parameters(), *self.buffers(), *self._network_state()]

    # ------------------------------------------------------------------ the prior
    def _mvn(self, mean: torch.Tensor, covar) -> MultivariateNormal:
        """``mean`` of shape ``(*batch, n, C)``: an MVN (C = 1) or an interleaved MTMVN."""
        if mean.shape[-1] == 1:
            return MultivariateNormal(mean.squeeze(-1), covar)
        return MultitaskMultivariateNormal(mean, covar, interleaved=True)

    def forward(self, x: torch.Tensor) -> MultivariateNormal:
        """The prior of the linearized network at ``x`` ``(*batch, n, D)``: ``N(m(x), K(x, x))``."""
        return self._prior(x)

    def _prior(self, x: torch.Tensor, checked: bool = False) -> MultivariateNormal:
        """:meth:`forward`; ``checked``: ``x`` comes from :meth:`_flat_inputs`, which checks all the kernel would
        (floating, finite, the training inputs' features), so the kernel does not check it again."""
        mean = self.mean_module.values(x).to(dtype=self.dtype, device=self.train_x.device)
        kernel = self.covar_module
        covar = kernel._lazy(x) if checked else None
        return self._mvn(mean, kernel(x) if covar is None else covar)

    def _checked_prior(self, x: torch.Tensor) -> MultivariateNormal:
        """The train-mode call's prior at ``x`` from :meth:`_flat_inputs`: :meth:`forward`, a subclass's own if it
        has one."""
        return self._prior(x, checked=True) if type(self).forward is NTKGP.forward else self.forward(x)

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

    def optimize_prior_precision(self, optimizer: str = "adam", steps: int = 100, lr: float = 0.1, grid=None,
                                 sweeps: int = 2, progress: bool = False) -> torch.Tensor:
        r"""Maximize :meth:`log_marginal_likelihood` over :math:`\delta` alone (the noise or temperature and
        :math:`\theta^*` fixed), set it and return it: ``optimizer="adam"`` (``steps`` steps of size ``lr`` on
        ``raw_prior_precision``, the best kept), ``"lbfgs"`` or ``"grid"`` (values ``(M,)`` or candidates
        ``(M, G)``), as :meth:`ntkgp.laplace.WeightPosterior.optimize_prior_precision` (``docs/ntkgp.md``)."""
        return optimize_parameter_precision(self.log_marginal_likelihood, self.covar_module, optimizer, steps, lr,
                                            grid, sweeps, progress)

    # ------------------------------------------------------------------ posterior of the training outputs
    #: Whether the sites are iterated to the mode (set by :meth:`condition_on`; see :attr:`iterated_sites`).
    _iterated_sites = False

    @property
    def iterated_sites(self) -> bool:
        """Whether the site posterior sits at the mode of the linearized log joint (``condition_on(..., iterate=True)``)
        rather than at the network's outputs :math:`f(X;\\theta^*)`."""
        return self._iterated_sites

    def _fit(self) -> tuple[SitePosterior, torch.Tensor]:
        x = self.train_x
        f = self.train_outputs
        prior_mean = self.mean_module.values(x).to(dtype=self.dtype, device=x.device)
        post = fit_site_posterior(
            self.covar_module, self.likelihood, x, f, self._train_y, prior_mean, iterate=self._iterated_sites
        )
        return post, newton_step(self.covar_module, self.likelihood, x, f, self._train_y, post)

    def _fitted(self) -> tuple[SitePosterior, torch.Tensor]:
        """The site posterior and the Newton step, cached together (see :meth:`site_posterior`)."""
        if torch.is_grad_enabled() and not gpytorch_settings.detach_test_caches.on():
            return self._fit()

        def fit() -> tuple[SitePosterior, torch.Tensor]:
            with torch.no_grad():
                return self._fit()

        with model_lock(self):  # one fill at a time per model (docs/guarantees.md, "Threads")
            return self._posterior_cache.get_or_compute(
                ("site_posterior", *self._kernel_options()), [self.train_x, self._train_y], fit, state=self._state()
            )

    def site_posterior(self) -> SitePosterior:
        """The Gaussian-site posterior over the training outputs.

        As GPyTorch does for its prediction caches (``gpytorch.settings.detach_test_caches``, on by default),
        it is computed without a graph and cached by the values of the hyperparameters, the network's weights
        and buffers, the training data and the kernel's options; with the setting off and gradients enabled it
        is recomputed with its graph to the hyperparameters at every call.
        """
        return self._fitted()[0]

    def newton_step(self) -> torch.Tensor:
        r"""The step :math:`s = H^{-1}\nabla_\theta \log p(D, \theta^*)` ``(P,)`` of the ``"gp"`` mean
        :math:`f(x_*;\theta^*) + J_* s` (columns in the order of ``covar_module.engine.groups``), cached with
        :meth:`site_posterior` (:mod:`ntkgp.models.ntkgp.newton_step`)."""
        return self._fitted()[1]
