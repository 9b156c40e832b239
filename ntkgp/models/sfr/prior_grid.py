r"""SFR's predictive at several prior precisions from one pass over the test points, and the choice of
:math:`\delta` by the evidence or on validation data (laplace-torch's ``optimize_prior_precision``).

The cross-covariances :math:`K_{xZ} = \sum_g \delta_g^{-1} K^{(g)}_{xZ}` and the prior blocks are linear in the group
weights :math:`1/\delta_g`: the per-group Grams of a chunk of test points (the costly part of a prediction: one pass
of the chunk through the network and its products with the inducing inputs' features) are computed once and
weighted by every candidate :math:`\delta`, each with its own factorization of :math:`K_{ZZ}(\delta)` and the
statistics (``O((MC)^3)`` for joint outputs, ``C·O(M^3)`` independent; docs/sfr.md, "Prior precision"). A grid of
``K`` values on ``n`` validation points thus costs one prediction pass plus ``K`` factorizations and ``K·n``
small products, not ``K`` passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from gpytorch.distributions import MultivariateNormal
from torch import Tensor

from ...laplace.weight_space.posterior.prior_tuning import check_grid, optimize_parameter_precision, validation_batches
from ...likelihoods import is_gaussian, noise_variance
from ...metrics import brier_score, categorical_nlpd, expected_calibration_error, gaussian_nlpd
from ...ntk.private_copy import model_lock
from ...progress import Progress
from ... import memory
from ...validation import flag, positive_int
from .evidence_scale import evidence_of_delta
from .factorization import inducing_feature_set, kzz_factors, solve, z_jacobian
from .inducing_points import model_dtype
from .prediction import marginal_distributions, predictive_distributions
from .prediction_terms import PosteriorState, PredictiveTerms
from .validation import pack_inputs

__all__ = ["PriorPrecisionTuning", "posterior_state_at"]

#: The named validation metrics (lower is better).
VALIDATION_METRICS = ("nll", "ece", "brier")


def posterior_state_at(sfr, prior_precision: Tensor) -> PosteriorState:
    r"""The whitened factorization of ``sfr``'s posterior at group precisions ``prior_precision`` ``(G,)`` (its
    noise or temperature as they are), without changing the model; no graph."""
    sfr._guard.check(sfr.engine, sfr.inducing_points)
    stats = sfr.dual_statistics
    stats.check_prior_precision(prior_precision)
    with torch.no_grad():
        weights = prior_precision.reciprocal().to(stats.precision.dtype)
        slots = stats.slot_weights(sfr.likelihood)
        return solve(stats, weights, slots, kzz_factors(sfr, weights), sfr.engine.dtype)


def _candidates(sfr, prior_precisions: object, name: str) -> Tensor:
    """``prior_precisions`` as ``(K, G)`` candidates: values ``(K,)`` shared by the groups, or ``(K, G)``."""
    current = sfr.covar_module.prior_precision.detach()
    if current.dim() > 1:
        raise NotImplementedError(f"{name}: one set of prior precisions per model (this kernel has batch shape "
                                  f"{tuple(current.shape[:-1])})")
    if prior_precisions is None:
        raise ValueError(f"{name} must be a sequence of positive prior precisions, got None")
    try:
        values = check_grid(prior_precisions, current.numel(), current.dtype, current.device)
    except (TypeError, ValueError) as error:
        raise type(error)(str(error).replace("grid", name)) from None
    return values if values.dim() == 2 else values[:, None].expand(-1, current.numel())


class PriorPrecisionTuning:
    r"""The :math:`\delta` methods of :class:`~ntkgp.models.SFR`: :meth:`predictive_grid` and
    :meth:`optimize_prior_precision`."""

    def predictive_grid(self, x: Tensor, prior_precisions: Sequence[float] | Tensor,
                        chunk_size: int | None = None, marginal: bool = False) -> list[MultivariateNormal]:
        r"""The posterior over :math:`f(x)` at each of several prior precisions, from one pass over ``x``.

        Equal to setting ``covar_module.prior_precision`` to each value and calling the model, at the cost of one
        call plus a factorization per value (module docstring). The model is not changed.

        Args:
            x: test inputs, as for :meth:`forward`.
            prior_precisions: values ``(K,)`` (each shared by the kernel's groups) or candidates ``(K, G)``.
            chunk_size: test points per chunk, as for :meth:`forward`.
            marginal: ``True``: only each point's marginal (its mean and ``C×C`` block; a block-diagonal
                covariance, no covariance between points), which is all a per-point metric needs: the
                distributions then hold no factorization (a joint one holds its value's, ``2·nb·K²`` numbers,
                for the covariances between points), and during the pass the factorizations are kept from chunk
                to chunk only within :data:`~ntkgp.memory.SFR_GRID_BYTES` (else formed once per chunk, one at a
                time).

        Returns:
            ``K`` distributions, in the order of ``prior_precisions`` (each as :meth:`forward` returns, or its
            per-point marginals).

        Raises:
            ValueError or TypeError: for invalid arguments (naming them), before anything is computed;
            RuntimeError: with ``statistics="combined"``, for a :math:`\delta` other than the pass's.
        """
        candidates = _candidates(self, prior_precisions, "prior_precisions")
        chunk = None if chunk_size is None else positive_int(chunk_size, "chunk_size")
        marginal = flag(marginal, "marginal")
        flat, batch = self._layout.check(pack_inputs(self.engine.net, x, "x"), "x", batched=True)
        for value in candidates:
            self.dual_statistics.check_prior_precision(value)
        chunk = self._rows_per_step() if chunk is None else chunk
        with model_lock(self):
            x = self.engine.prepare(flat, "x")
            features = inducing_feature_set(self)

            def terms(k: int) -> PredictiveTerms:
                return PredictiveTerms(self.engine, self.inducing_points, self.output_coupling, self.num_outputs,
                                       posterior_state_at(self, candidates[k]), self.prior_mean,
                                       self.predictive_mean, lambda: z_jacobian(self), features)

            dtype = model_dtype(self.inducing_points, self.covar_module.raw_prior_precision)
            count = candidates.shape[0]
            with Progress(x.shape[0], "SFR prediction grid", self.progress, unit="point") as bar:
                if marginal:
                    systems, size = self._zz_grams.shape[-3:-1]
                    keep = count * 2 * systems * size**2 * 8 <= memory.SFR_GRID_BYTES
                    makers = [lambda k=k: terms(k) for k in range(count)]
                    return marginal_distributions(makers, x, batch, chunk, dtype, keep, bar.update)
                return predictive_distributions([terms(k) for k in range(count)], x, batch, chunk, dtype,
                                                bar.update)

    def optimize_prior_precision(
        self,
        method: str = "evidence",
        optimizer: str = "adam",
        steps: int = 100,
        lr: float = 0.1,
        grid: Sequence[float] | Tensor | None = None,
        sweeps: int = 2,
        x_val: Tensor | Iterable | None = None,
        y_val: Tensor | None = None,
        metric: str | Callable = "nll",
        chunk_size: int | None = None,
        progress: bool = False,
    ) -> Tensor:
        r"""Choose :math:`\delta` (the noise or temperature and the statistics fixed), set it and return it.

        ``method="evidence"`` maximizes :meth:`log_marginal_likelihood` (the collapsed bound) by ``optimizer``:
        ``"adam"`` (``steps`` steps of size ``lr`` on :math:`\log\delta`, the best iterate kept), ``"lbfgs"`` or
        ``"grid"``, as :meth:`ntkgp.NTKGP.optimize_prior_precision`. ``method="validation"`` takes the value of
        ``grid`` with the lowest ``metric`` of the predictive on ``(x_val, y_val)`` (laplace-torch's
        ``"gridsearch"``; the SFR paper's "δ tuned"), all values from one prediction pass
        (:meth:`predictive_grid`); the predictive's mean is the model's ``predictive_mean`` (``"nn"``: SFR-NN).

        Args:
            method: ``"evidence"`` (default) or ``"validation"``.
            optimizer: ``"adam"`` (default), ``"lbfgs"`` or ``"grid"`` (``method="evidence"``).
            steps, lr, sweeps: as :meth:`ntkgp.NTKGP.optimize_prior_precision`.
            grid: values ``(K,)`` or candidates ``(K, G)``; default :math:`10^{-4} \dots 10^4`, 41 values.
            x_val, y_val: validation inputs and targets, or an iterable of ``(x, y)`` batches with ``y_val=None``.
            metric: ``"nll"`` (mean negative log predictive density; regression: of
                :math:`N(\mu, \sigma^2_f + \sigma^2)`), ``"ece"``, ``"brier"`` (classification), or a callable
                ``metric(predictive, y) -> float`` of the likelihood's predictive (``model.likelihood(f_dist)``,
                ``f_dist`` the per-point marginals: :meth:`predictive_grid` with ``marginal=True``), averaged over
                the batches by their size; lower is better.
            chunk_size: test points per chunk (``method="validation"``).
            progress: show a tqdm bar (``method="evidence"``).

        Returns:
            The chosen :math:`\delta`, ``(G,)`` (also ``covar_module.prior_precision`` from now on).

        Raises:
            ValueError or TypeError: for an invalid argument (naming it), before anything changes;
            RuntimeError: with ``statistics="combined"`` (:math:`\delta` is fixed by the pass over the data).
        """
        if method not in ("evidence", "validation"):
            raise ValueError(f"method must be one of ('evidence', 'validation'), got {method!r}")
        if self.dual_statistics.combined:
            raise RuntimeError("statistics='combined' fixes δ at the pass over the data: build SFR with "
                               "statistics='per_group' to choose δ")
        if method == "evidence":
            if x_val is not None or y_val is not None:
                raise ValueError("x_val and y_val are for method='validation'")
            was_training = self.training
            self.train()  # the evidence carries its graph to δ in train mode
            try:  # one δ: the bound along δ from one eigendecomposition, where it is the model's (evidence_scale)
                return optimize_parameter_precision(evidence_of_delta(self), self.covar_module, optimizer, steps, lr,
                                                    grid, sweeps, progress)
            finally:
                self.train(was_training)
        if optimizer != "adam":
            raise ValueError("optimizer is for method='evidence'; method='validation' searches the grid")
        if not (callable(metric) or metric in VALIDATION_METRICS):
            raise ValueError(f"metric must be one of {VALIDATION_METRICS} or a callable, got {metric!r}")
        if metric in ("ece", "brier") and is_gaussian(self.likelihood):
            raise ValueError(f"metric={metric!r} is for classification; use 'nll' for regression")
        candidates = _candidates(self, grid, "grid")
        batches = validation_batches(x_val, y_val)
        losses = self._validation_losses(candidates, batches, metric, chunk_size)
        best = min(range(len(losses)), key=lambda i: (losses[i], i))
        self.covar_module.prior_precision = candidates[best]
        return self.covar_module.prior_precision.detach().clone()

    def _validation_losses(self, candidates: Tensor, batches, metric, chunk_size: int | None) -> list[float]:
        """``metric`` of each candidate's predictive on the validation batches (one pass over them)."""
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                per_batch = [(self.predictive_grid(x, candidates, chunk_size, marginal=True), y) for x, y in batches]
        finally:
            self.train(was_training)
        total = sum(y.shape[0] for _, y in per_batch)
        losses = []
        for k in range(candidates.shape[0]):
            if callable(metric):
                losses.append(sum(float(metric(self.likelihood(d[k]), y)) * y.shape[0] for d, y in per_batch) / total)
                continue
            y = torch.cat([y for _, y in per_batch])
            if is_gaussian(self.likelihood):
                mean = torch.cat([d[k].mean for d, _ in per_batch])
                noise = noise_variance(self.likelihood).detach().to(mean)
                variance = torch.cat([d[k].variance for d, _ in per_batch]) + noise
                losses.append(gaussian_nlpd(mean, variance, y.to(mean).reshape(mean.shape)))
                continue
            with torch.no_grad():
                probs = torch.cat([self.likelihood(d[k]).probs for d, _ in per_batch])
            loss = {"nll": categorical_nlpd, "ece": expected_calibration_error, "brier": brier_score}[metric]
            losses.append(float(loss(probs, y)))
        return losses
