r"""SFR: a trained network as a sparse GP whose inducing points summarize all the data (Scannell et al.)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import GP
from torch import Tensor, nn

from ...botorch import BoTorchInterface, botorch_posterior
from ...distributed import check_distributed, check_replicated, together
from ...kernels import NTKKernel
from ...likelihoods import num_outputs as likelihood_outputs
from ...option_groups import accepts_flat_keywords, check_group
from ...ntk import GroupSpec, NTKEngine
from ...options import (InducingMethod, OptionAttribute, OutputCoupling, PredictiveMean, PriorMean, PriorStructure,
                         StatisticsMode, choice, choose, option_attributes)
from ...persistence import CheckedLoad
from ...validation import optional_positive_int, positive_int
from .evidence import collapsed_bound
from .factorization import PosteriorCache, generation_key, inducing_feature_set, posterior_state, reset_after_load
from .factorization import z_jacobian
from .guard import StateGuard, state_key
from ...ntk.outputs import with_output
from ...ntk.private_copy import model_lock
from .inducing_points import inducing_inputs_from_data, model_dtype
from .options import SFRInducingOptions, SFRMemoryOptions
from .prediction import predictive_distribution
from .prediction_terms import PosteriorState, PredictiveTerms
from .prior_grid import PriorPrecisionTuning
from .statistics import statistics_dtype
from .streaming import counted, stream_statistics
from .subset import InducingSelection
from .system_grams import auto_chunk_size, inducing_features, inducing_grams, network_features, rows_per_step
from .updates import new_statistics
from .validation import (check_training_data, first_batch, integer, optional_bytes, pack_inputs, progress_flag,
                         training_batches)

__all__ = ["SFR"]

_PASS = "it shaped the pass over the data: the statistics would have to be recomputed from the data"
_CHOICE = "the inducing inputs were chosen with it at construction"


class SFR(PriorPrecisionTuning, InducingSelection, CheckedLoad, BoTorchInterface, GP):
    r"""Sparse function-space representation of a trained network: an inducing-point GP in closed form.

    The network's Laplace-GGN posterior, written with its dual parameters :math:`g_n`, :math:`\Lambda_n`
    (gradient and negative Hessian of :math:`\log p(y_n|f)` at :math:`f_n = f(x_n;\theta^*)`), is projected onto
    ``M`` inducing inputs :math:`Z` (docs/math.md, "SFR"):

    .. math::
        B_u = \sum_n K_{Zn} \Lambda_n K_{nZ}, \qquad \tilde y_u = \sum_n K_{Zn} (\Lambda_n (f_n - m_n) + g_n),

        \mu(x) = m(x) + K_{xZ} (K_{ZZ} + B_u)^{-1} \tilde y_u, \qquad
        \Sigma(x, x') = K_{xx'} - K_{xZ} [K_{ZZ}^{-1} - (K_{ZZ} + B_u)^{-1}] K_{Zx'},

    with the empirical NTK :math:`K = \sum_g \delta_g^{-1} J_g J_g^\top` (:class:`~ntkgp.NTKKernel`) and prior mean
    :math:`m`: the DTC / Titsias sparse approximation of the linearized network's GP with Gaussian sites; with
    ``Z = X`` it *is* that GP's posterior (the Laplace GLM predictive of NTKGP for the linearized mean). No
    variational optimization is involved. Evaluated in whitened form
    (:func:`~ntkgp.models.sfr.whitening.whitened_factors`): no jitter in ordinary cases, a numerically
    singular :math:`K_{ZZ}` loses its negligible directions (``sfr.inducing_rank``).

    ``sfr(x)`` takes ``x`` of shape ``(*batch, n, *example)`` and returns the joint posterior over
    :math:`f(x)` of each batch element: a :class:`~gpytorch.distributions.MultivariateNormal` (``C = 1``) or a
    :class:`~gpytorch.distributions.MultitaskMultivariateNormal` ``(*batch, n, C)`` (interleaved). Test points
    are processed ``chunk_size`` at a time; the covariance is a lazy
    :class:`~ntkgp.models.sfr.covariance.SparsePosteriorCovariance`. When ``x.requires_grad`` the mean and
    covariance are differentiable w.r.t. ``x``.

    **State.** The statistics are kept per parameter group and per noise / temperature slot, so a change of
    :math:`\delta` (``sfr.covar_module.prior_precision``), the Gaussian noise or the temperature, by any route
    (setter, ``.data``, ``load_state_dict``, optimizer step), re-weights them at the next call (cached
    factorizations are keyed by those values). The statistics were
    accumulated at the network's weights :math:`\theta^*` and inducing inputs :math:`Z`: if either changes afterwards,
    every call raises ``RuntimeError`` (build a new model). Their key is part of the ``state_dict``
    (:mod:`~ntkgp.models.sfr.guard`), so loading statistics saved at other weights raises too. In ``eval()`` mode
    (the state after construction) factorizations are cached and detached; in ``train()`` mode they are
    recomputed with gradients. A model can be pickled or ``torch.save``\ d whole (its caches are not saved).

    **Options after construction.** ``predictive_mean``, ``batch_size``, ``chunk_size`` and ``progress`` can be
    assigned (strings or enum members, validated as in the constructor); the model then equals one built with
    the new value. ``prior_mean``, ``output_coupling``, ``statistics``, ``inducing_method``, ``seed``,
    ``pool_size`` and ``distributed`` shaped the pass over the data: assigning another value raises
    ``AttributeError`` (build a new model).

    **Precision.** A float32 network gives float32 features of the data and test points, contracted in float64 with
    float64 features of ``Z`` (:mod:`~ntkgp.models.sfr.system_grams`, with its memory and time); sums and solves are
    float64, the mean is the network's output plus a correction (never :math:`f(x) - J(x)\theta^*` in float32),
    and results are returned in the network's dtype (docs/sfr.md, "float32").

    **Combined statistics** (``statistics="combined"``, opt-in): the statistics and :math:`K_{ZZ}` are kept for
    the combined kernel at the :math:`\delta` of the pass over the data (``sfr.dual_statistics.prior_precision``),
    in ``G²`` times less memory; :math:`\delta` is then fixed (``raw_prior_precision.requires_grad_(False)``), and
    every call raises ``RuntimeError`` once it differs from the recorded one (docs/sfr.md, "Combined statistics").

    Args:
        net: the trained network ``(N, *input_shape) -> (N, C)``; never modified.
        train_x: training inputs ``(N, ...)`` or a dict/tuple of tensors (docs/networks.md, "Dict and tuple inputs in
            the GPyTorch models"), or an iterable of ``(x, y)`` batches (a ``DataLoader``);
            read once (twice when inducing inputs are chosen from it), never stored.
        train_y: targets (any form :func:`~ntkgp.likelihoods.validate_targets` accepts); ``None`` with a loader.
        likelihood: a supported likelihood; becomes ``sfr.likelihood``.
        num_inducing: ``M``, inducing inputs chosen from the training inputs by ``inducing_method``.
        inducing_points: ``Z`` of shape ``(M, ...)`` like the inputs; exclusive with ``num_inducing``.
        prior_precision: initial :math:`\delta` (float or one per group).
        prior_structure: which parameters share a :math:`\delta`, see :class:`~ntkgp.NTKKernel`.
        prior_mean: ``"linearized"`` (:math:`f(x) - J(x)\theta^*`) or ``"zero"``.
        predictive_mean: ``"gp"`` or ``"nn"`` (the network's output with SFR's covariance).
        output_coupling: ``"joint"`` (one ``MC×MC`` system, full likelihood Hessian) or ``"independent"``.
        inducing: an :class:`~ntkgp.models.SFRInducingOptions` (``inducing_method``, ``pool_size``, ``seed``;
            ``None``: its defaults). Its fields as flat keywords (``seed=1``) still work, with a ``FutureWarning``,
            for one release.
        memory: a :class:`~ntkgp.models.SFRMemoryOptions` (``batch_size``, ``chunk_size``, ``statistics``,
            ``inducing_feature_bytes``; ``None``: its defaults); its fields as flat keywords likewise.
        progress: over the data: ``None`` (auto), ``True`` (a bar) or ``False`` (silent): :mod:`ntkgp.progress`.
        input_shape: shape of one input, when inputs arrive flat (see :class:`~ntkgp.NTKKernel`).
        distributed: each rank of an initialized ``torch.distributed`` process group passes its shard of the
            training data (every rank the same network, as in DDP, and the same call); the statistics are
            all-reduced, so every rank holds the model of all the data, and :meth:`update` takes each rank's
            shard of the new data too. Inducing inputs chosen from the data are the ones one process would
            choose from the shards concatenated in rank order (docs/scaling.md, "Several processes and GPUs").
        output: for a network returning a dict or a tuple, the key or index of the output to use
            (:mod:`ntkgp.ntk.outputs`).

    Raises:
        ValueError, TypeError: for any invalid argument, naming it, before anything is computed.

    Example:
        >>> sfr = SFR(net, x, y, SoftmaxLikelihood(10), num_inducing=16, output_coupling="independent")
        >>> probs = sfr.likelihood(sfr(x_test)).probs
        >>> sfr = sfr.update(x_new, y_new)              # condition on new data, no retraining
    """

    prior_mean = OptionAttribute(choice(PriorMean), fixed=_PASS + " (their residuals hold f_n − m_n)")
    output_coupling = OptionAttribute(choice(OutputCoupling), fixed=_PASS + " (they are kept per system)")
    statistics = OptionAttribute(choice(StatisticsMode), fixed=_PASS)
    distributed = OptionAttribute(check_distributed, fixed="the statistics were all-reduced over the ranks")
    inducing_method = OptionAttribute(choice(InducingMethod), fixed=_CHOICE)
    seed = OptionAttribute(integer, fixed=_CHOICE)
    pool_size = OptionAttribute(positive_int, fixed=_CHOICE)
    inducing_feature_bytes = OptionAttribute(optional_bytes, fixed="the inducing inputs' features were kept by it")
    predictive_mean = OptionAttribute(choice(PredictiveMean), on_change="_option_changed")
    batch_size = OptionAttribute(optional_positive_int, on_change="_option_changed")
    chunk_size = OptionAttribute(positive_int, on_change="_option_changed")
    progress = OptionAttribute(progress_flag, on_change="_option_changed")

    @accepts_flat_keywords(inducing=SFRInducingOptions, memory=SFRMemoryOptions)
    def __init__(
        self,
        net: nn.Module,
        train_x: Tensor | Iterable[tuple[Tensor, Tensor]],
        train_y: Tensor | None,
        likelihood: Likelihood,
        num_inducing: int | None = None,
        inducing_points: Tensor | None = None,
        prior_precision: float | Tensor = 1.0,
        prior_structure: GroupSpec = "layer",
        prior_mean: str = "linearized",
        predictive_mean: str = "gp",
        output_coupling: str = "joint",
        *,
        inducing: SFRInducingOptions | None = None,
        memory: SFRMemoryOptions | None = None,
        progress: bool | None = None,
        input_shape: tuple[int, ...] | None = None,
        distributed: bool = False, output: str | int | None = None,
    ) -> None:
        super().__init__()
        net = with_output(net, output)  # a network returning a dict or tuple: its output output= (ntkgp.ntk.outputs)
        # ---- validate every argument before anything is computed
        inducing = check_group(inducing, SFRInducingOptions, "inducing")
        memory = check_group(memory, SFRMemoryOptions, "memory")
        chunk_size, self.statistics, self.prior_mean = memory.chunk_size, memory.statistics, prior_mean
        self.predictive_mean, self.output_coupling, self.distributed = predictive_mean, output_coupling, distributed
        self.inducing_method, self.seed, self.pool_size = inducing.inducing_method, inducing.seed, inducing.pool_size
        self.batch_size, self.progress = memory.batch_size, progress
        self.inducing_feature_bytes = memory.inducing_feature_bytes
        self.chunk_size = 1024 if chunk_size is None else chunk_size  # None: from a memory budget, below
        if isinstance(prior_structure, str):
            prior_structure = choose(PriorStructure, prior_structure, "prior_structure").value
        if (num_inducing is None) == (inducing_points is None):
            raise ValueError("give exactly one of num_inducing and inducing_points")
        num_inducing = None if num_inducing is None else positive_int(num_inducing, "num_inducing")
        with together("checking train_x", self.distributed):  # this rank's shard
            expected_outputs = likelihood_outputs(likelihood)  # raises for unsupported likelihoods
            net, train_x, inducing_points = check_training_data(train_x, train_y, inducing_points, net)
        check_replicated([*net.parameters(), *net.buffers()], "the network's weights", self.distributed)
        if inducing_points is not None:
            check_replicated([inducing_points], "inducing_points", self.distributed)
        self.likelihood = likelihood
        self.covar_module = NTKKernel(net, prior_precision, prior_structure, input_shape=input_shape,
                                      chunk_size=self.chunk_size, progress=False)
        # ---- the first batch fixes the examples' layout and C
        with together("checking train_x", self.distributed):
            pairs, first, self._layout, self.num_outputs = first_batch(
                self.engine, train_x, train_y, type(likelihood).__name__, expected_outputs
            )
        if chunk_size is None:
            self.chunk_size = auto_chunk_size(self.engine, self.engine.prepare(first[0][:1], "train_x"))
        if inducing_points is not None:
            with together("checking inducing_points", self.distributed):
                z = self.engine.prepare(self._layout.check(inducing_points, "inducing_points")[0], "inducing_points")
            z = z.detach().clone()
        else:
            z = inducing_inputs_from_data(
                self.engine, train_x, train_y, self._layout, num_inducing, self.inducing_method, self.seed,
                self.pool_size, self.covar_module.prior_precision.reciprocal(), self.distributed, progress,
            )
            pairs = training_batches(train_x, train_y, "train")
            first = next(pairs)
        self.register_buffer("inducing_points", z)
        combined = self.statistics is StatisticsMode.COMBINED
        delta = self.covar_module.prior_precision.detach()
        exact = inducing_features(self.engine, z, progress, self.inducing_feature_bytes)  # once, in float64
        # per group: (G, nb, K, K); combined: (1, nb, K, K), K_ZZ(δ) at the δ of the statistics
        zz, self._zz_precision = inducing_grams(
            z, self.output_coupling, statistics_dtype(self.engine.dtype), exact,
            delta.reciprocal() if combined else None, self._rows_per_step(), progress,
        )
        z_features = network_features(self.engine, exact[0])  # kept in float64: the cross-Grams are float64
        del exact  # the float64 features: not held during the pass
        with together("the pass over train_x", self.distributed):
            self.dual_statistics = stream_statistics(
                self.engine, likelihood, z, self.output_coupling, self.prior_mean, counted(train_x, pairs, first),
                self._layout, self._rows_per_step(), "train", progress, prior_precision=delta if combined else None,
                z_features=z_features,
            )
        self.dual_statistics.all_reduce_(self.distributed)
        if combined:  # δ is fixed with combined statistics: no optimizer or evidence gradient should touch it
            self.covar_module.raw_prior_precision.requires_grad_(False)
        self.register_buffer("_zz_grams", zz)
        self.register_buffer("_state_key", state_key(self.engine, z))  # what the statistics belong to
        self._guard = StateGuard.of(self.engine, z)
        self._generation = 0  # bumped by load_state_dict
        self._updates = 0  # bumped by update
        self._cache = PosteriorCache(z_features, generation_key(self))
        self.register_load_state_dict_post_hook(reset_after_load)
        modes = [m.training for m in likelihood.modules()]
        self.eval()  # the model starts in eval mode; the user's likelihood keeps its own
        for module, mode in zip(likelihood.modules(), modes):
            module.training = mode

    # ------------------------------------------------------------------ properties and options
    @property
    def engine(self) -> NTKEngine:
        """The :class:`~ntkgp.ntk.NTKEngine` of the kernel (holds the network by reference)."""
        return self.covar_module.engine

    @property
    def num_inducing(self) -> int:
        """``M``."""
        return self.inducing_points.shape[0]

    @num_inducing.setter
    def num_inducing(self, value) -> None:
        raise AttributeError(
            f"SFR.num_inducing cannot be changed after construction ({_PASS}); build a new SFR with "
            f"num_inducing={value!r}"
        )

    @property
    def num_data(self) -> int:
        """Number of data points summarized so far."""
        return int(self.dual_statistics.num_data)

    @property
    def batch_shape(self) -> torch.Size:
        """The model's batch shape (BoTorch's ``Model.batch_shape``): SFR is one model, ``torch.Size([])``."""
        return torch.Size([])

    def _option_changed(self, name: str) -> None:
        """After an assignable option changed: nothing cached depends on ``predictive_mean``, ``batch_size`` or
        ``progress`` (they are read at each call); ``chunk_size`` is the kernel's (its engine's chunk)."""
        if name == "chunk_size":
            if "chunk_size" in option_attributes(type(self.covar_module)):  # the kernel rebuilds its engine
                self.covar_module.chunk_size = self.chunk_size
            else:
                self.engine.chunk_size = self.chunk_size

    def _rows_per_step(self) -> int:
        """Points per step and prediction chunk: ``batch_size``, or :func:`rows_per_step`."""
        if self.batch_size is not None:
            return self.batch_size
        return rows_per_step(self.engine, self.inducing_points, self.output_coupling, self.inducing_feature_bytes)

    def _check_state(self) -> None:
        """Raise if the network's weights or the inducing inputs changed since the statistics were computed, or,
        with combined statistics, the prior precisions."""
        self._guard.check(self.engine, self.inducing_points)
        self.dual_statistics.check_prior_precision(self.covar_module.prior_precision)

    # ------------------------------------------------------------------ conditioning on new data
    def update(
        self, x_new: Tensor | Iterable[tuple[Tensor, Tensor]], y_new: Tensor | None = None, iterate: bool | None = None
    ) -> SFR:
        r"""Condition on new data: add its terms to :math:`B_u`, :math:`\tilde y_u` (the old data are not read).

        ``Z`` is unchanged and the network is not retrained. Where the new points' Gaussian sites sit
        (docs/sfr.md, "Updates"):

        * ``iterate=False`` (one step), and always for a Gaussian likelihood (exact sites): at the network's
          outputs :math:`f(x;\theta^*)`, as for the training data. The result equals building SFR on the union
          of the data with the same ``Z`` (to rounding, wherever :math:`K_{ZZ}` keeps all its directions; see
          docs/sfr.md); cost ``O(b (MC)^2 + (MC)^3)``. Classification points that the network gets confidently
          wrong overshoot (the step uses the curvature at θ*).
        * ``iterate=True`` (default for classification): at the mode of the sparse model's log joint given the
          old sites, by damped Newton steps (:mod:`~ntkgp.models.sfr.iterated`), at the current prior
          precisions and temperature; a few ``(MC)^3`` solves more, and the new data are held in memory
          during the call.

        With ``statistics="combined"`` the new data are accumulated at the recorded :math:`\delta`, like the old
        ones; the call raises ``RuntimeError`` (before anything changes) if :math:`\delta` differs from it.

        Args:
            x_new: inputs ``(b, ...)``, or an iterable of ``(x, y)`` batches (then ``y_new=None``).
            y_new: targets.
            iterate: iterate the new sites to the mode (``None``: the default, ``True``; ``False`` for a model
                built with ``distributed=True``, which then takes each rank's shard of the new data and
                supports the one-step update only).

        Returns:
            ``self``. All batches are checked and summed aside first: a bad batch leaves the model unchanged.

        Raises:
            TypeError: for a non-bool ``iterate`` and invalid inputs; ValueError: for invalid inputs and targets;
            NotImplementedError: for inputs that require grad (the update is not differentiable in them: the
            gradient would be silently zero; targets that carry a graph, as BoTorch's fantasies, are used as values).
        """
        self.dual_statistics.add_(new_statistics(self, x_new, y_new, iterate))
        self._updates += 1
        return self

    # ------------------------------------------------------------------ posterior factors
    def _factors(self) -> PosteriorState:
        return posterior_state(self)  # the whitened factorization now (factorization.posterior_state)

    @property
    def inducing_rank(self) -> Tensor:
        """Number of inducing directions used per system, ``(1,)`` or ``(C,)``: ``M·C`` (or ``M``) unless
        :math:`K_{ZZ}` is numerically rank-deficient (see :func:`~ntkgp.models.sfr.whitening.whitened_factors`)."""
        return self._factors().factors.rank

    # ------------------------------------------------------------------ prediction
    def forward(self, x: Tensor, chunk_size: int | None = None) -> MultivariateNormal:
        """The posterior over :math:`f(x)` for ``x`` ``(*batch, n, *example)``, computed ``chunk_size`` points at a time.

        Args:
            x: test inputs (finite floating point, or token ids).
            chunk_size: test points per chunk; default the accumulation step (``batch_size``, or as many
                points as keep the ``G`` cross-Grams of a chunk under ``2**24`` numbers).

        Returns:
            ``MultivariateNormal`` ``(*batch, n)`` (``C = 1``) or ``MultitaskMultivariateNormal`` ``(*batch, n, C)``
            in the model's dtype (the network's, unless converted).
        """
        flat, batch = self._layout.check(pack_inputs(self.engine.net, x, "x"), "x", batched=True)
        chunk = self._rows_per_step() if chunk_size is None else positive_int(chunk_size, "chunk_size")
        with model_lock(self):  # one prediction (and cache fill) at a time per model: docs/guarantees.md, "Threads"
            x = self.engine.prepare(flat, "x")
            terms = PredictiveTerms(
                self.engine, self.inducing_points, self.output_coupling, self.num_outputs, self._factors(),
                self.prior_mean, self.predictive_mean, lambda: z_jacobian(self), inducing_feature_set(self),
            )
            return predictive_distribution(terms, x, batch, chunk, model_dtype(self.inducing_points, self.covar_module.raw_prior_precision), self.progress)

    def posterior(self, X: Tensor, output_indices=None, observation_noise=False, posterior_transform=None, **kwargs):
        """BoTorch's ``Model.posterior``: a ``GPyTorchPosterior`` over ``f(X)`` (BoTorch imported when called).

        Args:
            X: inputs ``(*batch, q, *example)``.
            output_indices: outputs to keep (default all).
            observation_noise: add the Gaussian likelihood's noise (``True``), or this noise tensor
                ``(*batch, q, C)``; classification likelihoods have none to add.
            posterior_transform: applied to the result.
            **kwargs: passed to :meth:`forward` (``chunk_size``).
        """
        return botorch_posterior(self, X, output_indices, observation_noise, posterior_transform, **kwargs)

    # ------------------------------------------------------------------ evidence
    def log_marginal_likelihood(self) -> Tensor:
        r"""The collapsed (Titsias / DTC) lower bound with the Gaussian sites, summed over the data
        (:func:`~ntkgp.models.sfr.evidence.collapsed_bound`).

        Gaussian likelihood: a lower bound on the linearized GP's evidence :math:`\log N(y; m(X), K_{XX} +
        \sigma^2 I)`, equal at ``Z = X``. Classification: the sites are unnormalized Gaussians, so (Jensen) the
        value for any ``Z`` is at most the value at ``Z = X``; for the linearized mean that is NTKGP's Laplace-GGN
        evidence plus :math:`\frac12 v^\top H^{-1} v`, :math:`v = J^\top g - P_0 \theta^*` (zero at a stationary
        :math:`\theta^*`); see docs/sfr.md. Computed from the statistics alone; differentiable w.r.t.
        :math:`\delta`, the Gaussian noise and the temperature in ``train()`` mode.
        """
        return collapsed_bound(self._factors(), self.dual_statistics, self.likelihood).to(model_dtype(self.inducing_points, self.covar_module.raw_prior_precision))
