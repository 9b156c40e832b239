r"""The full GGN / EF in function space: :math:`\log|H + P_0|` through the per-group Grams of its unit rows.

With the unit rows :math:`U` of :math:`H` (``R × P``: :math:`\tilde L_n^\top J_n` for the GGN, :math:`R = NC`,
or :math:`N(C - 1)` for a softmax, whose :math:`\Lambda_n` has rank :math:`C - 1` and a root of that many columns,
:func:`~ntkgp.laplace.ggn.scaling.unit_hessian_root`;
:math:`\tilde g_n^\top J_n` for the EF, :math:`R = N`) and the row weights :math:`w(s)` of the likelihood's output
scale (:mod:`~ntkgp.laplace.ggn.scaling`), :math:`H = U^\top W U` and by the matrix determinant lemma

.. math::
    \log|H + P_0| - \log|P_0| = \log\Bigl|I_R + W^{1/2} \Bigl(\sum_g \delta_g^{-1} U_g U_g^\top\Bigr)
    W^{1/2}\Bigr|,

with the per-group Grams :math:`U_g U_g^\top = \tilde L^\top J_g J_g^\top \tilde L` from the NTK's per-group
Grams :math:`J_g J_g^\top` (``docs/math.md``, "Laplace-GGN evidence"). Built once per :math:`\theta^*` (at
most :math:`O(R^2 P)`), each evaluation is one :math:`R \times R` Cholesky factorization
(:func:`~ntkgp.laplace.ggn.exact_log_det.scaled_log_det`), differentiable in every :math:`\delta_g` and
in :math:`s`. This is the function-space route of the evidence of :class:`~ntkgp.NTKGP`, of
:class:`~ntkgp.mlls.LaplaceGGNMarginalLogLikelihood` and of :func:`~ntkgp.training.train_marglik`: the cheaper
representation when :math:`R < P` (:func:`~ntkgp.laplace.weight_space.exact_curvature` chooses).
Memory: the ``G`` Grams, :math:`G R^2` numbers (for a Gaussian GGN the NTK's own Grams, not a copy), plus
:math:`3 R^2` while an evaluation and its gradient run.
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ...linalg import block_sandwich
from ...ntk import NTKEngine, ParameterGroups
from ...ntk.groups import GroupSpec
from ...options import CurvatureKind
from ...options import choose
from ...progress import check_progress, reporting
from .curvature import Curvature
from .data_pass import DataPass
from .exact_log_det import scaled_log_det, spectral_log_det_ratio
from .scaling import unit_gradient, unit_hessian_root, unit_hessian_sqrt

__all__ = ["FunctionSpaceCurvature", "function_space_curvature", "unit_grams"]


def unit_grams(
    grams: Tensor, likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor, fisher: bool
) -> tuple[Tensor, Tensor]:
    r"""The per-group Grams of the unit rows, :math:`U_g U_g^\top`, from the NTK's :math:`J_g J_g^\top`.

    Args:
        grams: ``(G, N·C, N·C)``, rows ``n·C + c``.
        likelihood: the likelihood; ``scale0`` its output scale :math:`s_0` (detached), at which the unit
            factors :math:`\tilde L_n = S_0^{-1/2} L_n` / :math:`\tilde g_n = S_0^{-1} g_n` are taken.
        f, y: network outputs ``(N, C)`` and normalized targets.
        fisher: the EF (rows :math:`\tilde g_n^\top J_n`; a single output scale only) instead of the GGN.

    Returns:
        The Grams ``(G, R, R)`` (``grams`` itself for a Gaussian GGN) and the index :math:`k(r)` of each row's
        output scale, ``(R,)``.

    Raises:
        ValueError: for the EF of a likelihood with several output scales (per-output Gaussian noise).
    """
    n, c = f.shape
    if fisher:
        if scale0.shape[0] > 1:
            raise ValueError("the function-space empirical Fisher needs a single output scale; use full_ef")
        u = unit_gradient(likelihood, f, y, scale0)  # (N, C): row n is Σ_c u_nc J_nc
        if c == 1:
            grams = grams * (u[:, 0][None, :, None] * u[:, 0][None, None, :])
        else:
            grams = torch.einsum("na,gnamb,mb->gnm", u, grams.reshape(-1, n, c, n, c), u)
        return grams, torch.zeros(n, dtype=torch.long, device=f.device)
    if scale0.shape[0] > 1 or c == 1:  # Gaussian (unit root I), or one output
        row_scale = torch.arange(n * c, device=f.device) % scale0.shape[0]
        if scale0.shape[0] == 1 and c == 1:
            root = unit_hessian_sqrt(likelihood, f, y, scale0)[:, 0, 0]  # (N,), 1 for a Gaussian likelihood
            if not bool((root == 1).all()):
                grams = grams * (root[None, :, None] * root[None, None, :])
        return grams, row_scale
    root = unit_hessian_root(likelihood, f, y, scale0)  # (N, C, M): M = C − 1 for a softmax (rank of Λ_n)
    grams = block_sandwich(root, grams, symmetric=True)  # the NTK's Grams
    return grams, torch.zeros(grams.shape[-1], dtype=torch.long, device=f.device)


class FunctionSpaceCurvature(Curvature):
    r"""The full GGN / EF through the per-group Grams of its unit rows, :math:`U_g U_g^\top` (``(G, R, R)``).

    :math:`\log|H + P_0| = \sum_g P_g \log\delta_g + \log|I_R + W^{1/2} (\sum_g U_g U_g^\top / \delta_g)
    W^{1/2}|` (module docstring), with the row weights :math:`w_r = s_{k(r)}` (GGN) or :math:`s_0^2` (EF).

    Args:
        groups, theta_sq_norms, f, y, scale_size: as :class:`~ntkgp.laplace.weight_space.Curvature`.
        grams: ``(G, R, R)`` (:func:`unit_grams`).
        row_scale: the index :math:`k(r)` of each row's output scale, ``(R,)``.
        fisher: ``True`` for the EF (weights :math:`s^2`; single output scale only).
        spectral: evaluate through one eigendecomposition of the Gram (one group and one scale only).
    """

    def __init__(
        self,
        groups: ParameterGroups,
        theta_sq_norms: Tensor,
        f: Tensor,
        y: Tensor,
        scale_size: int,
        grams: Tensor,
        row_scale: Tensor,
        fisher: bool,
        spectral: bool = False,
    ) -> None:
        super().__init__(groups, theta_sq_norms, f, y, scale_size)
        if fisher and scale_size != 1:
            raise ValueError("the function-space empirical Fisher needs a single output scale")
        self.grams = grams
        self.row_scale = row_scale
        self.fisher = bool(fisher)
        self.structure = "full_ef" if fisher else "full_ggn"
        self.spectral = bool(spectral) and groups.num_groups == 1 and scale_size == 1
        self._eigenvalues: Tensor | None = None

    def dense(self, likelihood: Likelihood) -> Tensor:
        raise NotImplementedError(
            "a function-space curvature holds Grams, not the (P, P) matrix; use full_ggn / full_ef for it"
        )

    def row_weights(self, likelihood: Likelihood) -> Tensor:
        """:math:`w_r`, ``(R,)``."""
        s = self.scale(likelihood)
        return s[self.row_scale] ** 2 if self.fisher else s[self.row_scale]

    def eigenvalues(self) -> Tensor:
        """The eigenvalues of the single Gram, computed once, ``(R,)`` (clamped at 0)."""
        if self._eigenvalues is None:
            self._eigenvalues = torch.linalg.eigvalsh(self.grams[0]).clamp_min(0)
        return self._eigenvalues

    def log_det_ratio(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\log|H + P_0| - \log|P_0|`: :math:`O(R)` spectrally, else one :math:`O(R^3)` Cholesky
        factorization."""
        delta = self.prior_precision_vector(prior_precision)
        if self.spectral:
            s = self.scale(likelihood)[0]
            return spectral_log_det_ratio(self.eigenvalues(), (s * s if self.fisher else s) / delta[0])
        s = self.scale(likelihood)
        if s.shape[0] == 1:  # one output scale: the uniform row weight w joins the coefficients, w / δ_g
            return scaled_log_det((s * s if self.fisher else s) / delta, None, self.grams)
        root = s[self.row_scale]
        return scaled_log_det(delta.reciprocal(), root if self.fisher else root.sqrt(), self.grams)

    def log_det(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\log|H + P_0|`: :math:`O(R)` spectrally, else an :math:`O(R^3)` Cholesky factorization."""
        delta = self.prior_precision_vector(prior_precision)
        return (self.group_sizes * delta.log()).sum() + self.log_det_ratio(delta, likelihood)


def function_space_curvature(
    net: nn.Module,
    x: Tensor,
    y: Tensor,
    likelihood: Likelihood,
    curvature: str = "ggn",
    prior_structure: GroupSpec = "layer",
    input_shape: tuple[int, ...] | None = None,
    spectral: bool = False,
    engine=None,
    validated: bool = False,
    progress: bool | None = None,
) -> FunctionSpaceCurvature:
    r"""The full GGN / EF in function space: the per-group NTK Grams :math:`J_g J_g^\top` (``(G, NC, NC)``)
    contracted with the unit factors into the Grams of the unit rows (:func:`unit_grams`).

    Args:
        net: the trained network (never modified).
        x: training inputs ``(N, ...)`` (a tensor: the Grams couple every pair of points).
        y: training targets.
        likelihood: a supported likelihood.
        curvature: ``"ggn"`` or ``"ef"`` (the EF needs a single output scale: not a multi-output Gaussian).
        prior_structure: prior-precision groups, see :func:`ntkgp.ntk.resolve_groups`.
        input_shape: shape of one input; flat ``(N, D)`` inputs are reshaped to it.
        spectral: see :class:`FunctionSpaceCurvature`.
        engine: an :class:`~ntkgp.ntk.NTKEngine` of ``net`` (with ``prior_structure``) to reuse: its
            structured plan and input checks are cached; by default a new one.
        validated: ``x`` is already prepared by the engine and ``y`` normalized by
            :func:`~ntkgp.likelihoods.validate_targets` (skips the per-call checks; for a training loop).
        progress: over the chunks of the Gram pass (``"function-space curvature (layer features)"`` and ``(Gram)``):
            ``None`` (auto), ``True`` (a bar) or ``False`` (silent), whatever the ``engine``'s own setting
            (:func:`~ntkgp.progress.reporting`).
    """
    check_progress(progress)
    fisher = choose(CurvatureKind, curvature, "curvature") is CurvatureKind.EF
    if engine is None:
        engine = NTKEngine(net, prior_structure=prior_structure, input_shape=input_shape)
    data = DataPass.on(engine.core, likelihood)  # reuses the engine's layer plans and input checks
    if fisher and data.scale0.shape[0] > 1:
        raise ValueError("the function-space empirical Fisher needs a single output scale; use full_ef")
    if validated:  # x prepared and y normalized by the caller (train_marglik checked them once)
        xb, yb = x, y
        with torch.no_grad():
            fb = data.forward(xb)
        data.outputs.append(fb)
        data.targets.append(yb)
    else:
        (xb, fb, yb), = list(data.batches(x, y, max(int(x.shape[0]), 1), False, "function-space curvature"))
    with reporting(engine.core, progress, "function-space curvature"):
        grams = engine.group_grams(xb)
    grams, row_scale = unit_grams(grams, likelihood, fb, yb, data.scale0, fisher)
    f_all, y_all = data.collected()
    return FunctionSpaceCurvature(data.core.groups, data.theta_sq_norms(), f_all, y_all, data.scale0.shape[0],
                                  grams, row_scale, fisher, spectral)
