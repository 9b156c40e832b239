r"""What SFR's predictive needs at test points, chunk by chunk: cross-covariances, prior blocks and means.

For test inputs ``x`` (``b`` points) and the posterior factors of :mod:`~ntkgp.models.sfr.whitening`:

.. math::
    \mu(x) = m(x) + K_{xZ}\,\alpha = f(x) + \big(K_{xZ}\,\alpha - o(x)\big), \qquad
    \Sigma(x, x) = K_{xx} - V^\top V + (R^{-1}V)^\top (R^{-1}V), \quad V = W K_{Zx},

with ``nb`` systems (one for ``"joint"`` coupling, ``C`` for ``"independent"``). For the linearized prior mean the
mean is the network's output plus a correction, :math:`o(x) = J(x)\theta^*` computed directly (a Jacobian-vector
product): the prior mean :math:`f(x) - J(x)\theta^*` is never formed, so nothing of size :math:`|J\theta^*|` is
cancelled in the network's dtype; the correction is formed in the statistics' dtype (float64). The variances are the
Nyström residual :math:`\operatorname{diag}(K_{xx} - V^\top V) \ge 0`, clipped at zero where rounding makes it
negative (it vanishes at the inducing inputs), plus the sum of squares :math:`\lVert R^{-1}V\rVert^2`: never
negative. :class:`PredictiveTerms` computes these for one chunk at a time, so that memory is ``O(b · C · K)`` per chunk (``K = M·C`` or ``M``).

**Two routes.** Without a graph to ``x`` the cross-Grams come from the NTK engine's Gram routines (layer
features; no Jacobian). When ``x.requires_grad`` (and grad mode is on), they come from the test points'
Jacobian :math:`J(x)` (:meth:`~ntkgp.ntk.NTKEngine.jacobian`, which is differentiable in ``x``) and the inducing
inputs' Jacobian :math:`J(Z)` (cached by the model, ``M·C·P`` numbers), and the network outputs from a
functional call with detached weights: every term then carries its derivative with respect to ``x``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import NumericalWarning
from ...ntk import NTKEngine
from ...ntk.feature_pass import FeatureSet
from ...options import OutputCoupling, PredictiveMean, PriorMean
from .streaming import mean_offset
from .system_grams import system_grams_and_diagonal
from .variance_precision import check_variance_precision
from .whitening import WhitenedFactors

__all__ = ["ChunkPrediction", "PosteriorState", "PredictiveTerms", "SharedPieces"]


@dataclass
class PosteriorState:
    r"""The sparse posterior at the current hyperparameters.

    Attributes:
        weights: group weights :math:`1/\delta`, ``(G,)``.
        slots: slot weights (:math:`1/\sigma_c^2` or :math:`1/T`), ``(S,)``.
        factors: the whitened factors (:func:`~ntkgp.models.sfr.whitening.whitened_factors`).
        mean_error: for a network whose features are coarser than the model's algebra (float32): the error of the
            mean's term :math:`K_{xZ}\alpha` per unit of :math:`\sqrt{K_{xx}}` from the rounding of
            :math:`K_{xZ}`, :math:`\epsilon_X\sqrt{\alpha^\top K_{ZZ}\alpha}` per system ``(nb,)``: the float64
            products of the float32 features of ``x`` with float64 features of ``Z`` err by
            :math:`|\Delta J(x) P_0^{-1} J(Z)^\top\alpha| \le \lVert P_0^{-1/2}\Delta J(x)^\top\rVert
            \lVert P_0^{-1/2}J(Z)^\top\alpha\rVert \le \epsilon_X\sqrt{K_{xx}}\sqrt{\alpha^\top K_{ZZ}\alpha}`
            (the row rounded normwise by :math:`\epsilon_X` in the prior's metric); ``None`` otherwise.
        cross_rounding: for such a network, the unit roundoff of its features and :math:`\sqrt{[K_{ZZ}]_{kk}}` per
            system ``(nb, K)``, what bounds the variances' error (:mod:`~ntkgp.models.sfr.variance_precision`);
            ``None`` otherwise.
    """

    weights: Tensor
    slots: Tensor
    factors: WhitenedFactors
    mean_error: Tensor | None = None
    cross_rounding: tuple[float, Tensor] | None = None


@dataclass
class ChunkPrediction:
    """The predictive of one chunk of ``b`` test points.

    Attributes:
        mean: ``(b, C)``.
        blocks: posterior ``C×C`` block of each point, ``(b, C, C)``.
        low_rank_z: :math:`V = W K_{Zx}`, ``(nb, K, R)`` (``R = b·C`` joint, ``b`` independent).
        low_rank_s: :math:`R^{-1} V`, same shape.
    """

    mean: Tensor
    blocks: Tensor
    low_rank_z: Tensor
    low_rank_s: Tensor


@dataclass
class SharedPieces:
    r"""The :math:`\delta`-free terms of one chunk (:meth:`PredictiveTerms.pieces`).

    Attributes:
        grams: per-group cross-Grams :math:`K^{(g)}_{Zx}`, ``(G, nb, K, R)``.
        diagonal: per-group prior blocks, ``(G, b, C, C)``.
        outputs: the network's outputs :math:`f(x)`, ``(b, C)``.
        offset: :math:`J(x)\theta^*` for the linearized prior mean's ``"gp"`` mean, ``(b, C)``, or ``None``.
    """

    grams: Tensor
    diagonal: Tensor
    outputs: Tensor
    offset: Tensor | None


def point_outer(a: Tensor, num_points: int, num_outputs: int) -> Tensor:
    r""":math:`\sum_k a_{k,(n,i)} a_{k,(n,j)}` per point, ``(b, C, C)``, for low-rank factors ``a`` ``(nb, K, R)``."""
    if a.shape[0] == 1:  # one system: joint coupling (or a single output)
        rows = a[0].reshape(a.shape[1], num_points, num_outputs)
        return torch.einsum("kni,knj->nij", rows, rows)
    return torch.diag_embed(a.square().sum(-2).T)


class PredictiveTerms:
    r"""The predictive's ingredients at test points, for a fixed model state.

    Args:
        engine: the NTK engine.
        inducing_points: ``Z``, ``(M, *example)``.
        coupling: output coupling.
        num_outputs: ``C``.
        state: the posterior (:class:`PosteriorState`).
        mean: the prior mean.
        predictive_mean: ``"gp"`` or ``"nn"``.
        z_jacobian: returns :math:`J(Z)` ``(M·C, P)`` (detached; used only on the route with a graph to ``x``).
        z_features: the layer features of ``Z`` (:meth:`~ntkgp.ntk.NTKEngine.feature_set`, kept by the model), or
            ``None`` (recomputed for every chunk).
    """

    def __init__(
        self,
        engine: NTKEngine,
        inducing_points: Tensor,
        coupling: OutputCoupling,
        num_outputs: int,
        state: PosteriorState,
        mean: PriorMean,
        predictive_mean: PredictiveMean,
        z_jacobian: Callable[[], Tensor],
        z_features: FeatureSet | None = None,
    ) -> None:
        self.engine = engine
        self.inducing_points = inducing_points
        self.coupling = coupling
        self.num_outputs = num_outputs
        self.state = state
        self.mean = mean
        self.predictive_mean = predictive_mean
        self.z_jacobian = z_jacobian
        self.z_features = z_features

    @staticmethod
    def with_graph(x: Tensor) -> bool:
        """Whether ``x`` needs derivatives (it requires grad and grad mode is on)."""
        return x.requires_grad and torch.is_grad_enabled()

    def _column_weights(self) -> Tensor:
        cols = self.engine.groups.column_groups(device=self.state.weights.device)
        return self.state.weights[cols]

    def _jacobian_terms(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Route with a graph: :math:`K_{Zx}` per system, prior blocks and :math:`J(x)` from Jacobians."""
        n, c = x.shape[0], self.num_outputs
        jac = self.engine.jacobian(x).view(n, c, -1).to(self.state.weights)
        jz = self.z_jacobian().to(self.state.weights)
        jz = jz.view(-1, c, jz.shape[-1])
        weighted = jac * self._column_weights()
        if self.coupling is OutputCoupling.JOINT:
            cross_t = torch.einsum("mcp,ndp->mcnd", jz, weighted).reshape(1, jz.shape[0] * c, n * c)
        else:
            cross_t = torch.einsum("mcp,ncp->cmn", jz, weighted)
        blocks = torch.einsum("ncp,ndp->ncd", weighted, jac)
        return cross_t, blocks, jac

    def pieces(self, x: Tensor) -> SharedPieces:
        r"""What the chunk's predictive needs that does not depend on :math:`\delta`: the per-group cross-Grams,
        the prior blocks' per-group diagonals and the network terms (route without a graph only). Computed once,
        they serve every :math:`\delta` of :meth:`~ntkgp.models.SFR.predictive_grid`, each :class:`PredictiveTerms`
        weighting them by its own :math:`1/\delta`."""
        grams, diag = system_grams_and_diagonal(self.engine, self.inducing_points, x, self.coupling,
                                                 x1_features=self.z_features)
        return SharedPieces(grams, diag, *self._network_terms(x, None))

    def _gram_terms(self, x: Tensor, pieces: SharedPieces | None = None) -> tuple[Tensor, Tensor]:
        """Route without a graph: :math:`K_{Zx}` per system and prior blocks from the engine's Grams."""
        if pieces is None:
            grams, diag = system_grams_and_diagonal(self.engine, self.inducing_points, x, self.coupling,
                                                     x1_features=self.z_features)
        else:
            grams, diag = pieces.grams, pieces.diagonal
        weights = self.state.weights
        cross_t = torch.einsum("g,gbkr->bkr", weights, grams.to(weights))
        return cross_t, torch.einsum("g,gnij->nij", weights, diag.to(weights))

    def _network_terms(self, x: Tensor, jac: Tensor | None) -> tuple[Tensor, Tensor | None]:
        r"""The network's output :math:`f(x)` and, for the linearized prior mean of the ``"gp"`` mean, the offset
        :math:`o(x) = J(x)\theta^*` (else ``None``), ``(b, C)`` each, in the model's dtype."""
        dtype = self.state.weights
        linearized = self.predictive_mean is PredictiveMean.GP and self.mean is PriorMean.LINEARIZED
        if jac is None:
            f = self.engine.outputs(x)
            offset = mean_offset(self.engine, x, f, self.mean) if linearized else None
        else:  # with a graph to x (detached weights)
            params = self.engine.params()
            f = self.engine.core.call({}, x)  # on ntkgp's private copy of the network
            offset = None
            if linearized:
                theta = torch.cat([p.reshape(-1) for p in params.values()]).to(jac)
                offset = (jac @ theta).reshape(f.shape)
        return f.to(dtype), None if offset is None else offset.to(dtype)

    def cross(self, x: Tensor, pieces: SharedPieces | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """:math:`K_{Zx}` per system ``(nb, K, R)``, the prior blocks ``(b, C, C)`` and :math:`J(x)` (or ``None``);
        from ``pieces`` (:meth:`pieces`) where given."""
        if pieces is None and self.with_graph(x):
            cross_t, blocks, jac = self._jacobian_terms(x)
        else:
            (cross_t, blocks), jac = self._gram_terms(x, pieces), None
        if self.coupling is OutputCoupling.INDEPENDENT:
            blocks = torch.diag_embed(blocks.diagonal(dim1=-2, dim2=-1))
        return cross_t, blocks, jac

    def low_rank(self, x: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`V = W K_{Zx}` and :math:`R^{-1}V` for prepared test inputs ``x``, ``(nb, K, R)`` each."""
        return self.state.factors.project(self.cross(x)[0])

    def chunk(self, x: Tensor, pieces: SharedPieces | None = None) -> ChunkPrediction:
        r"""Mean, posterior point blocks and low-rank factors of one chunk of prepared inputs ``x``; from the
        :math:`\delta`-free ``pieces`` of the chunk (:meth:`pieces`) where given."""
        n, c = x.shape[0], self.num_outputs
        cross_t, prior_blocks, jac = self.cross(x, pieces)
        f, offset = self._network_terms(x, jac) if pieces is None else (pieces.outputs, pieces.offset)
        if self.predictive_mean is PredictiveMean.NN:
            mean = f
        else:
            correction = torch.einsum("bkr,bk->br", cross_t, self.state.factors.alpha)
            correction = correction.view(n, c) if self.coupling is OutputCoupling.JOINT else correction.T
            # zero prior mean: K_xZ α; linearized: f(x) + (K_xZ α − J(x)θ*), never f(x) − J(x)θ* first
            mean = correction if offset is None else f + (correction - offset)
        low_z, low_s = self.state.factors.project(cross_t)
        # K_xx − VᵀV is the Nyström residual, a Schur complement ≥ 0 that cancels in rounding (it is 0 at Z):
        # its diagonal is clipped at 0, so that the variances are that plus the sum of squares ‖R⁻¹V‖² ≥ 0
        residual = prior_blocks - point_outer(low_z, n, c)
        diagonal = residual.diagonal(dim1=-2, dim2=-1)
        residual = residual + torch.diag_embed(diagonal.clamp_min(0) - diagonal)
        blocks = residual + point_outer(low_s, n, c)
        if self.predictive_mean is PredictiveMean.GP and self.state.mean_error is not None:
            _check_mean_precision(self.state.mean_error, prior_blocks, blocks, self.coupling)
        if self.state.cross_rounding is not None:
            check_variance_precision(self.state.cross_rounding[0], prior_blocks, blocks)
        return ChunkPrediction(mean=mean, blocks=blocks, low_rank_z=low_z, low_rank_s=low_s)

    # ------------------------------------------------------------------ the prior covariance of f(x)
    def prior_matmul(self, x: Tensor, rhs: Tensor) -> Tensor:
        r""":math:`K_{xx}\,v` for ``rhs`` ``(b·C, k)``, matrix-free (:meth:`~ntkgp.ntk.NTKEngine.matvec`:
        one vector-Jacobian and one Jacobian-vector product; differentiable in ``x``). For independent outputs
        the output-diagonal blocks only, by ``C`` masked right-hand sides in one product."""
        weights = self.state.weights
        dtype = self.engine.dtype  # the product is the network's (one vjp and one jvp), formed in its dtype
        if self.coupling is OutputCoupling.JOINT or self.num_outputs == 1:
            return self.engine.matvec(x, rhs.to(dtype), weights.to(dtype)).to(rhs)
        n, c, k = x.shape[0], self.num_outputs, rhs.shape[-1]
        eye = torch.eye(c, dtype=rhs.dtype, device=rhs.device)
        masked = torch.einsum("nck,cd->ncdk", rhs.view(n, c, k), eye).reshape(n * c, c * k)
        out = self.engine.matvec(x, masked.to(dtype), weights.to(dtype)).to(rhs).view(n, c, c, k)
        return out.diagonal(dim1=1, dim2=2).permute(0, 2, 1).reshape(n * c, k)

    def prior_dense(self, x: Tensor) -> Tensor:
        r"""The prior covariance :math:`K_{xx}`, ``(b·C, b·C)`` interleaved (output-diagonal blocks if independent)."""
        n, c = x.shape[0], self.num_outputs
        weights = self.state.weights
        if self.with_graph(x):
            jac = self.engine.jacobian(x).to(weights)
            prior = (jac * self._column_weights()) @ jac.T
        else:
            prior = torch.einsum("g,gij->ij", weights, self.engine.group_grams(x).to(weights))
        if self.coupling is OutputCoupling.INDEPENDENT and c > 1:
            mask = torch.eye(c, dtype=torch.bool, device=prior.device).repeat(n, n)
            prior = prior * mask
        return prior


def _check_mean_precision(
    mean_error: Tensor, prior_blocks: Tensor, blocks: Tensor, coupling: OutputCoupling
) -> None:
    """Warn (``NumericalWarning``) when the rounding of the float32 cross-covariances can move the predictive mean by
    more than one posterior standard deviation at some test point (:attr:`PosteriorState.mean_error`)."""
    prior_var = prior_blocks.detach().diagonal(dim1=-2, dim2=-1).clamp_min(0)  # (b, C)
    std = blocks.detach().diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()
    scale = mean_error if coupling is OutputCoupling.INDEPENDENT else mean_error.expand(prior_var.shape[-1])
    ratio = (scale * prior_var.sqrt() / std.clamp_min(torch.finfo(std.dtype).tiny)).max()
    if bool(ratio > 1):
        warnings.warn(
            f"SFR's predictive mean may be off by up to about {float(ratio):.2g} posterior standard deviations at "
            "some test points: the network's float32 features round the cross-covariances K_xZ (and the data's), "
            "and the sparse system (K_ZZ + B_u)⁻¹ỹ_u amplifies that (a small noise variance, a nearly singular "
            "K_ZZ). Use a float64 network (net.double() and float64 inputs) for these means; the variances are "
            "affected much less.",
            NumericalWarning,
            stacklevel=4,
        )
