r"""SFR's posterior factorization at the current hyperparameters, and its value-keyed cache.

The factors (:func:`~ntkgp.models.sfr.whitening.whitened_factors`) depend on the prior precisions :math:`\delta`
(through :math:`K_{ZZ}(\delta) = \sum_g K_{g,ZZ}/\delta_g` and :math:`B_u(\delta)`), on the slot weights (the
Gaussian noise or the temperature) and on the statistics. In ``eval()`` mode they are cached, detached, by
:class:`PosteriorCache`, keyed by the *values* of :math:`1/\delta`, the slot weights and the statistics'
generation (bumped by ``update`` and ``load_state_dict``); the factors of :math:`K_{ZZ}` alone are cached
apart, keyed by :math:`1/\delta` and the generation, so that an update and a change of the noise or temperature
reuse them. The cache is not part of a pickled or copied model (a copy recomputes it).

Everything here is in the statistics' dtype (float64, also for a float32 network); the thresholds use the unit
roundoffs of :math:`K_{ZZ}` (float64) and of the sums in :math:`B_u` (the statistics') apart (:func:`rounding`,
:func:`~ntkgp.models.sfr.whitening.whitened_factors`). The cross-covariances of a float32 network are float64
products of its float32 features with float64 features of ``Z`` (:mod:`~ntkgp.models.sfr.system_grams`): their
rounding moves :math:`V = WK_{Zx}` by no more than the features' own, in every direction :math:`K_{ZZ}` resolves, so
it drops none; its unit roundoff (``cross_eps``) only scales the precision warnings of the predictive.
"""

from __future__ import annotations

from collections.abc import Callable

import gpytorch
import torch
from torch import Tensor

from ...caching import ValueCache
from ...ntk.inputs import to as to_network
from ...progress import reporting
from .prediction_terms import PosteriorState
from .statistics import DualStatistics
from .system_grams import inducing_features, network_features, precise_engine
from .whitening import InducingFactors, inducing_factors, roundoff, whitened_factors

__all__ = [
    "InducingGram",
    "PosteriorCache",
    "factors_of_kzz",
    "group_weights",
    "inducing_feature_set",
    "kzz_factors",
    "posterior_state",
    "reset_after_load",
    "rounding",
    "solve",
    "z_jacobian",
]


class InducingGram:
    r""":math:`K_{ZZ} = \sum_g w_g K_{g,ZZ}` from the per-group Grams ``(G, nb, K, K)`` at weights ``(G,)`` (or,
    ``combined``, the one Gram kept at the statistics' :math:`\delta`), as a picklable callable: the factors keep
    it to recompute :math:`K_{ZZ}` on the rare occasions it is needed again."""

    def __init__(self, grams: Tensor, weights: Tensor, combined: bool) -> None:
        self.grams, self.weights, self.combined = grams, weights, combined

    def __call__(self) -> Tensor:
        if self.combined:
            return self.grams[0]
        return torch.einsum("g,gbij->bij", self.weights, self.grams)


def solve(
    statistics: DualStatistics, weights: Tensor, slots: Tensor, inducing: InducingFactors, network_dtype: torch.dtype
) -> PosteriorState:
    r"""The whitened factors of the posterior at group weights ``weights`` (:math:`1/\delta`) and slot weights."""
    b_u, y_u = statistics.projected(weights, slots)  # a fresh B_u, overwritten by the factorization
    eps = rounding(network_dtype, b_u, inducing)
    factors = whitened_factors(None, b_u, y_u, inducing=inducing, overwrite_b_u=True, eps=eps["eps"],
                               site_eps=eps["site_eps"])  # no threshold from the features' rounding (module doc)
    mean_error = cross_rounding = None
    if eps["cross_eps"] > 0:  # the rounding of float32 cross-covariances in the mean (PosteriorState.mean_error)
        alpha = factors.alpha.detach().unsqueeze(-1)  # ε √(αᵀ K_ZZ α) (PosteriorState.mean_error)
        if inducing.chol is not None:
            quadratic = (inducing.chol.detach().mT @ alpha).square().sum((-2, -1))
        else:
            quadratic = (alpha.mT @ inducing.gram().detach() @ alpha).reshape(alpha.shape[:-2])
        mean_error = eps["cross_eps"] * quadratic.clamp_min(0).sqrt()
        cross_rounding = (eps["cross_eps"], inducing.k_diagonal.sqrt())  # and in the variances
    return PosteriorState(weights=weights, slots=slots, factors=factors, mean_error=mean_error,
                          cross_rounding=cross_rounding)


