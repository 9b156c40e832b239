r"""The evidence of a weight-space Laplace posterior and the choice of its prior precisions :math:`\delta`.

The Laplace-GGN evidence (``docs/math.md``, "Laplace-GGN evidence") at the posterior's mode :math:`\theta^*`,

.. math::
    \log q(\mathcal D \mid \delta) = \sum_n \log p(y_n \mid f_n) - \tfrac12 \sum_g \delta_g \|\theta^*_g\|^2
    + \tfrac12 \sum_g P_g \log \delta_g - \tfrac12 \log|H(s) + P_0|,

is evaluated by each structure from the curvature it was built from (:meth:`PriorTuning.log_marginal_likelihood`),
exact for that structure and differentiable in :math:`\delta` and the likelihood's noise or temperature.
:meth:`PriorTuning.optimize_prior_precision` chooses :math:`\delta` by maximizing it (gradient steps on
:math:`\log\delta`, or a grid) or by the lowest validation loss of the GLM predictive over a grid, and sets it.
The loops are functions (:func:`maximize_evidence`, :func:`grid_maximum`) that :class:`~ntkgp.NTKGP` shares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ....likelihoods import is_gaussian, noise_variance
from ....metrics import brier_score, categorical_nlpd, expected_calibration_error, gaussian_nlpd
from ....ntk.prior_precision import prior_precision_vector
from ....validation import positive_float, positive_int
from .predictive_estimators import Prediction

__all__ = ["DEFAULT_GRID", "PriorTuning", "grid_maximum", "maximize_evidence", "optimize_parameter_precision",
           "validation_batches"]

#: The default grid of :math:`\delta` values, :math:`10^{-4} \dots 10^{4}` (41 points, 5 per decade).
DEFAULT_GRID = (-4.0, 4.0, 41)
#: The optimizers of ``method="evidence"``.
EVIDENCE_OPTIMIZERS = ("adam", "lbfgs", "grid")
#: The named validation metrics (lower is better): negative log predictive density, expected calibration error
#: and Brier score (classification only).
VALIDATION_METRICS = ("nll", "ece", "brier")


def check_grid(grid: object, num_groups: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``grid`` as a tensor: ``None`` → :data:`DEFAULT_GRID`; values ``(M,)`` or candidates ``(M, G)``, positive
    and finite (errors name ``grid``)."""
    if grid is None:
        low, high, count = DEFAULT_GRID
        return torch.logspace(low, high, count, dtype=dtype, device=device)
    if isinstance(grid, (bool, str)):
        raise TypeError(f"grid must be a tensor or a sequence of numbers, got {type(grid).__name__}")
    try:
        # a sequence of Python numbers straight to ``dtype``: through float32 (the default) 0.3 would move by 4e-8
        values = (grid.detach() if torch.is_tensor(grid) else torch.as_tensor(grid, dtype=dtype)).to(dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"grid must be a tensor or a sequence of numbers, got {type(grid).__name__}") from error
    if values.dim() not in (1, 2) or values.shape[0] == 0 or (values.dim() == 2 and values.shape[1] != num_groups):
        raise ValueError(f"grid must have shape (M,) or (M, {num_groups}) with M >= 1, got {tuple(values.shape)}")
    if not bool(torch.isfinite(values).all() & (values > 0).all()):
        raise ValueError("grid must hold positive finite prior precisions")
    return values


