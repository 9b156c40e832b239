r"""Iterated sites for :meth:`SFR.update <ntkgp.models.sfr.SFR.update>`: the new points' sites at the mode.

SFR keeps the data it has seen only as their Gaussian sites, projected on the inducing inputs
(:math:`B_{old}`, :math:`\tilde y_{old}`). New points with a classification likelihood get their sites at the mode
of the sparse model's log joint, in the parametrization :math:`f(x) = m(x) + K_{xZ}\alpha` (docs/sfr.md,
"Updates"):

.. math::
    \Psi(\alpha) = \sum_{n \in \text{new}} \log p(y_n \mid m_n + K_{nZ}\alpha)
        - \tfrac12 \alpha^\top (K_{ZZ} + B_{old}) \alpha + \alpha^\top \tilde y_{old},

(the DTC prior :math:`u = K_{ZZ}\alpha \sim N(0, K_{ZZ})` times the old sites), concave for the logistic and
softmax likelihoods. Its Newton step with the new points' sites at :math:`f` is the SFR posterior mean after
adding those sites, :math:`\alpha^+ = (K_{ZZ} + B_{old} + B_{new}(f))^{-1} (\tilde y_{old} + \tilde y_{new}(f))`;
solved as SFR solves its posterior (:func:`~ntkgp.models.sfr.whitening.whitened_factors`); the first iterate puts
the sites at the network's outputs (the one-step update) and
:func:`~ntkgp.laplace.function_space.site_posterior.damped_newton` takes it from there. The old sites stay where they are
(their data are gone): this is the mode of the sparse model given the old sites, not of the union. The
prior precisions, noise and temperature of the call are used; the sites are then fixed like any others.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from ...laplace.function_space.site_posterior import SiteIterationWarning, damped_newton
from ...likelihoods import gradient, hessian, log_likelihood, validate_targets
from ...ntk import NTKEngine
from ...options import OutputCoupling, PriorMean
from ...progress import Progress
from .factorization import rounding
from .statistics import DualStatistics
from .streaming import mean_offset
from .system_grams import system_grams_and_diagonal
from .validation import InputLayout, refuse_graph
from .whitening import InducingFactors, whitened_factors

__all__ = ["iterated_statistics", "iterated_update"]


def _cross(
    engine: NTKEngine, z: Tensor, x: Tensor, coupling: OutputCoupling, weights: Tensor, rows: int, z_features=None,
    progress: bool | None = False,
) -> Tensor:
    """:math:`K_{Zx}` per system at group weights ``weights``: ``(1, M·C, b·C)`` or ``(C, M, b)``; ``progress``
    over the points of ``x`` (``"SFR update (cross-Grams)"``, :mod:`ntkgp.progress`)."""
    parts = []
    with Progress(x.shape[0], "SFR update (cross-Grams)", progress, unit="point") as bar:
        for s in range(0, x.shape[0], rows):
            grams, _ = system_grams_and_diagonal(engine, z, x[s : s + rows], coupling, with_diagonal=False,
                                                 x1_features=z_features)
            parts.append(torch.einsum("g,gbkr->bkr", weights, grams.to(weights)))
            bar.update(min(rows, x.shape[0] - s))
    return torch.cat(
        parts, dim=-1
    )  # the points of x are consecutive columns (interleaved for joint coupling)


def iterated_statistics(
    engine: NTKEngine,
    likelihood: Likelihood,
    z: Tensor,
    coupling: OutputCoupling,
    mean: PriorMean,
    x: Tensor,
    y: Tensor,
    statistics: DualStatistics,
    inducing: InducingFactors,
    weights: Tensor,
    slots: Tensor,
    rows: int,
    z_features=None,
    progress: bool | None = False,
) -> DualStatistics:
    r"""Fresh :class:`DualStatistics` of the new points ``(x, y)`` with their sites at the mode of :math:`\Psi`.

    Args:
        engine: the NTK engine.
        likelihood: the model's likelihood (not Gaussian).
        z: inducing inputs ``(M, *example)``.
        coupling: output coupling.
        mean: prior mean.
        x: the new inputs, prepared ``(b, *example)``; y: their targets.
        statistics: the model's statistics so far (read only); the new ones are kept the same way (per group,
            or combined at the same :math:`\delta`, which must then be ``1/weights``).
        inducing: the factors of :math:`K_{ZZ}` per system at ``weights`` (:func:`~ntkgp.models.sfr.whitening.inducing_factors`).
        weights: group weights :math:`1/\delta` ``(G,)``; slots: the slot weights.
        rows: points per accumulation step.
        z_features: the layer features of ``z`` kept by the model (:meth:`~ntkgp.ntk.NTKEngine.feature_set`), or
            ``None``.
        progress: the model's ``progress`` option (:mod:`ntkgp.progress`), for the two passes over the new points:
            their cross-Grams with ``z`` (``"SFR update (cross-Grams)"``) and their statistics at the sites
            (``"SFR dual statistics"``).

    Warns:
        SiteIterationWarning: when the Newton iteration stops before it converged (the last iterate is used).
    """
    kzz = inducing.kzz  # formed once for the call (the model keeps only its Cholesky factor)
    dtype = kzz.dtype  # the model's dtype (the statistics are kept in theirs)
    weights, slots = weights.to(dtype), slots.to(dtype)
    with torch.no_grad():
        steps = range(0, x.shape[0], rows)
        f_net = [engine.outputs(x[s : s + rows]) for s in steps]
        offsets = torch.cat([mean_offset(engine, x[s : s + rows], f, mean) for s, f in zip(steps, f_net)]).to(dtype)
        f0 = torch.cat(f_net).to(dtype)
        b, c = f0.shape
        y = validate_targets(likelihood, y, c, num_data=b, name="y_new").to(device=f0.device)
        m = f0 - offsets  # the prior mean, in the statistics' dtype (float64)
        kept = statistics.precision
        b_old, y_old = (t.to(dtype) for t in statistics.projected(weights.to(kept), slots.to(kept)))
        cross = _cross(engine, z, x, coupling, weights, rows, z_features, progress)  # (nb, K, R)
        joint = coupling is OutputCoupling.JOINT
        size = cross.shape[1]

        def values(alpha: Tensor) -> Tensor:  # f = m + K_xZ α, (b, C)
            if joint:
                return m + (cross[0].mT @ alpha[0]).view(b, c)
            return m + torch.einsum("ckb,ck->bc", cross, alpha)

        def target(state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            f = state[1].view(b, c)
            lam, g = hessian(likelihood, f, y), gradient(likelihood, f, y)
            if joint:
                per_point = cross[0].view(size, b, c)
                r = torch.einsum("nij,nj->ni", lam, f - m) + g
                b_new = torch.einsum("knc,ncd,lnd->kl", per_point, lam, per_point)[None]
                y_new = (cross[0] @ r.reshape(-1))[None]
            else:
                lam = lam.diagonal(dim1=-2, dim2=-1)  # (b, C)
                r = lam * (f - m) + g
                b_new = torch.einsum("ckn,nc,cln->ckl", cross, lam, cross)
                y_new = torch.einsum("ckn,nc->ck", cross, r)
            # the model's own solve (whitened, dropping K_ZZ's negligible directions: no jitter)
            total = b_old + b_new
            eps = rounding(engine.dtype, total, inducing)  # as SFR's own solve
            alpha = whitened_factors(kzz, total, y_old + y_new, inducing=inducing, overwrite_b_u=True, **eps).alpha
            return alpha, values(alpha).reshape(-1)

        def objective(state: tuple[Tensor, Tensor]) -> Tensor:
            alpha, f = state
            quadratic = torch.einsum("bk,bkl,bl->", alpha, kzz + b_old, alpha)
            return log_likelihood(likelihood, f.view(b, c), y).sum() - 0.5 * quadratic + (alpha * y_old).sum()

        first = target((None, f0.reshape(-1)))
        (_, f), steps, converged = damped_newton(first, target, objective)
        if not converged:
            warnings.warn(
                f"SFR.update: the Newton iteration of the new sites stopped after {steps} steps without "
                "converging; the last iterate is used",
                SiteIterationWarning,
                stacklevel=3,
            )
        sites = f.view(b, c)
        kept = statistics.precision.dtype
        new = statistics.empty_like()  # per group, or combined at the same δ
        with Progress(b, "SFR dual statistics", progress, unit="point") as bar:
            for s in range(0, b, rows):
                grams, diag = system_grams_and_diagonal(engine, z, x[s : s + rows], coupling, x1_features=z_features)
                rows_ = slice(s, s + rows)
                site, offset = sites[rows_].to(kept), (sites[rows_] - m[rows_]).to(kept)  # o = f − m at the sites
                new.accumulate(likelihood, grams.to(kept), diag.to(kept), site, offset, y[rows_])
                bar.update(min(rows, b - s))
    return new


def iterated_update(
    engine: NTKEngine,
    likelihood: Likelihood,
    z: Tensor,
    coupling: OutputCoupling,
    mean: PriorMean,
    batches: Iterable[tuple[Tensor, Tensor]],
    layout: InputLayout,
    num_outputs: int,
    statistics: DualStatistics,
    inducing: InducingFactors,
    weights: Tensor,
    slots: Tensor,
    rows: int,
    z_features=None,
    progress: bool | None = False,
) -> DualStatistics:
    """:func:`iterated_statistics` of checked ``(x_new, y_new)`` batches, all held in memory for the call.

    Raises:
        ValueError, TypeError: for invalid batches (before anything is computed); NotImplementedError: for
            inputs that require grad.
    """
    xs, ys = [], []
    for bx, by in batches:
        refuse_graph(bx, "x_new")
        xs.append(engine.prepare(layout.check(bx, "x_new")[0], "x_new"))
        ys.append(validate_targets(likelihood, by, num_outputs, num_data=bx.shape[0], name="y_new"))
    if not xs:
        raise ValueError("x_new holds no data")
    return iterated_statistics(
        engine, likelihood, z, coupling, mean, torch.cat(xs), torch.cat(ys), statistics, inducing, weights, slots, rows,
        z_features, progress,
    )
