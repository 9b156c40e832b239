r"""SFR: a trained network as a sparse GP whose inducing points summarise all the data (Scannell et al.)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from types import SimpleNamespace

import gpytorch
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import GP
from linear_operator.operators import LinearOperator
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..kernels import NTKKernel
from ..likelihoods import is_gaussian, num_outputs, validate_targets
from ..linalg import cholesky
from ..means import LinearisedNetworkMean
from ..ntk import GroupSpec
from .inducing_points import INDUCING_METHODS, greedy_variance, uniform_subset
from .sfr_statistics import COUPLINGS, DualStatistics, system_grams, system_grams_and_diagonal

PRIOR_MEANS = ("zero", "linearised")
PREDICTIVE_MEANS = ("gp", "nn")


class SFR(GP):
    r"""Sparse function-space representation of a trained network: an inducing-point GP in closed form.

    The network's Laplace-GGN posterior, written with its dual parameters :math:`\hat\alpha_n = g_n`,
    :math:`\hat\beta_n = \Lambda_n` (gradient and Hessian of :math:`\log p(y_n|f)` at :math:`f_n = f(x_n;\theta^*)`),
    is projected onto ``M`` inducing inputs :math:`Z` (MATH.md, "SFR"):

    .. math::
        B_u = \sum_n K_{Zn} \Lambda_n K_{nZ}, \qquad \tilde y_u = \sum_n K_{Zn} (\Lambda_n (f_n - m_n) + g_n),

        \mu(x) = m(x) + K_{xZ} (K_{ZZ} + B_u)^{-1} \tilde y_u, \qquad
        \Sigma(x, x') = K_{xx'} - K_{xZ} [K_{ZZ}^{-1} - (K_{ZZ} + B_u)^{-1}] K_{Zx'},

    with the empirical NTK :math:`K = \sum_g \delta_g^{-1} J_g J_g^\top` (:class:`~ntkgp.NTKKernel`) and prior mean
    :math:`m`. This is the DTC / Titsias sparse approximation of the linearised network's GP with Gaussian
    sites :math:`(\Lambda_n f_n + g_n, \Lambda_n)`: with ``Z = X`` it *is* that GP's posterior, i.e. the Laplace
    GLM predictive (NTKGP) for the linearised mean. No variational optimisation is involved. It is evaluated in
    the whitened form :math:`K_{ZZ}^{-1/2} B_u K_{ZZ}^{-\top/2} + I` (:func:`whitened_factors`), never through a
    Cholesky of :math:`K_{ZZ} + B_u`; a numerically singular :math:`K_{ZZ}` is handled by dropping its negligible
    eigen-directions (no jitter; ``sfr.inducing_rank`` reports how many are kept).

    ``sfr(x)`` returns a :class:`~gpytorch.distributions.MultivariateNormal` over :math:`f(x)` (``C = 1``) or a
    :class:`~gpytorch.distributions.MultitaskMultivariateNormal` of shape ``(N, C)`` (interleaved order);
    ``sfr.likelihood(sfr(x))`` is the predictive over :math:`y` (probit or Monte Carlo for classes). Its
    covariance is lazy: marginal variances and per-point ``C×C`` blocks cost ``O(N·C·(MC)²)`` without the
    test Gram; the full matrix is formed only when asked for.

    **Defaults, and why.**

    * ``prior_mean="linearised"``: :math:`m(x) = f(x;\theta^*) - J(x)\theta^*`, the prior mean of the
      linearised network, so that SFR is a sparse approximation of *the same* GP as NTKGP and equals it at
      ``Z = X``; at a stationary :math:`\theta^*` its mean is then anchored at the network. ``"zero"`` is the
      public SFR code's choice (reproduces its numbers).
    * ``predictive_mean="gp"``: the GP mean uses the data (and :meth:`update`); ``"nn"`` (the paper's
      SFR-NN) is the network's output with SFR's covariance and ignores updates.
    * ``output_coupling="full"``: one :math:`MC \times MC` system with the full softmax Hessian, exact for the
      model; ``"independent"`` keeps only the ``C`` diagonal :math:`M \times M` blocks (one kernel per output,
      diagonal of :math:`\Lambda`, as the public SFR code): about :math:`C^2` times cheaper.
    * ``inducing_method="random"``: a seeded uniform subset; ``"greedy_variance"`` (deterministic) serves
      better on clustered data, see :mod:`ntkgp.models.inducing_points`.

    **Hyperparameters.** The statistics are kept per parameter group and per noise/temperature slot
    (:class:`~ntkgp.models.sfr_statistics.DualStatistics`): changing the prior precisions
    ``sfr.covar_module.prior_precision`` or the Gaussian noise re-weights them (``O(G²(MC)²)``) and never
    touches the data or the Jacobians. :class:`~ntkgp.mlls.sparse_evidence.SparseLaplaceEvidence` learns them.
    In ``eval()`` mode (the state after construction) all factorisations that depend only on ``Z`` and the
    hyperparameters are cached (detached, as GPyTorch's ``detach_test_caches``); in ``train()`` mode they are
    recomputed with gradients.

    **Streaming.** The sums run over mini-batches; memory ``O(G²(MC)² + batch·C·P)``, never ``O(N²)``.
    :meth:`update` adds new data without reading the old.

    Args:
        net: the trained network ``(N, *input_shape) -> (N, C)``; never modified.
        train_x: training inputs ``(N, ...)``, or an iterable of ``(x, y)`` batches (a ``DataLoader``);
            read once (twice when inducing inputs are chosen from it), never stored.
        train_y: targets (any form :func:`~ntkgp.likelihoods.validate_targets` accepts); ``None`` with a loader.
        likelihood: a supported likelihood (as for NTKGP); becomes ``sfr.likelihood``.
        num_inducing: ``M``, inducing inputs chosen from the training inputs by ``inducing_method``.
        inducing_points: ``Z`` of shape ``(M, ...)`` (like the inputs); exclusive with ``num_inducing``.
        prior_precision: initial :math:`\delta` (float or one per group).
        groups: prior-precision groups, see :class:`~ntkgp.NTKKernel`.
        prior_mean: ``"linearised"`` or ``"zero"``.
        predictive_mean: ``"gp"`` or ``"nn"``.
        output_coupling: ``"full"`` or ``"independent"``.
        inducing_method: ``"random"`` or ``"greedy_variance"``.
        batch_size: points per accumulation step; default: as many as keep the cross-Gram block under
            ``2**24`` numbers. Batches of a loader are split further to respect it.
        seed: seed of the random choices (inducing subset, candidate pool).
        progress: show a progress bar over the data.
        input_shape: shape of one input, when inputs arrive flat (see :class:`~ntkgp.NTKKernel`).
        chunk_size: examples per Jacobian / feature chunk of the NTK engine (larger than the kernel's
            default: SFR streams many points, and per-chunk overheads dominate small chunks).
        pool_size: candidates for ``"greedy_variance"``.

    Example:
        >>> sfr = SFR(net, x, y, SoftmaxLikelihood(10), num_inducing=512, output_coupling="independent")
        >>> probs = sfr.likelihood(sfr(x_test)).probs
        >>> sfr.update(x_new, y_new)                    # condition on new data, no retraining
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
        groups: GroupSpec = "layer",
        prior_mean: str = "linearised",
        predictive_mean: str = "gp",
        output_coupling: str = "full",
        inducing_method: str = "random",
        batch_size: int | None = None,
        seed: int = 0,
        progress: bool = False,
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 1024,
        pool_size: int = 4096,
    ) -> None:
        super().__init__()
        for name, value, allowed in (
            ("prior_mean", prior_mean, PRIOR_MEANS),
            ("predictive_mean", predictive_mean, PREDICTIVE_MEANS),
            ("output_coupling", output_coupling, COUPLINGS),
            ("inducing_method", inducing_method, INDUCING_METHODS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if (num_inducing is None) == (inducing_points is None):
            raise ValueError("give exactly one of num_inducing and inducing_points")
        if batch_size is not None and (isinstance(batch_size, bool) or int(batch_size) < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        expected_outputs = num_outputs(likelihood)  # raises for unsupported likelihoods
        self.likelihood = likelihood
        self.covar_module = NTKKernel(
            net, prior_precision, groups=groups, input_shape=input_shape, chunk_size=chunk_size, progress=False
        )
        self.mean_module = LinearisedNetworkMean(self.engine) if prior_mean == "linearised" else None
        self.prior_mean = prior_mean
        self.predictive_mean = predictive_mean
        self.output_coupling = output_coupling
        self.batch_size = None if batch_size is None else int(batch_size)
        self.progress = progress
        if train_y is None and torch.is_tensor(train_x):
            raise ValueError("train_y is required when train_x is a tensor")

        if inducing_points is None and not torch.is_tensor(train_x) and iter(train_x) is train_x:
            raise ValueError(
                "choosing inducing inputs from the data needs two passes over train_x, but it is a one-shot "
                "iterator: pass a DataLoader (or tensors), or give inducing_points"
            )
        pairs = self._pairs(train_x, train_y, "train")
        first = next(pairs, None)
        if first is None:
            raise ValueError("train_x holds no data")
        self.num_outputs = self.engine.num_outputs(self.engine.prepare(first[0], "train_x"))
        if self.num_outputs != expected_outputs:
            raise ValueError(
                f"the network has {self.num_outputs} outputs but {type(likelihood).__name__} expects {expected_outputs}"
            )
        if inducing_points is not None:
            z = self._given_inducing_inputs(inducing_points, first[0])
        else:
            z = self._chosen_inducing_inputs(train_x, train_y, num_inducing, inducing_method, seed, pool_size)
            pairs = self._pairs(train_x, train_y, "train")
            first = next(pairs)
        self.register_buffer("inducing_points", z)
        self.register_buffer("_zz_grams", system_grams(self.engine, z, z, output_coupling))
        self.statistics = self._stream(itertools.chain([first], pairs))
        self._cache: SimpleNamespace | None = None
        self._zz_cache: SimpleNamespace | None = None
        self.eval()

    # ------------------------------------------------------------------ construction helpers
    @property
    def engine(self):
        """The :class:`~ntkgp.NTKEngine` of the kernel (holds the network by reference)."""
        return self.covar_module.engine

    @property
    def num_inducing(self) -> int:
        return self.inducing_points.shape[0]

    def _pairs(self, x: Tensor | Iterable, y: Tensor | None, name: str) -> Iterator[tuple[Tensor, Tensor]]:
        """``(x, y)`` batches from tensors or an iterable of pairs; checks lengths and targets."""
        if torch.is_tensor(x):
            if not torch.is_tensor(y):
                raise TypeError(f"{name}_y must be a tensor when {name}_x is, got {type(y).__name__}")
            if y.dim() == 0 or x.dim() == 0 or x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"{name}_x and {name}_y must have the same number of rows, got {tuple(x.shape)} and {tuple(y.shape)}"
                )
            yield x, y
            return
        if y is not None:
            raise ValueError(f"{name}_y must be None when {name}_x is a DataLoader or iterable of (x, y) batches")
        for batch in x:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TypeError(f"each batch of {name}_x must be a pair (x, y), got {type(batch).__name__}")
            bx, by = batch
            if not (torch.is_tensor(bx) and torch.is_tensor(by)) or bx.shape[0] != by.shape[0]:
                raise ValueError(f"each (x, y) batch of {name}_x must hold tensors with the same number of rows")
            yield bx, by

    def _given_inducing_inputs(self, inducing_points: Tensor, first_x: Tensor) -> Tensor:
        if not torch.is_tensor(inducing_points):
            raise TypeError(f"inducing_points must be a tensor, got {type(inducing_points).__name__}")
        flat_ok = inducing_points.dim() == 2 and inducing_points.shape[1] == first_x[0].numel()
        if inducing_points.dim() < 2 or not (inducing_points.shape[1:] == first_x.shape[1:] or flat_ok):
            raise ValueError(
                f"inducing_points must have shape (M, {', '.join(map(str, first_x.shape[1:]))}) like the "
                f"inputs, got {tuple(inducing_points.shape)}"
            )
        z = self.engine.prepare(inducing_points, "inducing_points")
        return z.reshape(z.shape[0], *first_x.shape[1:]).detach().clone()

    def _chosen_inducing_inputs(self, train_x, train_y, num_inducing, method: str, seed: int, pool_size: int) -> Tensor:
        if isinstance(num_inducing, bool) or int(num_inducing) < 1:
            raise ValueError(f"num_inducing must be a positive integer, got {num_inducing!r}")
        size = int(num_inducing)
        inputs = (bx for bx, _ in self._pairs(train_x, train_y, "train"))
        pool, total = uniform_subset(inputs, size if method == "random" else max(size, pool_size), seed)
        if total < size:
            raise ValueError(f"cannot choose {size} inducing inputs from {total} training inputs (num_inducing > N)")
        pool = self.engine.prepare(pool, "train_x").detach().clone()
        if method == "greedy_variance":
            pool = pool[greedy_variance(self.engine, pool, size, self.covar_module.prior_precision.reciprocal())]
        return pool

    def _rows_per_step(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        c, m, g = self.num_outputs, self.num_inducing, self.engine.num_groups
        per_point = g * m * c * (c if self.output_coupling == "full" else 1)
        return max(1, (1 << 24) // per_point)

    def _stream(self, pairs: Iterator[tuple[Tensor, Tensor]]) -> DualStatistics:
        """Accumulate fresh :class:`DualStatistics` over ``pairs`` (the model is unchanged until it succeeds)."""
        z = self.inducing_points
        stats = DualStatistics(
            self.engine.num_groups,
            self.num_inducing,
            self.num_outputs,
            self.output_coupling,
            is_gaussian(self.likelihood),
            z.dtype,
            z.device,
        )
        rows = self._rows_per_step()
        bar = tqdm(desc="SFR dual statistics", unit="pt", disable=not self.progress, leave=False)
        with torch.no_grad():
            for x, y in pairs:
                x = self.engine.prepare(x, "x")
                validate_targets(self.likelihood, y, self.num_outputs, num_data=x.shape[0])
                for s in range(0, x.shape[0], rows):
                    xb, yb = x[s : s + rows], y[s : s + rows]
                    f = self.engine.outputs(xb)
                    cross, diag = system_grams_and_diagonal(self.engine, z, xb, self.output_coupling)
                    stats.accumulate(self.likelihood, cross, diag, f, self._prior_mean(xb, f), yb)
                    bar.update(xb.shape[0])
        bar.close()
        return stats

    def _prior_mean(self, x: Tensor, f: Tensor | None = None) -> Tensor:
        """Prior mean ``m(x)``, shape ``(N, C)``."""
        if self.mean_module is None:
            shape = (x.shape[0], self.num_outputs)
            return torch.zeros(shape, dtype=self.inducing_points.dtype, device=self.inducing_points.device)
        return self.mean_module(x).reshape(x.shape[0], self.num_outputs)

    # ------------------------------------------------------------------ conditioning on new data
    def update(self, x_new: Tensor | Iterable[tuple[Tensor, Tensor]], y_new: Tensor | None = None) -> SFR:
        r"""Condition on new data: add its terms to :math:`B_u`, :math:`\tilde y_u` (the old data are not read).

        ``f``, ``g``, :math:`\Lambda` come from the network at :math:`\theta^*`; ``Z`` is unchanged. The result
        equals building SFR on the union of the data with the same ``Z``; cost ``O(b (MC)^2 + (MC)^3)``.
        Accepts tensors or an iterable of ``(x, y)`` batches (then ``y_new=None``). Returns ``self``.
        """
        new = self._stream(self._pairs(x_new, y_new, "new"))
        self.statistics.add_(new)
        self._cache = None
        return self

    @property
    def num_data(self) -> int:
        """Number of data points summarised so far."""
        return int(self.statistics.num_data)

    # ------------------------------------------------------------------ posterior factors
    def _factors(self) -> SimpleNamespace:
        r"""The whitened factorisation of the posterior (see :func:`whitened_factors`), per system.

        Cached (detached) in eval mode, keyed by the hyperparameters' values and the statistics' version; the
        factors of :math:`K_{ZZ}` alone (:func:`inducing_factors`) are cached apart, keyed by the prior
        precisions only, so :meth:`update` and a change of the noise or temperature reuse them.
        """
        weights = self.covar_module.prior_precision.reciprocal()
        slots = self.statistics.slot_weights(self.likelihood)
        use_cache = not self.training and gpytorch.settings.detach_test_caches.on()
        if use_cache:
            weights, slots = weights.detach(), slots.detach()
            key = self._cache
            if (
                key is not None
                and key.version == self.statistics.version
                and torch.equal(key.weights, weights)
                and torch.equal(key.slots, slots)
            ):
                return key
        inducing = self._zz_cache if use_cache else None
        grams_key = (self._zz_grams.data_ptr(), self._zz_grams._version)
        if inducing is None or inducing.grams_key != grams_key or not torch.equal(inducing.weights, weights):
            inducing = inducing_factors(torch.einsum("g,gbij->bij", weights, self._zz_grams))
            inducing.weights, inducing.grams_key = weights, grams_key
            if use_cache:
                self._zz_cache = inducing
        b_u, y_u = self.statistics.projected(weights, slots)
        factors = whitened_factors(inducing.kzz, b_u, y_u, inducing=inducing)
        factors.version, factors.weights, factors.slots = self.statistics.version, weights, slots
        if use_cache:
            self._cache = factors
        return factors

    @property
    def inducing_rank(self) -> Tensor:
        """Number of inducing directions used per system, ``(1,)`` or ``(C,)``: ``M·C`` (or ``M``) unless
        :math:`K_{ZZ}` is numerically rank-deficient (see :func:`whitened_factors`)."""
        return self._factors().rank

    # ------------------------------------------------------------------ prediction
    def forward(self, x: Tensor) -> MultivariateNormal:
        """The posterior over :math:`f(x)`: ``MultivariateNormal`` (C = 1) or ``MultitaskMultivariateNormal`` ``(N, C)``."""
        x = self.engine.prepare(x, "x")
        n, c = x.shape[0], self.num_outputs
        fac = self._factors()
        grams, diag = system_grams_and_diagonal(self.engine, self.inducing_points, x, self.output_coupling)
        cross_t = torch.einsum("g,gbkr->bkr", fac.weights, grams)  # K_Zx per system, (nb, K, R)
        if self.predictive_mean == "nn":
            mean = self.engine.outputs(x)
        else:
            correction = torch.einsum("bkr,bk->br", cross_t, fac.alpha)
            correction = correction.view(n, c) if self.output_coupling == "full" else correction.T
            mean = self._prior_mean(x) + correction
        low_rank_z, low_rank_s = fac.project(cross_t)
        blocks = torch.einsum("g,gnij->nij", fac.weights, diag)
        if self.output_coupling == "independent":
            blocks = torch.diag_embed(blocks.diagonal(dim1=-2, dim2=-1))
        covariance = SparsePosteriorCovariance(
            blocks, low_rank_z, low_rank_s, dense_prior=lambda: self._dense_prior(x)
        )
        if c == 1:
            return MultivariateNormal(mean.squeeze(-1), covariance)
        return MultitaskMultivariateNormal(mean, covariance, interleaved=True)

    def _dense_prior(self, x: Tensor) -> Tensor:
        """The prior covariance of ``f(x)``, ``(N·C, N·C)`` interleaved (output-diagonal blocks only if independent)."""
        prior = torch.einsum("g,gij->ij", self.covar_module.prior_precision.reciprocal(), self.engine.group_grams(x))
        if self.output_coupling == "independent":
            c = self.num_outputs
            mask = torch.eye(c, dtype=torch.bool, device=prior.device).repeat(x.shape[0], x.shape[0])
            prior = prior * mask
        return prior

    # ------------------------------------------------------------------ evidence
    def sparse_evidence(self) -> Tensor:
        r"""The collapsed (Titsias / DTC) lower bound with the Gaussian sites, summed over the data.

        .. math::
            \mathcal L = c_0 + \tfrac12 \tilde y_u^\top (K_{ZZ} + B_u)^{-1} \tilde y_u
            - \tfrac12 \log\frac{|K_{ZZ} + B_u|}{|K_{ZZ}|}
            - \tfrac12 \textstyle\sum_n \operatorname{tr}(\Lambda_n K_{nn}) + \tfrac12 \operatorname{tr}(K_{ZZ}^{-1} B_u),

        :math:`c_0` = :meth:`DualStatistics.data_fit`. It is the Titsias bound on :math:`\log \int \prod_n t_n(f_n)
        \, N(f; m, K)\, df` with the sites :math:`t_n(f) = \exp(\log p(y_n|f_n^*) + g_n^\top (f - f_n^*) - \frac12
        (f - f_n^*)^\top \Lambda_n (f - f_n^*))`. Gaussian likelihood: the sites are exact, so it bounds the
        linearised GP's evidence :math:`\log N(y; m(X), K_{XX} + \sigma^2 I)` (equality at ``Z = X``).
        Classification: the sites are unnormalised Gaussians in :math:`f` (precision :math:`\Lambda_n \succeq 0`), so
        Jensen's inequality gives, by construction, value(``Z``) :math:`\le` value(``Z = X``) for any ``Z`` (same
        coupling; ``"independent"`` uses the diagonal of :math:`\Lambda_n`, i.e. other sites). For the linearised
        mean the value at ``Z = X`` is :math:`\log q(D) + \frac12 v^\top H^{-1} v \ge \log q(D)` with
        :math:`v = J^\top g - P_0 \theta^*` (the gradient of the regularised log joint), :math:`\log q(D)` being
        NTKGP's Laplace-GGN evidence: so the sparse value is *not* a bound on :math:`\log q(D)` unless
        :math:`\theta^*` is stationary (:math:`v = 0`); it exceeds it by at most :math:`\frac12 v^\top H^{-1} v`.
        Computed in the whitened form of :func:`whitened_factors` (:math:`\log|I + A|`, :math:`\operatorname{tr} A`),
        which keeps it a bound when :math:`K_{ZZ}` is numerically singular. Differentiable w.r.t. :math:`\delta`,
        the Gaussian noise and the temperature (in ``train()`` mode).
        """
        fac = self._factors()
        stats = self.statistics
        log_det = 2 * fac.chol.diagonal(dim1=-2, dim2=-1).log().sum()  # log|I + A| = log(|K_ZZ + B_u| / |K_ZZ|)
        nystrom_trace = fac.a.diagonal(dim1=-2, dim2=-1).sum()  # tr(A) = tr(K_ZZ⁻¹ B_u)
        return (
            stats.data_fit(self.likelihood, fac.slots)
            + 0.5 * fac.y_white.square().sum()
            - 0.5 * log_det
            - 0.5 * stats.trace_term(fac.weights, fac.slots)
            + 0.5 * nystrom_trace
        )


def whitened_factors(
    kzz: Tensor,
    b_u: Tensor,
    y_u: Tensor,
    gram_factor: float = 10.0,
    site_factor: float = 10.0,
    inducing: SimpleNamespace | None = None,
) -> WhitenedFactors:
    r"""SFR's posterior in whitened ("SGPR") form, batched over systems ``(nb, K, K)``; no jitter in ordinary cases.

    With a whitening :math:`W` of :math:`K_{ZZ}` (:math:`W^\top W = K_{ZZ}^{-1}`, e.g. :math:`W = L_Z^{-1}`),
    :math:`A = W B_u W^\top` and :math:`R R^\top = I + A` (eigenvalues :math:`\ge 1`, so this Cholesky never
    needs jitter), :math:`K_{ZZ} + B_u = W^{-1}(I + A)W^{-\top}` gives

    .. math::
        (K_{ZZ} + B_u)^{-1} = W^\top R^{-\top} R^{-1} W, \qquad
        K_{ZZ}^{-1} - (K_{ZZ} + B_u)^{-1} = W^\top [I - (I + A)^{-1}] W,

        \log\frac{|K_{ZZ} + B_u|}{|K_{ZZ}|} = 2\textstyle\sum_i \log R_{ii}, \qquad
        \operatorname{tr}(K_{ZZ}^{-1} B_u) = \operatorname{tr} A,

    so the mean is :math:`K_{xZ} (R^{-1}W)^\top (R^{-1}W)\tilde y_u` and the covariance
    :math:`K_{xx} - V^\top V + (R^{-1}V)^\top(R^{-1}V)` with :math:`V = W K_{Zx}`. Unlike a Cholesky of
    :math:`K_{ZZ} + B_u` (whose condition number is about that of :math:`K_{ZZ}` times :math:`\|B_u\|/\|K_{ZZ}\|`,
    huge for small noise), nothing here is worse conditioned than :math:`K_{ZZ}` itself.

    **Rank-deficient** :math:`K_{ZZ}` (duplicate inducing inputs; ``M·C > P``; or, commonly, a smooth
    low-dimensional NTK whose Gram is singular to working precision, as in 1-D regression). Rounding in
    :math:`K_{ZZ}` perturbs :math:`Q = K_{xZ}K_{ZZ}^{-1}K_{Zx}` by about :math:`\epsilon\, s_{\max}/s` in a direction of
    :math:`K_{ZZ}` with eigenvalue :math:`s`, and rounding in the stored sum :math:`B_u` (about
    :math:`\epsilon\operatorname{tr}B_u` in every direction) perturbs :math:`A` by about :math:`\epsilon\operatorname{tr}B_u/s`
    there. Directions with :math:`s \le \tau`,

    .. math::
        \tau = \max\big(c_K\, \epsilon \operatorname{tr}K_{ZZ},\; c_B\, \epsilon\operatorname{tr}B_u\big),
        \qquad c_K = \text{gram\_factor} = 10,\ c_B = \text{site\_factor} = 10,

    are therefore dropped: :math:`W = \tilde L^{-1} U_r^\top` with :math:`U_r` the eigenvectors of :math:`K_{ZZ}` with
    eigenvalues above :math:`\tau` and :math:`\tilde L \tilde L^\top = U_r^\top K_{ZZ} U_r`. This is *exactly* the sparse
    model whose inducing variables are the ``r`` linear functionals :math:`U_r^\top f(Z)` (an inter-domain
    inducing set): the posterior stays a valid DTC posterior (rounding cannot make :math:`Q` exceed :math:`K`,
    i.e. inflate or negate variances) and the collapsed evidence stays a lower bound; with duplicate inputs it
    is exactly the model without the duplicates. No jitter is added and no warning is raised: this is an
    ordinary situation, reported by ``rank``. The constants were set against a stable weight-space reference
    (SVD of the Jacobian features) on the demo's trained networks: predictive means within about
    :math:`10^{-4}`, variances within about :math:`3\cdot10^{-3}` (relative, for variances :math:`10^{5}` times
    below the prior's) and the evidence within :math:`10^{-3}` nats (below it); larger :math:`\tau` loses more of
    the subspace, smaller lets rounding in :math:`B_u` break the bound. The fast path, a plain Cholesky
    :math:`W = L_Z^{-1}`, is taken when it succeeds and :math:`\operatorname{tr}(K_{ZZ}^{-1})\,\tau \le 1` (which
    guarantees :math:`s_{\min} \ge \tau`) or a power-iteration estimate of :math:`1/s_{\min}` times
    :math:`\tau` is :math:`\le 1/2`: then nothing is dropped and the result is the exact formula (the
    eigendecomposition, ~40 times a Cholesky, is paid only when directions may have to be dropped). The basis
    :math:`U_r` is computed without gradients (the inducing functionals are held fixed when differentiating
    w.r.t. the hyperparameters; eigenvector gradients are singular at repeated eigenvalues).
    :func:`~ntkgp.linalg.cholesky` is used for :math:`I + A` and would add jitter with a
    :class:`~ntkgp.linalg.JitterWarning` only if rounding made it indefinite, which the choice of
    :math:`\tau` excludes in practice.

    **Cost.** :math:`W` is never formed: it is applied by triangular solves with :math:`L_Z` (:class:`Whitening`),
    so :math:`A = L_Z^{-1} B_u L_Z^{-\top}` costs two triangular solves (:math:`2K^3` flops, against
    :math:`K^3` for an explicit inverse and :math:`4K^3` for the two products), and the two tests on
    :math:`s_{\min}` (either suffices) are evaluated cheapest first: the power iteration by solves
    (:math:`O(K^2)` per step), then, only if it fails, :math:`\operatorname{tr}(K_{ZZ}^{-1})` from
    ``cholesky_inverse`` (:math:`\frac23 K^3`). Everything that depends on :math:`K_{ZZ}` alone
    (its Cholesky factor and the two estimates) comes from ``inducing`` (:func:`inducing_factors`) when given,
    so a change of the statistics (:meth:`SFR.update`) refactorises only :math:`I + A`.

    Returns a :class:`WhitenedFactors` with ``kzz``, ``b_u``, ``y_u``, ``whitening`` :math:`W`
    (:class:`Whitening`), ``a`` :math:`A`, ``chol`` :math:`R`, ``y_white`` :math:`R^{-1}W\tilde y_u`, ``alpha``
    :math:`(K_{ZZ}+B_u)^{-1}\tilde y_u` (pseudo-inverse in the dropped case) and ``rank``; ``white`` and
    ``solve`` (:math:`R^{-1}W`) form the explicit matrices on demand.
    """
    zz = inducing_factors(kzz) if inducing is None else inducing
    size = kzz.shape[-1]
    eps = torch.finfo(kzz.dtype).eps
    eye = torch.eye(size, dtype=kzz.dtype, device=kzz.device)
    b_trace = b_u.detach().diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0)
    threshold = torch.maximum(gram_factor * eps * zz.k_trace, site_factor * eps * b_trace)  # (nb,)
    whitening = None
    if zz.chol is not None:
        # either test suffices; the power iteration (O(K²) per step) is tried before tr(K_ZZ⁻¹) (O(K³))
        if zz.inverse_norm is None:
            zz.inverse_norm = _inverse_norm(Whitening(zz.chol.detach()))
        fast = bool((zz.inverse_norm * threshold <= 0.5).all())
        if not fast:
            if zz.inverse_trace is None:  # tr(K_ZZ⁻¹) ≥ 1/s_min
                zz.inverse_trace = torch.cholesky_inverse(zz.chol.detach()).diagonal(dim1=-2, dim2=-1).sum(-1)
            fast = bool((zz.inverse_trace * threshold <= 1).all())
        if fast:
            whitening = Whitening(zz.chol)
    if whitening is None:
        whitening = _truncated_whitening(kzz, threshold)
    a = whitening.sandwich(b_u)
    chol = cholesky(eye + a, "I + A (whitened SFR system)")
    y_white = torch.linalg.solve_triangular(chol, whitening.apply(y_u.unsqueeze(-1)), upper=False)
    alpha = whitening.apply_t(torch.linalg.solve_triangular(chol.mT, y_white, upper=True)).squeeze(-1)
    return WhitenedFactors(
        kzz=kzz, b_u=b_u, y_u=y_u, whitening=whitening, a=a, chol=chol, y_white=y_white.squeeze(-1), alpha=alpha,
        rank=whitening.rank(),
    )


def inducing_factors(kzz: Tensor) -> SimpleNamespace:
    r"""What :func:`whitened_factors` needs of :math:`K_{ZZ}` alone, ``(nb, K, K)``: ``kzz``, its trace
    ``k_trace``, its Cholesky factor ``chol`` (``None`` if that fails) and, filled in lazily by
    :func:`whitened_factors`, ``inverse_trace`` :math:`\operatorname{tr}(K_{ZZ}^{-1})` and ``inverse_norm``
    (:func:`_inverse_norm`). Reusable for any :math:`B_u` (an update of the statistics refactorises only
    :math:`I + A`)."""
    chol_z, info = torch.linalg.cholesky_ex(kzz)
    return SimpleNamespace(
        kzz=kzz,
        k_trace=kzz.detach().diagonal(dim1=-2, dim2=-1).sum(-1),
        chol=None if info.any() else chol_z,
        inverse_trace=None,
        inverse_norm=None,
    )


class Whitening:
    r"""The whitening :math:`W = L^{-1} U^\top` of :math:`K_{ZZ}` (``U = I`` on the fast path, else the kept
    eigenvectors :math:`U_r` with zero columns for the dropped directions), applied by triangular solves:
    :math:`W` is never formed (:attr:`dense` forms it, for inspection)."""

    def __init__(self, chol: Tensor, basis: Tensor | None = None) -> None:
        self.chol = chol
        self.basis = basis

    def apply(self, rhs: Tensor) -> Tensor:
        """:math:`W X` for ``X`` ``(nb, K, k)``."""
        if self.basis is not None:
            rhs = self.basis.mT @ rhs
        return torch.linalg.solve_triangular(self.chol, rhs, upper=False)

    def apply_t(self, rhs: Tensor) -> Tensor:
        r""":math:`W^\top X` for ``X`` ``(nb, K, k)``."""
        out = torch.linalg.solve_triangular(self.chol.mT, rhs, upper=True)
        return out if self.basis is None else self.basis @ out

    def sandwich(self, b: Tensor) -> Tensor:
        r""":math:`W B W^\top` (symmetrised) for symmetric ``B`` ``(nb, K, K)``: two triangular solves."""
        if self.basis is not None:
            b = self.basis.mT @ b @ self.basis
        half = torch.linalg.solve_triangular(self.chol, b, upper=False)  # L⁻¹ B
        out = torch.linalg.solve_triangular(self.chol, half.mT, upper=False)  # L⁻¹ B L⁻ᵀ (B symmetric)
        return 0.5 * (out + out.mT)

    @property
    def dense(self) -> Tensor:
        eye = torch.eye(self.chol.shape[-1], dtype=self.chol.dtype, device=self.chol.device)
        return self.apply(eye.expand_as(self.chol))

    def rank(self) -> Tensor:
        """Directions kept per system, ``(nb,)``."""
        size = self.chol.shape[-1]
        if self.basis is None:
            return torch.full(self.chol.shape[:-2], size, dtype=torch.long, device=self.chol.device)
        return (self.basis.detach().abs().sum(-2) > 0).sum(-1)


class WhitenedFactors(SimpleNamespace):
    r"""The result of :func:`whitened_factors`; :meth:`project` gives the low-rank factors of the predictive."""

    def project(self, cross_t: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`V = W K_{Zx}` and :math:`R^{-1} V` for ``cross_t`` :math:`K_{Zx}` ``(nb, K, k)``: two triangular
        solves (``2 K^2 k`` flops)."""
        v = self.whitening.apply(cross_t)
        return v, torch.linalg.solve_triangular(self.chol, v, upper=False)

    @property
    def white(self) -> Tensor:
        """:math:`W`, formed explicitly (for inspection)."""
        return self.whitening.dense

    @property
    def solve(self) -> Tensor:
        r""":math:`R^{-1} W`, formed explicitly (for inspection)."""
        return torch.linalg.solve_triangular(self.chol, self.white, upper=False)


def _inverse_norm(white: Whitening, iterations: int = 30) -> Tensor:
    r"""Power-iteration estimate of :math:`\|W\|_2^2 = 1/s_{\min}(K_{ZZ})`, ``(nb,)``, from a fixed pseudo-random
    start (products with :math:`W`, :math:`W^\top` by triangular solves); it underestimates (typically by well
    under a factor 2 after 30 iterations), hence the factor 2 margin in the test that uses it. Keeping a
    direction slightly below the (already conservative) threshold is harmless."""
    size = white.chol.shape[-1]
    start = torch.randn(size, 1, generator=torch.Generator().manual_seed(0), dtype=white.chol.dtype)
    v = start.to(white.chol.device).expand(*white.chol.shape[:-2], -1, -1)
    for _ in range(iterations):
        v = white.apply_t(white.apply(v))
        v = v / v.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(white.chol.dtype).tiny)
    return white.apply(v).square().sum((-2, -1))


def _truncated_whitening(kzz: Tensor, threshold: Tensor) -> Whitening:
    """``W`` with rows only for the eigen-directions of ``kzz`` above ``threshold`` (zero rows else)."""
    values, vectors = torch.linalg.eigh(kzz.detach())
    keep = values > threshold[:, None]
    basis = vectors * keep.unsqueeze(-2).to(vectors)  # dropped columns zeroed
    reduced = basis.mT @ kzz @ basis + torch.diag_embed((~keep).to(kzz))  # identity in the dropped slots
    reduced = 0.5 * (reduced + reduced.mT)
    chol = cholesky(reduced, "K_ZZ on its leading eigenvectors")
    return Whitening(chol, basis)


class SparsePosteriorCovariance(LinearOperator):
    r"""The SFR posterior covariance :math:`K_{xx} - A^\top A + W^\top W` of ``N`` points, ``(N·C, N·C)`` interleaved.

    :math:`A = V = W_Z K_{Zx}` and :math:`W = R^{-1} V` with the whitening :math:`W_Z` of :math:`K_{ZZ}` and
    :math:`R R^\top = I + W_Z B_u W_Z^\top` (:func:`whitened_factors`), so
    :math:`A^\top A - W^\top W = K_{xZ}[K_{ZZ}^{-1} - (K_{ZZ}+B_u)^{-1}]K_{Zx}`.
    Marginal variances and the per-point ``C×C`` blocks come from the prior's diagonal blocks and column sums
    of :math:`A`, :math:`W` — the test Gram :math:`K_{xx}` is formed (once) only for other entries or products.

    Args:
        blocks: prior per-point blocks :math:`K(x_n, x_n)`, ``(N, C, C)``.
        low_rank_z: :math:`A`, ``(1, K, N·C)`` (full coupling) or ``(C, M, N)`` (independent outputs).
        low_rank_s: :math:`W`, same shape.
        dense_prior: callable returning the dense prior ``(N·C, N·C)``.
    """

    def __init__(self, blocks: Tensor, low_rank_z: Tensor, low_rank_s: Tensor, *, dense_prior) -> None:
        super().__init__(blocks, low_rank_z, low_rank_s, dense_prior=dense_prior)
        self.blocks = blocks
        self.low_rank_z = low_rank_z
        self.low_rank_s = low_rank_s
        self.dense_prior = dense_prior
        self._dense: Tensor | None = None

    def _size(self) -> torch.Size:
        n = self.blocks.shape[0] * self.blocks.shape[-1]
        return torch.Size([n, n])

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def _column_sums(self) -> Tensor:
        """:math:`\\operatorname{diag}(A^\\top A - W^\\top W)` as ``(N, C)``."""
        sums = self.low_rank_z.square().sum(-2) - self.low_rank_s.square().sum(-2)  # (nb, R)
        n, c = self.blocks.shape[0], self.blocks.shape[-1]
        return sums.view(n, c) if sums.shape[0] == 1 else sums.T

    def _diagonal(self) -> Tensor:
        return (self.blocks.diagonal(dim1=-2, dim2=-1) - self._column_sums()).reshape(-1)

    def point_blocks(self) -> Tensor:
        """Posterior ``C×C`` block of each point, ``(N, C, C)``."""
        n, c = self.blocks.shape[0], self.blocks.shape[-1]
        if self.low_rank_z.shape[0] == 1:  # one system: full coupling (or a single output)
            a = self.low_rank_z[0].reshape(-1, n, c)
            w = self.low_rank_s[0].reshape(-1, n, c)
            return self.blocks - torch.einsum("kni,knj->nij", a, a) + torch.einsum("kni,knj->nij", w, w)
        return self.blocks - torch.diag_embed(self._column_sums())

    def to_dense(self) -> Tensor:
        if self._dense is None:
            n, c = self.blocks.shape[0], self.blocks.shape[-1]
            a, w = self.low_rank_z, self.low_rank_s
            correction = a.mT @ a - w.mT @ w  # (nb, R, R)
            if correction.shape[0] == 1:
                correction = correction[0]
            else:  # independent outputs: block c at rows and columns n·C + c
                full = torch.zeros(n, c, n, c, dtype=correction.dtype, device=correction.device)
                idx = torch.arange(c, device=correction.device)
                full[:, idx, :, idx] = correction
                correction = full.view(n * c, n * c)
            self._dense = self.dense_prior() - correction
        return self._dense

    def _matmul(self, rhs: Tensor) -> Tensor:
        return self.to_dense() @ rhs

    def _get_indices(self, row_index, col_index, *batch_indices) -> Tensor:
        c = self.blocks.shape[-1]
        row_index, col_index = torch.broadcast_tensors(row_index, col_index)
        if bool((row_index // c == col_index // c).all()):
            return self.point_blocks()[row_index // c, row_index % c, col_index % c]
        return self.to_dense()[row_index, col_index]