def maximize_evidence(
    evidence: Callable[[], Tensor], parameter: Tensor, optimizer: str = "adam", steps: int = 100, lr: float = 0.1,
    progress: bool = False,
) -> None:
    r"""Maximize ``evidence()`` over the leaf tensor ``parameter`` (e.g. :math:`\log\delta`) in place, by ``steps``
    Adam steps of size ``lr`` or one L-BFGS run of at most ``steps`` iterations (strong Wolfe line search).

    The gradients are taken w.r.t. ``parameter`` alone (``torch.autograd.grad``): nothing else the evidence
    depends on (a likelihood's noise, the network) receives a ``.grad``. Adam ends at the best iterate it saw.
    """
    if optimizer == "lbfgs":
        solver = torch.optim.LBFGS([parameter], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

        def closure() -> Tensor:
            loss = -evidence()
            (parameter.grad,) = torch.autograd.grad(loss, parameter)
            return loss.detach()

        solver.step(closure)
        parameter.grad = None
        return
    solver = torch.optim.Adam([parameter], lr=lr)
    best_value, best = -float("inf"), parameter.detach().clone()
    for _ in tqdm(range(steps), desc="prior precision (evidence)", disable=not progress, leave=False):
        value = evidence()
        if value.item() > best_value:
            best_value, best = value.item(), parameter.detach().clone()
        (parameter.grad,) = torch.autograd.grad(-value, parameter)
        solver.step()
    with torch.no_grad():
        if evidence().item() < best_value:
            parameter.copy_(best)
    parameter.grad = None


def grid_maximum(score: Callable[[Tensor], float], grid: Tensor, start: Tensor, sweeps: int = 2,
                 progress: bool = False) -> Tensor:
    r"""The candidate :math:`\delta` ``(G,)`` with the highest ``score(δ)``.

    ``grid`` ``(M, G)``: those candidates. ``grid`` ``(M,)``: every value shared by the ``G`` groups, then, with
    ``G > 1``, ``sweeps`` rounds of coordinate search from the best of them (each group in turn takes the best of
    the ``M`` values, the others fixed: :math:`M G` evaluations a sweep, not :math:`M^G`). The result is on the
    grid; ties go to the first candidate.
    """
    candidates = grid if grid.dim() == 2 else grid[:, None].expand(-1, start.numel())
    scores = [score(c) for c in tqdm(candidates, desc="prior precision (grid)", disable=not progress, leave=False)]
    first = max(range(len(scores)), key=lambda i: (scores[i], -i))
    best, best_score = candidates[first].clone(), scores[first]
    if grid.dim() == 2 or start.numel() == 1:
        return best
    for _ in range(sweeps):
        for g in tqdm(range(best.numel()), desc="prior precision (grid)", disable=not progress, leave=False):
            for value in grid:
                trial = best.clone()
                trial[g] = value
                trial_score = score(trial)
                if trial_score > best_score:
                    best, best_score = trial, trial_score
    return best


def check_evidence_search(optimizer: str, steps: object, sweeps: object, lr: object, progress: object) -> None:
    """The options of a search of the evidence over :math:`\\delta` (:func:`maximize_evidence`), checked before
    anything changes.

    Raises:
        ValueError: an unknown ``optimizer``, or ``steps``, ``sweeps``, ``lr`` not positive (naming it).
        TypeError: ``progress`` not a bool.
    """
    if optimizer not in EVIDENCE_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {EVIDENCE_OPTIMIZERS}, got {optimizer!r}")
    positive_int(steps, "steps")
    positive_int(sweeps, "sweeps")
    positive_float(lr, "lr")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {type(progress).__name__}")


def optimize_parameter_precision(
    evidence: Callable[[], Tensor], module, optimizer: str = "adam", steps: int = 100, lr: float = 0.1,
    grid: Tensor | None = None, sweeps: int = 2, progress: bool = False,
) -> Tensor:
    r"""Maximize ``evidence()`` over the prior precisions of a GPyTorch ``module`` that holds them as the
    hyperparameter ``raw_prior_precision`` with a ``prior_precision`` property and setter (the NTK kernel of
    :class:`~ntkgp.NTKGP`): gradient steps on the raw parameter (:func:`maximize_evidence`; its constraint's
    transform is the log parameterization) or :func:`grid_maximum`. Returns the new :math:`\delta`, detached.

    Raises:
        ValueError: for an invalid argument (naming it), before anything changes.
    """
    check_evidence_search(optimizer, steps, sweeps, lr, progress)
    before = module.prior_precision.detach().clone()
    values = check_grid(grid, before.numel(), before.dtype, before.device)
    try:
        if optimizer == "grid":
            def score(delta: Tensor) -> float:
                module.prior_precision = delta.reshape(before.shape)
                with torch.no_grad():
                    return evidence().item()

            module.prior_precision = grid_maximum(score, values, before.reshape(-1), sweeps, progress).reshape(
                before.shape)
        else:
            maximize_evidence(evidence, module.raw_prior_precision, optimizer, steps, lr, progress)
    except BaseException:
        module.prior_precision = before  # a failed search leaves δ as it was
        raise
    return module.prior_precision.detach().clone()


class PriorTuning:
    r"""The evidence and the choice of :math:`\delta` of a :class:`~ntkgp.laplace.weight_space.WeightPosterior`
    (module docstring); each structure implements :meth:`_log_marginal_likelihood`."""

    def log_marginal_likelihood(self, prior_precision: float | Tensor | None = None) -> Tensor:
        r"""The Laplace-GGN evidence :math:`\log q(\mathcal D \mid \delta)` (module docstring) at the posterior's
        mode, summed over the training data, shape ``()``.

        Args:
            prior_precision: :math:`\delta`, a positive number or ``(G,)`` tensor (its graph kept:
                differentiable); default the posterior's current :attr:`prior_precision`.

        Evaluated at the likelihood's current noise or temperature (differentiable in them too), from the
        curvature the posterior was built from: no pass over the data. laplace-torch's
        ``log_marginal_likelihood(prior_precision)``.

        Raises:
            ValueError: for a prior precision of the wrong shape or not positive.
            NotImplementedError: for a structure without an evidence route.
            RuntimeError: when the network's weights changed since the posterior was built.
        """
        self.check_network()
        if prior_precision is None:
            delta = self.prior_precision
        else:
            delta = prior_precision_vector(prior_precision, self.groups, self.function.dtype, self.function.device,
                                           keep_graph=True)
        return self._log_marginal_likelihood(delta)

    def _log_marginal_likelihood(self, prior_precision: Tensor) -> Tensor:
        """The evidence for :math:`\\delta` ``(G,)`` (each structure's own route)."""
        raise NotImplementedError(f"{type(self).__name__} has no evidence route")

    def optimize_prior_precision(
        self,
        method: str = "evidence",
        optimizer: str = "adam",
        steps: int = 100,
        lr: float = 0.1,
        grid: Tensor | None = None,
        sweeps: int = 2,
        x_val: Tensor | Iterable | None = None,
        y_val: Tensor | None = None,
        metric: str | Callable[[Prediction, Tensor], float] = "nll",
        link: str | None = None,
        predictive: str = "glm",
        num_samples: int = 100,
        generator: torch.Generator | None = None,
        progress: bool = False,
    ) -> Tensor:
        r"""Choose the prior precisions :math:`\delta` (one per group of :attr:`groups`: the posterior's
        ``prior_structure``), set them and return them, ``(G,)``.

        ``method="evidence"`` maximizes :meth:`log_marginal_likelihood` by ``optimizer``: ``"adam"`` (``steps``
        steps of size ``lr`` on :math:`\log\delta` from the current :math:`\delta`; the best iterate is kept),
        ``"lbfgs"`` (at most ``steps`` iterations, strong Wolfe line search) or ``"grid"`` (:func:`grid_maximum`).
        ``method="validation"`` takes the grid point with the lowest ``metric`` of the predictive
        :meth:`predict` on ``(x_val, y_val)`` (laplace-torch's ``method="gridsearch"``).

        Args:
            method: ``"evidence"`` (default; laplace-torch's ``"marglik"``) or ``"validation"``.
            optimizer: ``"adam"`` (default), ``"lbfgs"`` or ``"grid"`` (``method="evidence"``).
            steps, lr: gradient steps (``"adam"``, ``"lbfgs"``).
            grid: candidate values ``(M,)`` (default :data:`DEFAULT_GRID`) or candidates ``(M, G)``. With
                ``(M,)``, ``"validation"`` tries one shared :math:`\delta` per value (``M`` predictive passes);
                the evidence grid searches every group (coordinate-wise for ``G > 1``, ``sweeps`` rounds).
            sweeps: rounds of the coordinate search of an evidence grid.
            x_val, y_val: validation inputs and targets, or an iterable of ``(x, y)`` batches with ``y_val=None``.
            metric: ``"nll"`` (default: mean negative log predictive density; for regression of
                :math:`N(\mu, \sigma^2_f + \sigma^2)`), ``"ece"``, ``"brier"`` (classification) or a callable
                ``metric(prediction, y) -> float`` averaged over the batches by their size; lower is better.
            link, predictive, num_samples, generator: passed to :meth:`predict` (``predictive`` is its
                ``method``).
            progress: show a tqdm bar.

        Returns:
            The chosen :math:`\delta`, ``(G,)`` (also :attr:`prior_precision` from now on).

        Raises:
            ValueError or TypeError: for an invalid argument (naming it), before anything is computed.
        """
        methods = ("evidence", "validation")
        if method not in methods:
            raise ValueError(f"method must be one of {methods}, got {method!r}")
        check_evidence_search(optimizer, steps, sweeps, lr, progress)
        values = check_grid(grid, self.groups.num_groups, self.function.dtype, self.function.device)
        self.check_network()
        if method == "evidence":
            if x_val is not None or y_val is not None:
                raise ValueError("x_val and y_val are for method='validation'")
            delta = self._evidence_maximum(optimizer, steps, lr, values, sweeps, progress)
        else:
            if optimizer != "adam":
                raise ValueError("optimizer is for method='evidence'; method='validation' searches the grid")
            batches = validation_batches(x_val, y_val)
            if not (callable(metric) or metric in VALIDATION_METRICS):
                raise ValueError(f"metric must be one of {VALIDATION_METRICS} or a callable, got {metric!r}")
            if metric in ("ece", "brier") and is_gaussian(self.likelihood):
                raise ValueError(f"metric={metric!r} is for classification; use 'nll' for regression")
            options = {"link": link, "method": predictive, "num_samples": num_samples, "generator": generator,
                       "progress": False}  # each candidate's predictions: silent within the search's own bar
            candidates = values if values.dim() == 2 else values[:, None].expand(-1, self.groups.num_groups)
            before = self.prior_precision
            try:  # (M, G) candidates: the values shared by every group, or those given
                delta = grid_maximum(lambda d: -self._validation_loss(d, batches, metric, options), candidates,
                                     before, progress=progress)
            except BaseException:
                self.prior_precision = before  # a failed search leaves δ as it was
                raise
        self.prior_precision = delta
        return self.prior_precision.clone()

    def _evidence_maximum(self, optimizer: str, steps: int, lr: float, grid: Tensor, sweeps: int,
                          progress: bool) -> Tensor:
        if optimizer == "grid":
            def score(delta: Tensor) -> float:
                with torch.no_grad():
                    return self._log_marginal_likelihood(delta).item()

            return grid_maximum(score, grid, self.prior_precision, sweeps, progress)
        log_delta = self.prior_precision.log().clone().requires_grad_(True)
        maximize_evidence(lambda: self._log_marginal_likelihood(log_delta.exp()), log_delta, optimizer, steps, lr,
                          progress)
        return log_delta.detach().exp()

    def _validation_loss(self, delta: Tensor, batches: list[tuple[Tensor, Tensor]], metric, options: dict) -> float:
        """``metric`` of the predictive with :math:`\\delta` on the validation batches."""
        self.prior_precision = delta
        if callable(metric):
            total = sum(float(metric(self.predict(x, **options), y)) * x.shape[0] for x, y in batches)
            return total / sum(x.shape[0] for x, _ in batches)
        predictions = [self.predict(x, **options) for x, _ in batches]
        y = torch.cat([torch.as_tensor(y) for _, y in batches])
        if is_gaussian(self.likelihood):
            mean = torch.cat([p.f.mean for p in predictions])
            noise = noise_variance(self.likelihood).detach().to(mean)
            variance = torch.cat([p.f.variance for p in predictions]) + noise
            return gaussian_nlpd(mean, variance, y.to(mean).reshape(mean.shape))
        probs = torch.cat([p.probs for p in predictions])
        loss = {"nll": categorical_nlpd, "ece": expected_calibration_error, "brier": brier_score}[metric]
        return loss(probs, y)


def validation_batches(x_val, y_val) -> list[tuple[Tensor, Tensor]]:
    """The validation data as ``(x, y)`` batches (errors name ``x_val`` and ``y_val``): ``x_val`` a tensor (or a dict
    of tensors, as a network's structured inputs) with the targets ``y_val``, or an iterable of ``(x, y)``."""
    if x_val is None:
        raise ValueError("method='validation' needs x_val (and y_val, or x_val an iterable of (x, y) batches)")
    if torch.is_tensor(x_val) or isinstance(x_val, dict):
        rows = x_val.shape[0] if torch.is_tensor(x_val) else next(iter(x_val.values())).shape[0]
        if not torch.is_tensor(y_val) or y_val.shape[0] != rows:
            raise ValueError("y_val must be a tensor of targets with one row per row of x_val")
        return [(x_val, y_val)]
    if y_val is not None:
        raise ValueError("pass y_val=None when x_val is an iterable of (x, y) batches")
    batches = [(xb, yb) for xb, yb in x_val]
    if not batches:
        raise ValueError("x_val is empty: no batch was seen")
    return batches
