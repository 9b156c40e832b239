r"""SFR's collapsed evidence along one prior precision from one eigendecomposition.

Every term of the bound (:func:`~ntkgp.models.sfr.evidence.collapsed_bound`) is homogeneous in the group weights
:math:`w = 1/\delta`: :math:`K_{ZZ}` and :math:`\tilde y_u` are linear in them, :math:`B_u` quadratic, the trace
term linear, the data fit free of them. Scaling every group's precision by one factor, :math:`\delta = s\,\delta_0`,
therefore gives, with the whitening :math:`W_0` of :math:`K_{ZZ}(\delta_0)`, :math:`A_0 = W_0 B_u W_0^\top = Q
\Lambda Q^\top` (eigenvalues :math:`\lambda_i \ge 0`) and :math:`v = Q^\top W_0 \tilde y_u` at :math:`\delta_0`:
:math:`W(s) = \sqrt s\, W_0`, :math:`A(s) = A_0/s`, :math:`W(s)\tilde y_u(s) = W_0 \tilde y_u/\sqrt s`, and

.. math::
    \mathcal L(s) = c_0 + \tfrac12 \sum_i \frac{v_i^2}{s + \lambda_i} - \tfrac12 \sum_i \log\Big(1 +
    \frac{\lambda_i}{s}\Big) - \frac{t_0 - \operatorname{tr} A_0}{2 s},

:math:`t_0` the trace term :math:`\sum_n \operatorname{tr}(\Lambda_n K_{nn})` at :math:`\delta_0`. After one
eigendecomposition (``C·O(M^3)`` independent outputs, ``O((MC)^3)`` joint) each value and its derivative in
:math:`\delta` cost ``O(MC)``, where the direct route refactorizes :math:`K_{ZZ}` and :math:`I + A` at every
value. It is the same model only where the direct route keeps every inducing direction (no eigen-direction of
:math:`K_{ZZ}` dropped below its rounding threshold,
:func:`~ntkgp.models.sfr.whitening.whitened_factors`): :meth:`ScaledEvidence.covers` applies that routine's own
sufficient tests, scaled to :math:`s`, and anything else takes the direct route.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .factorization import kzz_factors, rounding
from .inducing_points import model_dtype
from .whitening import GRAM_FACTOR, SITE_FACTOR, InducingFactors, Whitening, keeps_every_direction

__all__ = ["ScaledEvidence", "evidence_of_delta"]


class ScaledEvidence:
    r"""The bound of ``sfr`` at :math:`\delta = s\,\delta_0` (module docstring), :math:`\delta_0` its prior
    precision when built: its statistics, likelihood and inducing inputs as they are then (built within one
    search, never kept by the model).

    Use :meth:`at` to build it (``None`` where it does not apply: statistics combined at fixed :math:`\delta`, or
    a :math:`K_{ZZ}` whose Cholesky factorization fails, more than one prior-precision group).
    """

    def __init__(self, delta0: Tensor, c0: Tensor, gap0: Tensor, lam: Tensor, v: Tensor, inducing: InducingFactors,
                 gram_threshold: Tensor, site_threshold: Tensor, dtype: torch.dtype) -> None:
        self.delta0, self.c0, self.gap0, self.lam, self.v, self.inducing = delta0, c0, gap0, lam, v, inducing
        self.gram_threshold, self.site_threshold, self.dtype = gram_threshold, site_threshold, dtype

    @classmethod
    def at(cls, sfr) -> ScaledEvidence | None:
        """The scaled bound of ``sfr`` at its present hyperparameters, or ``None`` (class docstring)."""
        stats = sfr.dual_statistics
        if stats.combined or sfr.covar_module.prior_precision.numel() != 1:
            return None
        sfr._check_state()
        with torch.no_grad():
            delta0 = sfr.covar_module.prior_precision.detach().reshape(-1).to(stats.precision.dtype)
            weights, slots = delta0.reciprocal(), stats.slot_weights(sfr.likelihood).detach()
            inducing = kzz_factors(sfr, weights)
            if inducing.chol is None:
                return None
            b_u, y_u = stats.projected(weights, slots)
            eps = rounding(sfr.engine.dtype, b_u, inducing)
            # the thresholds of whitened_factors (its constants and roundoffs), each scaling as its trace
            gram_threshold = GRAM_FACTOR * eps["eps"] * inducing.k_trace
            site_threshold = SITE_FACTOR * eps["site_eps"] * b_u.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0)
            white = Whitening(inducing.chol)
            a = white.sandwich(b_u, overwrite=True)
            a_trace = a.diagonal(dim1=-2, dim2=-1).sum()  # tr A₀, as the direct route sums it
            del b_u
            lam, q = torch.linalg.eigh(a)
            del a
            v = (q.mT @ white.apply(y_u.unsqueeze(-1))).squeeze(-1)
            return cls(delta0, stats.data_fit(sfr.likelihood, slots), stats.trace_term(weights, slots) - a_trace,
                       lam.clamp_min(0), v, inducing, gram_threshold, site_threshold,
                       model_dtype(sfr.inducing_points, sfr.covar_module.raw_prior_precision))

    def covers(self, delta: Tensor) -> bool:
        r"""Whether the direct route at ``delta`` :math:`= s\,\delta_0` is sure to keep every inducing direction, by its own
        tests (:func:`~ntkgp.models.sfr.whitening.keeps_every_direction`) on :math:`K_{ZZ}(\delta_0)`'s factors: with
        :math:`\tau(s) = \max(\tau_K/s, \tau_B/s^2)` and :math:`K_{ZZ}(s)^{-1} = s\,K_{ZZ}^{-1}`, both tests' products
        at :math:`s` are those at :math:`\delta_0` with the threshold :math:`\max(\tau_K, \tau_B/s)`."""
        s = float(delta.detach().reshape(())) / float(self.delta0.reshape(()))
        return keeps_every_direction(self.inducing, torch.maximum(self.gram_threshold, self.site_threshold / s))

    def __call__(self, delta: Tensor) -> Tensor:
        r"""The bound at the scalar precision ``delta`` (differentiable), in the model's dtype."""
        s = delta.reshape(()).to(self.delta0.dtype) / self.delta0.reshape(())
        quadratic = (self.v.square() / (s + self.lam)).sum()
        log_det = torch.log1p(self.lam / s).sum()
        # gap0 = t₀ − tr A₀ (the Nyström gap: the direct route's −½ Σ tr(Λ K_nn) + ½ tr A, the same two sums)
        return (self.c0 + 0.5 * quadratic - 0.5 * log_det - 0.5 * self.gap0 / s).to(self.dtype)


def evidence_of_delta(sfr) -> Callable[[], Tensor]:
    r"""``sfr``'s bound at its present prior precision, as a function to call at each value of a search over
    :math:`\delta` alone (its statistics, likelihood and network fixed during the search): by :class:`ScaledEvidence`
    where that is the direct route's model (built at the first call, once), else by ``log_marginal_likelihood``.
    Differentiable in the kernel's raw parameter either way."""
    scaled: list = []

    def evidence() -> Tensor:
        if not scaled:
            scaled.append(ScaledEvidence.at(sfr))
        delta = sfr.covar_module.prior_precision
        if scaled[0] is not None and scaled[0].covers(delta):
            return scaled[0](delta)
        return sfr.log_marginal_likelihood()

    return evidence
