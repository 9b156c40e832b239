r"""Several SFRs whose inducing inputs are nested (each the leading ``m`` of the largest's, as
:meth:`SFR.select_inducing(m) <ntkgp.models.SFR.select_inducing>` gives them), predicted from one pass over the test
points: the per-point marginals of each model at each of its prior precisions.

The cross-Grams of a chunk of test points against the largest model's inducing inputs, :math:`K^{(g)}_{Zx}`, hold
those of every nested model: the leading ``m`` rows (``m·C`` with joint coupling, whose rows are ``m·C + c``).
So the costly part of a prediction (the chunk's pass through the network and its products with the inducing inputs'
features, ``O(M)`` per point) is done once, for the largest ``M``, and every model reads its rows; each model and
prior precision adds its factorization and ``O(m²)`` products per point (:func:`~ntkgp.models.sfr.prediction.
marginal_distributions`). Comparing ``M = 512 … 3,200`` on the same test images thus costs one prediction pass at
``M = 3,200`` instead of four. Only the largest model's inducing features are used (a nested model's are never
computed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gpytorch.distributions import MultivariateNormal
from torch import Tensor

from ... import memory
from ...ntk.private_copy import model_lock
from ...progress import Progress
from ...validation import positive_int
from .factorization import inducing_feature_set
from .inducing_points import model_dtype
from .model import SFR
from .prediction import marginal_distributions
from .prediction_terms import PredictiveTerms, SharedPieces
from .prior_grid import _candidates, posterior_state_at
from .validation import pack_inputs

__all__ = ["nested_marginals"]


def nested_marginals(models: Sequence[SFR], x: Tensor, prior_precisions: Sequence[object] | None = None,
                     chunk_size: int | None = None) -> list[list[MultivariateNormal]]:
    r"""The per-point marginals of SFRs on nested inducing inputs at their prior precisions, from one pass over ``x``.

    Equal, model by model, to ``model.predictive_grid(x, values, marginal=True)`` (each point's mean and ``C×C``
    block; a block-diagonal covariance), at the cost of one prediction pass of the largest model plus a
    factorization per model and value. No model is changed.

    Args:
        models: SFRs on the same network (the same module), with the same output coupling, prior mean, predictive
            mean and dtype, whose inducing inputs are each the leading rows of the largest's
            (:meth:`~ntkgp.models.SFR.select_inducing` with an int).
        x: test inputs, as for :meth:`~ntkgp.models.SFR.forward`; no graph is kept.
        prior_precisions: per model, values ``(K,)`` or candidates ``(K, G)`` as for
            :meth:`~ntkgp.models.SFR.predictive_grid`, or ``None`` for its current :math:`\delta`; default
            ``None`` for every model.
        chunk_size: test points per chunk (default: the largest model's prediction chunk).

    Returns:
        Per model, in the order of ``models``, one distribution per value, in the order of its values.

    Raises:
        TypeError or ValueError: for invalid arguments (naming them), before anything is computed.
    """
    if isinstance(models, SFR) or not isinstance(models, Sequence) or not models:
        raise TypeError(f"models must be a non-empty sequence of SFR models, got {type(models).__name__}")
    for i, model in enumerate(models):
        if not isinstance(model, SFR):
            raise TypeError(f"models[{i}] must be an SFR, got {type(model).__name__}")
    if prior_precisions is None:
        prior_precisions = [None] * len(models)
    if isinstance(prior_precisions, (str, bytes, Tensor)) or not isinstance(prior_precisions, Sequence) \
            or len(prior_precisions) != len(models):
        raise ValueError(f"prior_precisions must hold one entry per model ({len(models)}), got {prior_precisions!r}")
    chunk = None if chunk_size is None else positive_int(chunk_size, "chunk_size")
    largest = max(models, key=lambda model: model.num_inducing)
    _check_nested(models, largest)
    candidates = [_candidates(model, model.covar_module.prior_precision.detach()[None] if values is None else values,
                              f"prior_precisions[{i}]") for i, (model, values) in enumerate(zip(models, prior_precisions))]
    for model, values in zip(models, candidates):
        for value in values:
            model.dual_statistics.check_prior_precision(value)
    flat, batch = largest._layout.check(pack_inputs(largest.engine.net, x, "x"), "x", batched=True)
    if flat.requires_grad:
        raise ValueError("x: nested_marginals keeps no graph; detach x (SFR.forward differentiates in x)")
    chunk = largest._rows_per_step() if chunk is None else chunk
    with model_lock(largest), torch.no_grad():
        x = largest.engine.prepare(flat, "x")
        features = inducing_feature_set(largest)
        # the largest model's values first: the first entry forms each chunk's pieces from its features, and every
        # entry reads its rows of them
        order = sorted(range(len(models)), key=lambda i: models[i] is not largest)
        entries = [(models[i], value) for i in order for value in candidates[i]]

        def maker(model: SFR, value: Tensor):
            return lambda: PredictiveTerms(model.engine, model.inducing_points, model.output_coupling,
                                           model.num_outputs, posterior_state_at(model, value), model.prior_mean,
                                           model.predictive_mean, lambda: None,
                                           features if model is largest else None)

        sizes = sum(2 * model._zz_grams.shape[-3] * model._zz_grams.shape[-2] ** 2 * 8 for model, _ in entries)
        dtype = model_dtype(largest.inducing_points, largest.covar_module.raw_prior_precision)
        with Progress(x.shape[0], "SFR nested predictions", largest.progress, unit="point") as bar:
            dists = marginal_distributions([maker(*entry) for entry in entries], x, batch, chunk, dtype,
                                           sizes <= memory.SFR_GRID_BYTES, bar.update,
                                           [_rows_of(model) for model, _ in entries])
    out, start = [None] * len(models), 0
    for i in order:
        out[i] = dists[start : start + candidates[i].shape[0]]
        start += candidates[i].shape[0]
    return out


def _check_nested(models: Sequence[SFR], largest: SFR) -> None:
    """Raise unless every model shares the largest's network and options and its ``Z`` is the largest's leading rows."""
    for i, model in enumerate(models):
        for name in ("output_coupling", "prior_mean", "predictive_mean", "num_outputs"):
            if getattr(model, name) != getattr(largest, name):
                raise ValueError(f"models[{i}]: {name} is {getattr(model, name)!r}, the largest model's is "
                                 f"{getattr(largest, name)!r}; nested models share it")
        if model.engine.net is not largest.engine.net:
            raise ValueError(f"models[{i}] is on another network than the largest model (nested models share it)")
        z, m = largest.inducing_points, model.num_inducing
        if model.inducing_points.dtype != z.dtype or not torch.equal(model.inducing_points, z[:m]):
            raise ValueError(f"models[{i}]: its inducing points are not the first {m} of the largest model's "
                             "(SFR.select_inducing(m) gives such a model)")


def _rows_of(model: SFR):
    """The pieces' rows of ``model``'s inducing inputs: the leading ``m`` (``m·C`` with joint coupling)."""
    rows = model._zz_grams.shape[-1]

    def view(pieces: SharedPieces) -> SharedPieces:
        return SharedPieces(pieces.grams[..., :rows, :], pieces.diagonal, pieces.outputs, pieces.offset)
    return view