def rounding(network_dtype: torch.dtype, b_u: Tensor, inducing: InducingFactors) -> dict[str, float]:
    r"""The unit roundoffs of SFR: :math:`K_{ZZ}`'s (computed in float64,
    :func:`~ntkgp.models.sfr.system_grams.inducing_grams`, unless stored lower: ``inducing.gram_eps``) and the sums
    in :math:`B_u`'s (the statistics' dtype), the thresholds of
    :func:`~ntkgp.models.sfr.whitening.whitened_factors`; and the network's features' (``cross_eps``, where it is
    coarser than :math:`K_{ZZ}`'s), which scales the precision warnings of the predictive only."""
    eps = inducing.gram_eps if inducing.gram_eps is not None else roundoff(torch.float64, inducing.k_trace.dtype)
    cross = roundoff(network_dtype)
    return {"eps": eps, "site_eps": roundoff(b_u.dtype), "cross_eps": cross if cross > eps else 0.0}


class PosteriorCache:
    """The cached factors of one model (eval mode): :math:`K_{ZZ}`'s, the posterior's, :math:`J(Z)` and the inducing
    inputs' layer features (``z_features``, given at construction with their ``generation``: computed once per model,
    for its statistics and every prediction chunk)."""

    def __init__(self, z_features=None, generation: Tensor | None = None) -> None:
        self._caches = {name: ValueCache(size=1) for name in ("inducing", "posterior", "z_jacobian", "z_features")}
        if z_features is not None:
            self.z_features(lambda: z_features, generation)

    def __getstate__(self) -> dict:  # a pickled or copied model recomputes its factors
        return {"empty": True}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def clear(self) -> None:
        for cache in self._caches.values():
            cache.clear()

    def entries(self) -> list[object]:
        """The cached values (for inspection)."""
        return [value for cache in self._caches.values() for _, _, value in cache._entries.values()]

    def __len__(self) -> int:
        return sum(len(cache) for cache in self._caches.values())

    def factors(
        self,
        inducing: Callable[[Tensor], InducingFactors],
        posterior: Callable[[Tensor, Tensor, InducingFactors], PosteriorState],
        weights: Tensor,
        slots: Tensor,
        generation: Tensor,
    ) -> PosteriorState:
        """The posterior at ``weights`` and ``slots`` (detached), from the cache or computed by ``inducing(weights)``
        and ``posterior(weights, slots, inducing)``; a miss drops the stale factors first, so that old and new never
        coexist in memory."""
        weights, slots = weights.detach(), slots.detach()
        cached = self._caches["posterior"]

        def new_inducing():
            cached.clear()
            self._caches["inducing"].clear()
            return inducing(weights)

        def new_posterior(factors):
            cached.clear()
            return posterior(weights, slots, factors)

        zz = self._caches["inducing"].get_or_compute("K_ZZ", [], new_inducing, state=[weights, generation[:1]])
        return cached.get_or_compute("posterior", [], lambda: new_posterior(zz), state=[weights, slots, generation])

    def z_features(self, compute: Callable[[], object], generation: Tensor):
        """The inducing inputs' features, from the cache or ``compute()`` (keyed by the ``load_state_dict`` count only:
        an update changes the statistics, not ``Z``)."""
        return self._caches["z_features"].get_or_compute("Z features", [], compute, state=[generation[:1]])

    def z_jacobian(self, compute: Callable[[], Tensor], generation: Tensor) -> Tensor:
        """:math:`J(Z)` (detached), from the cache or ``compute()``."""
        return self._caches["z_jacobian"].get_or_compute("J(Z)", [], compute, state=[generation])


