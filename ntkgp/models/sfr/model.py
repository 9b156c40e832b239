r"""SFR: a trained network as a sparse GP whose inducing points summarize all the data (Scannell et al.)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable

import gpytorch
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import GP
from torch import Tensor, nn

from ...botorch import BoTorchInterface, botorch_posterior
from ...caching import ValueCache
from ...distributed import check_distributed, check_replicated, together
from ...kernels import NTKKernel
from ...likelihoods import num_outputs as likelihood_outputs
from ...likelihoods import validate_targets
from ...ntk import GroupSpec, NTKEngine
from ...options import (
    InducingMethod,
    OutputCoupling,
    PredictiveMean,
    PriorMean,
    PriorStructure,
    StatisticsMode,
    choose,
    renamed_argument,
)
from .covariance import SparsePosteriorCovariance, per_batch_factors
from .data import InputLayout, StateGuard, check_inputs, positive_int, stream_statistics, training_batches
from .distributed import choose_inducing_inputs_distributed
from .inducing_points import choose_inducing_inputs
from .iterated import iterated_statistics
from .prediction_terms import PosteriorState, PredictiveTerms
from .statistics import combined_system_gram, system_grams
from .whitening import inducing_factors, roundoff, whitened_factors

__all__ = ["SFR"]


def _reset_after_load(module: SFR, incompatible_keys) -> None:
    """``load_state_dict`` post hook: new statistics / inducing inputs invalidate every cached factor."""
    module._generation += 1
    module._guard = StateGuard.of(module.engine, module.inducing_points)


class SFR(BoTorchInterface, GP):
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
    (setter, ``.data``, ``load_state_dict``, optimizer step), re-weights them at the next call: cached
    factorizations are keyed by those values (:class:`~ntkgp.caching.ValueCache`). The statistics were
    accumulated at the network's weights :math:`\theta^*`: if the weights change afterwards, every call raises
    ``RuntimeError`` (build a new model). In ``eval()`` mode (the state after construction) factorizations are
    cached and detached; in ``train()`` mode they are recomputed with gradients.

    **Combined statistics** (``statistics="combined"``, opt-in). The statistics and :math:`K_{ZZ}` are kept for
    the combined kernel :math:`\sum_g K_g/\delta_g` at the :math:`\delta` of the pass over the data (recorded in
    ``sfr.statistics.prior_precision``): ``G²`` times less memory for the statistics, ``G`` times less for
    :math:`K_{ZZ}` (docs/scaling.md, "Memory of SFR with joint coupling"), the same numbers as the default at
    that :math:`\delta`. In exchange :math:`\delta` is fixed: the constructor sets
    ``sfr.covar_module.raw_prior_precision.requires_grad_(False)`` (the noise and the temperature stay
    differentiable); once :math:`\delta` differs from the recorded one, every call raises ``RuntimeError``
    (nothing is mixed), and so does a computation that would differentiate through the statistics with respect
    to :math:`\delta` (if its gradient is switched on again).

    Args:
        net: the trained network ``(N, *input_shape) -> (N, C)``; never modified.
        train_x: training inputs ``(N, ...)``, or an iterable of ``(x, y)`` batches (a ``DataLoader``);
            read once (twice when inducing inputs are chosen from it), never stored.
        train_y: targets (any form :func:`~ntkgp.likelihoods.validate_targets` accepts); ``None`` with a loader.
        likelihood: a supported likelihood; becomes ``sfr.likelihood``.
        num_inducing: ``M``, inducing inputs chosen from the training inputs by ``inducing_method``.
        inducing_points: ``Z`` of shape ``(M, ...)`` like the inputs; exclusive with ``num_inducing``.
        prior_precision: initial :math:`\delta` (float or one per group).
        prior_structure: which parameters share a :math:`\delta`, see :class:`~ntkgp.NTKKernel` (``groups=``
            is its deprecated name).
        prior_mean: ``"linearized"`` (:math:`f(x) - J(x)\theta^*`) or ``"zero"``.
        predictive_mean: ``"gp"`` or ``"nn"`` (the network's output with SFR's covariance).
        output_coupling: ``"joint"`` (one ``MC×MC`` system, full likelihood Hessian) or ``"independent"``.
        inducing_method: ``"random"`` or ``"greedy_variance"`` (:mod:`~ntkgp.models.sfr.inducing_points`).
        batch_size: points per accumulation step, and per prediction chunk (``sfr(x, chunk_size=...)``
            overrides it); default: as many as keep the ``G`` cross-Grams under ``2**24`` numbers (docs/sfr.md).
        seed: seed of the random choices (inducing subset, candidate pool).
        progress: show a progress bar over the data.
        input_shape: shape of one input, when inputs arrive flat (see :class:`~ntkgp.NTKKernel`).
        chunk_size: examples per Jacobian / feature chunk of the NTK engine.
        pool_size: candidates for ``"greedy_variance"``.
        distributed: each rank of an initialized ``torch.distributed`` process group passes its shard of the
            training data (every rank the same network, as in DDP, and the same call); the statistics are
            all-reduced, so every rank holds the model of all the data, and :meth:`update` takes each rank's
            shard of the new data too. Inducing inputs chosen from the data are the ones one process would
            choose from the shards concatenated in rank order (docs/scaling.md, "Several processes and GPUs").
        statistics: ``"per_group"`` (default: per pair of prior groups, so that :math:`\delta` can change, and
            be learned by the evidence, without the data) or ``"combined"`` (for the combined kernel at the
            initial :math:`\delta`, ``G²`` times less memory; :math:`\delta` fixed, see above).

    Raises:
        ValueError, TypeError: for any invalid argument, naming it, before anything is computed.

    Example:
        >>> sfr = SFR(net, x, y, SoftmaxLikelihood(10), num_inducing=16, output_coupling="independent")
        >>> probs = sfr.likelihood(sfr(x_test)).probs
        >>> sfr = sfr.update(x_new, y_new)              # condition on new data, no retraining
    """

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
        inducing_method: str = "random",
        batch_size: int | None = None,
        seed: int = 0,
        progress: bool = False,
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 1024,
        pool_size: int = 4096,
        distributed: bool = False,
        statistics: str = "per_group",
        **kwargs,
    ) -> None:
        prior_structure = renamed_argument(kwargs, "groups", "prior_structure", prior_structure, "layer")
        if kwargs:
            raise TypeError(f"SFR got unexpected keyword arguments {sorted(kwargs)}")
        super().__init__()
        # ---- validate every argument before anything is computed
        self.statistics_mode = choose(StatisticsMode, statistics, "statistics")
        self.prior_mean = choose(PriorMean, prior_mean, "prior_mean")
        self.predictive_mean = choose(PredictiveMean, predictive_mean, "predictive_mean")
        self.output_coupling = choose(OutputCoupling, output_coupling, "output_coupling")
        method = choose(InducingMethod, inducing_method, "inducing_method")
        if isinstance(prior_structure, str):
            prior_structure = choose(PriorStructure, prior_structure, "prior_structure").value
        if (num_inducing is None) == (inducing_points is None):
            raise ValueError("give exactly one of num_inducing and inducing_points")
        num_inducing = None if num_inducing is None else positive_int(num_inducing, "num_inducing")
        self.batch_size = None if batch_size is None else positive_int(batch_size, "batch_size")
        self.chunk_size = positive_int(chunk_size, "chunk_size")
        pool_size = positive_int(pool_size, "pool_size")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.distributed = check_distributed(distributed)
        with together("checking train_x", self.distributed):  # this rank's shard
            expected_outputs = likelihood_outputs(likelihood)  # raises for unsupported likelihoods
            if torch.is_tensor(train_x):
                if train_y is None:
                    raise ValueError("train_y is required when train_x is a tensor")
                check_inputs(train_x, "train_x")
            if inducing_points is not None:
                check_inputs(inducing_points, "inducing_points")
            elif not torch.is_tensor(train_x) and iter(train_x) is train_x:
                raise ValueError(
                    "choosing inducing inputs from the data needs two passes over train_x, but it is a one-shot "
                    "iterator: pass a DataLoader (or tensors), or give inducing_points"
                )
        check_replicated([*net.parameters(), *net.buffers()], "the network's weights", self.distributed)
        if inducing_points is not None:
            check_replicated([inducing_points], "inducing_points", self.distributed)
        self.likelihood = likelihood
        self.covar_module = NTKKernel(
            net, prior_precision, prior_structure, input_shape=input_shape, chunk_size=self.chunk_size, progress=False
        )
        self.progress = progress

        # ---- the first batch fixes the examples' shape and C
        with together("checking train_x", self.distributed):
            pairs, first = self._first_batch(train_x, train_y, expected_outputs)
        if inducing_points is not None:
            with together("checking inducing_points", self.distributed):
                z = self.engine.prepare(self._layout.check(inducing_points, "inducing_points")[0], "inducing_points")
        elif self.distributed:
            z = choose_inducing_inputs_distributed(
                self.engine,
                lambda: train_x.shape[0] if torch.is_tensor(train_x) else sum(
                    bx.shape[0] for bx, _ in training_batches(train_x, train_y, "train")),
                lambda: (self._layout.check(bx, "train_x")[0] for bx, _ in training_batches(train_x, train_y, "train")),
                num_inducing, method, seed, pool_size, self.covar_module.prior_precision.detach().reciprocal(),
            )
            pairs = training_batches(train_x, train_y, "train")
            first = next(pairs)
        else:
            weights = self.covar_module.prior_precision.reciprocal()
            batches = (self._layout.check(bx, "train_x")[0] for bx, _ in training_batches(train_x, train_y, "train"))
            z = choose_inducing_inputs(self.engine, batches, num_inducing, method, seed, pool_size, weights)
            pairs = training_batches(train_x, train_y, "train")
            first = next(pairs)
        z = z.detach().clone()
        self.register_buffer("inducing_points", z)
        combined = self.statistics_mode is StatisticsMode.COMBINED
        delta = self.covar_module.prior_precision.detach()
        with together("the pass over train_x", self.distributed):
            self.statistics = stream_statistics(
                self.engine, likelihood, z, self.output_coupling, self.prior_mean, itertools.chain([first], pairs),
                self._layout, self._rows_per_step(), "train", progress, prior_precision=delta if combined else None,
            )
        self.statistics.all_reduce_(self.distributed)
        # per group: (G, nb, K, K); combined: (1, nb, K, K), K_ZZ(δ) at the δ of the statistics
        if combined:
            zz = combined_system_gram(self.engine, z, self.output_coupling, delta.reciprocal(), self._rows_per_step())
            # δ is fixed with combined statistics: no optimizer or evidence gradient should touch it
            self.covar_module.raw_prior_precision.requires_grad_(False)
        else:
            zz = system_grams(self.engine, z, z, self.output_coupling)
        self.register_buffer("_zz_grams", zz)
        self._guard = StateGuard.of(self.engine, z)
        self._generation = 0  # bumped by load_state_dict
        self._updates = 0  # bumped by update
        self._caches = {name: ValueCache(size=1) for name in ("inducing", "posterior", "z_jacobian")}
        self.register_load_state_dict_post_hook(_reset_after_load)
        self.eval()

    def _first_batch(self, train_x, train_y, expected_outputs: int):
        """The training pairs and their first batch; sets the examples' layout and ``C`` from it."""
        pairs = training_batches(train_x, train_y, "train")
        first = next(pairs, None)
        if first is None:
            raise ValueError("train_x holds no data")
        probe = self.engine.prepare(first[0][:1], "train_x")
        self._layout = InputLayout(tuple(probe.shape[1:]), self.engine.input_shape is not None)
        try:
            self.num_outputs = self.engine.num_outputs(probe)
        except RuntimeError as error:
            raise ValueError(f"train_x (examples of shape {tuple(probe.shape[1:])}) does not fit the network: {error}") from error
        if self.num_outputs != expected_outputs:
            raise ValueError(
                f"the network has {self.num_outputs} outputs but {type(self.likelihood).__name__} expects "
                f"{expected_outputs}"
            )
        return pairs, first

    # ------------------------------------------------------------------ construction helpers
    @property
    def engine(self) -> NTKEngine:
        """The :class:`~ntkgp.ntk.NTKEngine` of the kernel (holds the network by reference)."""
        return self.covar_module.engine

    @property
    def num_inducing(self) -> int:
        """``M``."""
        return self.inducing_points.shape[0]

    @property
    def num_data(self) -> int:
        """Number of data points summarized so far."""
        return int(self.statistics.num_data)

    @property
    def batch_shape(self) -> torch.Size:
        """The model's batch shape (BoTorch's ``Model.batch_shape``): SFR is one model, ``torch.Size([])``."""
        return torch.Size([])

    def _rows_per_step(self) -> int:
        """Points per accumulation step and prediction chunk: ``batch_size``, or the ``G`` cross-Grams under 2²⁴ numbers."""
        if self.batch_size is not None:
            return self.batch_size
        c, m, g = self.num_outputs, self.num_inducing, self.engine.num_groups
        per_point = g * m * c * (c if self.output_coupling is OutputCoupling.JOINT else 1)
        return max(1, (1 << 24) // per_point)

    def _check_state(self) -> None:
        """Raise if the network's weights or the inducing inputs changed since the statistics were computed, or,
        with combined statistics, the prior precisions."""
        self._guard.check(self.engine, self.inducing_points)
        self.statistics.check_prior_precision(self.covar_module.prior_precision)

    # ------------------------------------------------------------------ conditioning on new data
    def update(
        self, x_new: Tensor | Iterable[tuple[Tensor, Tensor]], y_new: Tensor | None = None, iterate: bool | None = None
    ) -> SFR:
        r"""Condition on new data: add its terms to :math:`B_u`, :math:`\tilde y_u` (the old data are not read).

        ``Z`` is unchanged and the network is not retrained. Where the new points' Gaussian sites sit
        (docs/sfr.md, "Updates"):

        * ``iterate=False`` (one step), and always for a Gaussian likelihood (exact sites): at the network's
          outputs :math:`f(x;\theta^*)`, as for the training data. The result equals building SFR on the union
          of the data with the same ``Z``; cost ``O(b (MC)^2 + (MC)^3)``. Classification points that the
          network gets confidently wrong overshoot (the step uses the curvature at θ*).
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
            TypeError: for a non-bool ``iterate`` and invalid inputs; ValueError: for invalid inputs and targets.
        """
        if iterate is None:
            iterate = not self.distributed
        if not isinstance(iterate, bool):
            raise TypeError(f"iterate must be True, False or None, got {iterate!r}")
        if iterate and self.distributed and not self.statistics.gaussian:
            raise ValueError("iterate=True is not data-parallel: a model built with distributed=True takes iterate=False")
        with together("SFR.update", self.distributed):  # this rank's shard of the new data
            self._check_state()
            if torch.is_tensor(x_new) and y_new is None:
                raise ValueError("y_new is required when x_new is a tensor")
            if iterate and not self.statistics.gaussian:
                new = self._iterated_statistics(x_new, y_new)
            else:
                new = stream_statistics(
                    self.engine, self.likelihood, self.inducing_points, self.output_coupling, self.prior_mean,
                    training_batches(x_new, y_new, "new"), self._layout, self._rows_per_step(), "new", self.progress,
                    prior_precision=self.statistics.prior_precision,
                )
        self.statistics.add_(new.all_reduce_(self.distributed))
        self._updates += 1
        return self

    def _iterated_statistics(self, x_new, y_new):
        """The new data's statistics with their sites at the mode (all batches checked and held in memory)."""
        xs, ys = [], []
        for bx, by in training_batches(x_new, y_new, "new"):
            xs.append(self.engine.prepare(self._layout.check(bx, "x_new")[0], "x_new"))
            ys.append(validate_targets(self.likelihood, by, self.num_outputs, num_data=bx.shape[0], name="y_new"))
        if not xs:
            raise ValueError("x_new holds no data")
        with torch.no_grad():
            weights = self.covar_module.prior_precision.reciprocal().detach()
            slots = self.statistics.slot_weights(self.likelihood).detach()
            inducing = self._inducing(weights)
        return iterated_statistics(
            self.engine, self.likelihood, self.inducing_points, self.output_coupling, self.prior_mean,
            torch.cat(xs), torch.cat(ys), self.statistics, inducing, weights, slots, self._rows_per_step(),
        )

    # ------------------------------------------------------------------ posterior factors
    def _key(self) -> Tensor:
        return torch.tensor([self._generation, self._updates])

    def _factors(self) -> PosteriorState:
        r"""The whitened factorization of the posterior at the current hyperparameters.

        In eval mode (with GPyTorch's ``detach_test_caches``) it is cached, detached, keyed by the values of
        :math:`1/\delta`, the slot weights and the statistics' generation; the factors of :math:`K_{ZZ}` alone
        are cached apart, keyed by :math:`1/\delta` only, so :meth:`update` and a change of the noise or
        temperature reuse them.
        """
        self._check_state()
        weights = self.covar_module.prior_precision.reciprocal()
        slots = self.statistics.slot_weights(self.likelihood)
        if self.training or not gpytorch.settings.detach_test_caches.on():
            return self._solve(weights, slots, self._inducing(weights))
        weights, slots = weights.detach(), slots.detach()
        generation = torch.tensor([self._generation])
        posterior = self._caches["posterior"]

        def new_inducing():  # a miss: drop the stale factors first, so that old and new never coexist
            posterior.clear()
            self._caches["inducing"].clear()
            return self._inducing(weights)

        def new_posterior(inducing):
            posterior.clear()
            return self._solve(weights, slots, inducing)

        inducing = self._caches["inducing"].get_or_compute("K_ZZ", [], new_inducing, state=[weights, generation])
        return posterior.get_or_compute(
            "posterior", [], lambda: new_posterior(inducing), state=[weights, slots, self._key()]
        )

    def _inducing(self, weights: Tensor):
        r"""The factors of :math:`K_{ZZ} = \sum_g w_g K_{g,ZZ}`; :math:`K_{ZZ}` itself is formed, factorized and
        released (recomputed from the per-group Grams only when needed again). Combined statistics keep
        :math:`K_{ZZ}(\delta)` itself, at the :math:`\delta` checked by :meth:`_check_state`: it is used as it is."""
        grams = self._zz_grams
        if self.statistics.combined:
            return inducing_factors(lambda: grams[0])
        return inducing_factors(lambda: torch.einsum("g,gbij->bij", weights, grams))

    def _solve(self, weights: Tensor, slots: Tensor, inducing) -> PosteriorState:
        b_u, y_u = self.statistics.projected(weights, slots)  # a fresh B_u, overwritten by the factorization
        eps = roundoff(self.engine.dtype, b_u.dtype)
        factors = whitened_factors(None, b_u, y_u, inducing=inducing, overwrite_b_u=True, eps=eps)
        return PosteriorState(weights=weights, slots=slots, factors=factors)

    def _z_jacobian(self) -> Tensor:
        """:math:`J(Z)`, ``(M·C, P)``, for predictions with a graph to the inputs (cached)."""
        return self._caches["z_jacobian"].get_or_compute(
            "J(Z)", [], lambda: self.engine.jacobian(self.inducing_points).detach(), state=[self._key()]
        )

    @property
    def inducing_rank(self) -> Tensor:
        """Number of inducing directions used per system, ``(1,)`` or ``(C,)``: ``M·C`` (or ``M``) unless
        :math:`K_{ZZ}` is numerically rank-deficient (see :func:`~ntkgp.models.sfr.whitening.whitened_factors`)."""
        return self._factors().factors.rank

    # ------------------------------------------------------------------ prediction
    def forward(self, x: Tensor, chunk_size: int | None = None) -> MultivariateNormal:
        """The posterior over :math:`f(x)` for ``x`` ``(*batch, n, *example)``, computed ``chunk_size`` points at a time.

        Args:
            x: test inputs (floating point, finite).
            chunk_size: test points per chunk; default the accumulation step (``batch_size``, or as many
                points as keep the ``G`` cross-Grams of a chunk under ``2**24`` numbers).

        Returns:
            ``MultivariateNormal`` ``(*batch, n)`` (``C = 1``) or ``MultitaskMultivariateNormal`` ``(*batch, n, C)``.
        """
        flat, batch = self._layout.check(x, "x", batched=True)
        chunk = self._rows_per_step() if chunk_size is None else positive_int(chunk_size, "chunk_size")
        x = self.engine.prepare(flat, "x")
        terms = PredictiveTerms(
            self.engine, self.inducing_points, self.output_coupling, self.num_outputs, self._factors(),
            self.prior_mean, self.predictive_mean, self._z_jacobian,
        )
        parts = []
        for start in range(0, x.shape[0], chunk):
            part = terms.chunk(x[start : start + chunk])
            if start + chunk < x.shape[0] or parts:  # more than one chunk: keep only the per-point results
                part.low_rank_z = part.low_rank_s = None
            parts.append(part)
        count, c = x.shape[0] // max(1, batch.numel()), self.num_outputs
        mean = torch.cat([p.mean for p in parts]).reshape(*batch, count, c)
        blocks = torch.cat([p.blocks for p in parts]).reshape(*batch, count, c, c)
        factors = [None, None]
        if len(parts) == 1:  # small enough to keep V and R⁻¹V (per batch element)
            factors = [per_batch_factors(f, batch) for f in (parts[0].low_rank_z, parts[0].low_rank_s)]
        covariance = SparsePosteriorCovariance(
            x.reshape(*batch, count, *x.shape[1:]), blocks, *factors, terms=terms, chunk_size=chunk
        )
        if c == 1:
            return MultivariateNormal(mean.squeeze(-1), covariance)
        return MultitaskMultivariateNormal(mean, covariance, interleaved=True)

    def posterior(self, X: Tensor, output_indices=None, observation_noise=False, posterior_transform=None, **kwargs):
        """BoTorch's ``Model.posterior``: a ``GPyTorchPosterior`` over ``f(X)`` for ``X`` ``(b, q, d)`` (BoTorch is
        imported here, only when called; ``pip install ntkgp[botorch]``).

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
        r"""The collapsed (Titsias / DTC) lower bound with the Gaussian sites, summed over the data.

        .. math::
            \mathcal L = c_0 + \tfrac12 \tilde y_u^\top (K_{ZZ} + B_u)^{-1} \tilde y_u
            - \tfrac12 \log\frac{|K_{ZZ} + B_u|}{|K_{ZZ}|}
            - \tfrac12 \textstyle\sum_n \operatorname{tr}(\Lambda_n K_{nn}) + \tfrac12 \operatorname{tr}(K_{ZZ}^{-1} B_u),

        :math:`c_0` = :meth:`~ntkgp.models.sfr.statistics.DualStatistics.data_fit`. Gaussian likelihood: a lower
        bound on the linearized GP's evidence :math:`\log N(y; m(X), K_{XX} + \sigma^2 I)`, equal at ``Z = X``.
        Classification: the sites are unnormalized Gaussians, so (Jensen) the value for any ``Z`` is at most
        the value at ``Z = X``; for the linearized mean that is NTKGP's Laplace-GGN evidence plus
        :math:`\frac12 v^\top H^{-1} v`, :math:`v = J^\top g - P_0 \theta^*` (zero at a stationary :math:`\theta^*`);
        see docs/sfr.md. Computed in whitened form (:math:`\log|I + A|`, :math:`\operatorname{tr} A`) from the
        statistics alone; differentiable w.r.t. :math:`\delta`, the Gaussian noise and the temperature in
        ``train()`` mode.
        """
        state = self._factors()
        fac, stats = state.factors, self.statistics
        log_det = 2 * fac.chol.diagonal(dim1=-2, dim2=-1).log().sum()  # log|I + A| = log(|K_ZZ + B_u| / |K_ZZ|)
        nystrom_trace = fac.a_diagonal.sum()  # tr(A) = tr(K_ZZ⁻¹ B_u)
        return (
            stats.data_fit(self.likelihood, state.slots)
            + 0.5 * fac.y_white.square().sum()
            - 0.5 * log_det
            - 0.5 * stats.trace_term(state.weights, state.slots)
            + 0.5 * nystrom_trace
        )

    def sparse_evidence(self) -> Tensor:
        """Deprecated name of :meth:`log_marginal_likelihood`."""
        warnings.warn(
            "SFR.sparse_evidence() is deprecated; use SFR.log_marginal_likelihood()", DeprecationWarning, stacklevel=2
        )
        return self.log_marginal_likelihood()