def factors_of_kzz(
    grams: Tensor, weights: Tensor, combined: bool, precision: torch.dtype = torch.float64
) -> InducingFactors:
    r"""The factors of :math:`K_{ZZ}(\delta)` (:func:`~ntkgp.models.sfr.whitening.inducing_factors`): formed from the
    per-group Grams, factorized and released; combined statistics keep :math:`K_{ZZ}` at their :math:`\delta`.
    ``precision``: the dtype the Grams' features were computed in."""
    factors = inducing_factors(InducingGram(grams, weights.to(grams), combined))
    factors.gram_eps = roundoff(precision, grams.dtype)
    return factors


# ---------------------------------------------------------------------- of a model
def generation_key(sfr) -> Tensor:
    """The statistics' generation: ``load_state_dict`` count and ``update`` count."""
    return torch.tensor([sfr._generation, sfr._updates])


def group_weights(sfr) -> Tensor:
    r"""The group weights :math:`1/\delta` of ``sfr`` in its statistics' dtype (differentiable)."""
    return sfr.covar_module.prior_precision.reciprocal().to(sfr.dual_statistics.precision.dtype)


def kzz_factors(sfr, weights: Tensor) -> InducingFactors:
    r"""The factors of ``sfr``'s :math:`K_{ZZ}` at group weights ``weights``."""
    return factors_of_kzz(sfr._zz_grams, weights, sfr.dual_statistics.combined, sfr._zz_precision)


def posterior_state(sfr) -> PosteriorState:
    r"""The whitened factorization of ``sfr``'s posterior at its current hyperparameters, after checking that its
    statistics still describe the network. In eval mode (with GPyTorch's ``detach_test_caches``) from its
    :class:`PosteriorCache`; in train mode recomputed with gradients."""
    sfr._check_state()
    stats = sfr.dual_statistics
    weights, slots = group_weights(sfr), stats.slot_weights(sfr.likelihood)
    network_dtype = sfr.engine.dtype

    def posterior(w: Tensor, s: Tensor, inducing: InducingFactors) -> PosteriorState:
        return solve(stats, w, s, inducing, network_dtype)

    if sfr.training or not gpytorch.settings.detach_test_caches.on():
        return posterior(weights, slots, kzz_factors(sfr, weights))
    return sfr._cache.factors(lambda w: kzz_factors(sfr, w), posterior, weights, slots, generation_key(sfr))


def reset_after_load(module, incompatible_keys) -> None:
    """``load_state_dict`` post hook: the loaded statistics' key re-arms the guard (or disarms it, if they belong to
    other weights), and every cached factor is dropped (the inducing inputs' features too)."""
    module._generation += 1
    module._guard = module._guard.loaded(module._state_key)
    module._cache.clear()


def inducing_feature_set(sfr):
    """The layer features of ``sfr``'s inducing inputs in the network's dtype (cached; those beyond the memory budget
    recomputed at each use: :func:`~ntkgp.models.sfr.system_grams.inducing_features`), computed with the progress
    ``sfr.progress`` asks."""
    def compute():
        return network_features(sfr.engine, inducing_features(sfr.engine, sfr.inducing_points, sfr.progress,
                                                             getattr(sfr, "inducing_feature_bytes", None))[0])

    return sfr._cache.z_features(compute, generation_key(sfr))


def z_jacobian(sfr) -> Tensor:
    """:math:`J(Z)`, ``(M·C, P)``, of ``sfr`` for predictions with a graph to the inputs (cached): in float64, on the
    copy of a float32 network that forms :math:`K_{ZZ}` (:func:`~ntkgp.models.sfr.system_grams.precise_engine`), as
    the inducing features of the route without a graph; with the progress ``sfr.progress`` asks."""
    def compute() -> Tensor:
        precise = precise_engine(sfr.engine)
        with reporting(precise.core, sfr.progress, "SFR J(Z)"):
            return precise.jacobian(to_network(sfr.inducing_points, precise.dtype, sfr.inducing_points.device)).detach()

    return sfr._cache.z_jacobian(compute, generation_key(sfr))
