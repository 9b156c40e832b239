r"""The full (dense) GGN and empirical Fisher, in weight space or in function space, for the exact evidence.

.. math::
    H_{\mathrm{GGN}}(s) = \sum_n J_n^\top \Lambda_n J_n = \sum_k s_k D_k, \qquad
    H_{\mathrm{EF}}(s) = \sum_n J_n^\top g_n g_n^\top J_n = \sum_{k, k'} s_k s_{k'} D_{kk'},

stored as components computed once with the unit factors of the likelihood (``docs/math.md``, "Laplace-GGN
evidence"; :mod:`ntkgp.laplace.weight_space.scaling`): for a Gaussian likelihood with ``C`` outputs one component per
output, :math:`D_c = \sum_n J_{nc}^\top J_{nc}` (per pair of outputs for the EF, with
:math:`\tilde g_n = g_n / s`); otherwise (a tempered classification likelihood) one component with
:math:`\tilde\Lambda_n = \Lambda_n / s_0`, :math:`\tilde g_n = g_n / s_0`. A new noise or temperature
re-weights the components without another pass over the data: **the curvature is built once per**
:math:`\theta^*` and every later evaluation of :math:`\log|H + P_0|` for new :math:`(\delta, s)` costs one
factorization.

Two exact representations of the same :math:`\log|H + P_0|`:

- **weight space** (:class:`FullCurvature`, :func:`full_ggn`, :func:`full_ef`): the ``(K, P, P)`` components;
  build :math:`O(R P^2)`, each evaluation an :math:`O(P^3)` Cholesky factorization. Sums over the data, so
  it splits over the ranks of a ``torch.distributed`` group (``distributed=True``).
- **function space** (:class:`FunctionSpaceCurvature`, :func:`function_space_curvature`): with the unit rows
  :math:`U` (``R × P``, :math:`R = N C` for the GGN, :math:`N` for the EF) and row weights :math:`w(s)`,
  :math:`H = U^\top W U`, so by the matrix determinant lemma

  .. math::
      \log|H + P_0| = \sum_g P_g \log\delta_g + \log\Bigl|I_R + W^{1/2} \Bigl(\sum_g \delta_g^{-1}
      U_g U_g^\top\Bigr) W^{1/2}\Bigr|,

  with the per-group Grams :math:`U_g U_g^\top` from the NTK engine's structured route
  (:meth:`~ntkgp.ntk.NTKEngine.group_grams`); build :math:`O(R^2 P)` at most, each evaluation an
  :math:`O(R^3)` Cholesky factorization. The cheaper one is the one with the smaller side: function space
  when :math:`R < P` (:func:`exact_curvature` chooses).

With a **single prior precision** (one group) and a single output scale, both have a spectral form: one
eigendecomposition per :math:`\theta^*`, then every evaluation is :math:`O(\min(R, P))`
(:math:`\log|H + P_0| = \sum_i \log(w \lambda_i + \delta)` over the eigenvalues :math:`\lambda_i` of
:math:`D` or of the Gram, the remaining :math:`P - R` eigenvalues being :math:`\delta`). Pass
``spectral=True`` (or let :func:`~ntkgp.training.train_marglik` decide).
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood
from linear_operator.utils.errors import NotPSDError
from torch import Tensor, nn

from ...ntk import NTKEngine, ParameterGroups
from ...ntk.groups import GroupSpec
from ...options import Curvature as CurvatureKind
from ...options import Space, choose, choose_space
from .curvature import Curvature
from .data_pass import Data, DataPass

__all__ = [
    "FullCurvature",
    "FunctionSpaceCurvature",
    "curvature_components",
    "exact_curvature",
    "full_curvature",
    "full_ef",
    "full_ggn",
    "function_space_curvature",
]


def curvature_components(rows: Tensor, fisher: bool, per_output: bool) -> Tensor:
    r"""The components of the dense GGN / EF from per-example rows, ``(K, P, P)``.

    Args:
        rows: ``(n, M, P)``: for the GGN the rows :math:`\tilde L_n^\top J_n` (``M = C``; for a Gaussian
            likelihood :math:`J_n` itself), for the EF the per-output rows :math:`\tilde g_{nc} J_{nc}`
            (``per_output``, ``M = C``) or their sum :math:`\sum_c \tilde g_{nc} J_{nc}` (``M = 1``).
        fisher: ``True`` for the EF (``per_output``: ``C²`` components, one per pair of outputs).
        per_output: one component per output (Gaussian likelihood with ``C`` outputs).

    Returns:
        ``(C, P, P)`` (GGN, per output), ``(C², P, P)`` (EF, per output) or ``(1, P, P)``.
    """
    if fisher and per_output:
        return torch.einsum("nap,nbq->abpq", rows, rows).flatten(0, 1)
    if per_output:
        return torch.einsum("ncp,ncq->cpq", rows, rows)
    flat = rows.reshape(-1, rows.shape[-1])
    return (flat.T @ flat)[None]


def component_weights(scale: Tensor, fisher: bool) -> Tensor:
    r"""The weights of the components for the output scale :math:`s`: :math:`s` (GGN), :math:`s s^\top` (EF)."""
    return (scale[:, None] * scale[None, :]).reshape(-1) if fisher else scale


class _LogDetPD(torch.autograd.Function):
    r""":math:`\log|A|` of a positive definite :math:`A` by a Cholesky factor :math:`L`; the backward pass is
    :math:`\bar a A^{-1}` from ``cholesky_inverse(L)`` (several times cheaper than differentiating through
    the factorization)."""

    @staticmethod
    def forward(ctx, matrix: Tensor) -> Tensor:
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) != 0:
            raise NotPSDError(
                f"the matrix of size {matrix.shape[-1]} is not positive definite (leading minor {int(info)})"
            )
        ctx.save_for_backward(factor)
        return 2 * factor.diagonal().log().sum()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (factor,) = ctx.saved_tensors
        return grad * torch.cholesky_inverse(factor)


class _FunctionSpaceLogDet(torch.autograd.Function):
    r""":math:`\log|I + W^{1/2} (\sum_g a_g K_g) W^{1/2}|` for fixed Grams :math:`K_g`, differentiable w.r.t.
    :math:`a = 1/\delta` and the row weights :math:`w`, fused: one Cholesky factor forward; backward
    :math:`B^{-1}` from it and :math:`\partial/\partial a_g = \langle B^{-1} \circ \sqrt w \sqrt w^\top,
    K_g\rangle`, :math:`\partial/\partial w_i = (1 - [B^{-1}]_{ii}) / w_i` (since :math:`B^{-1} B = I`)."""

    @staticmethod
    def forward(ctx, inv_delta: Tensor, weights: Tensor, grams: Tensor) -> Tensor:
        root = weights.sqrt()
        matrix = torch.tensordot(inv_delta, grams, dims=1)
        matrix.mul_(root[:, None]).mul_(root[None, :]).diagonal().add_(1)
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) != 0:
            raise NotPSDError(
                f"the matrix of size {matrix.shape[-1]} is not positive definite (leading minor {int(info)})"
            )
        ctx.save_for_backward(factor, weights, grams)
        return 2 * factor.diagonal().log().sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        factor, weights, grams = ctx.saved_tensors
        inverse = torch.cholesky_inverse(factor)
        grad_weights = grad * (1 - inverse.diagonal()) / weights if ctx.needs_input_grad[1] else None
        grad_inv_delta = None
        if ctx.needs_input_grad[0]:
            root = weights.sqrt()
            inverse.mul_(root[:, None]).mul_(root[None, :])
            grad_inv_delta = grad * torch.tensordot(grams, inverse, dims=([1, 2], [0, 1]))
        return grad_inv_delta, grad_weights, None


def _cholesky_log_det(matrix: Tensor) -> Tensor:
    """``log|matrix|`` of a positive definite matrix by a Cholesky factor; :class:`NotPSDError` if it fails."""
    return _LogDetPD.apply(matrix)


class FullCurvature(Curvature):
    r"""The dense weight-space :math:`H = \sum_k w_k(s) D_k` (``(P, P)``), exact: :math:`\log|H + P_0|` by a
    Cholesky factorization, or spectrally (module docstring).

    Args:
        groups, theta_sq_norms, f, y, scale_size: as :class:`~ntkgp.laplace.weight_space.Curvature`.
        components: :math:`D_k`, ``(K, P, P)``, columns in the order of ``groups.names``.
        fisher: ``True`` for the empirical Fisher (weights :math:`s_c s_{c'}`), ``False`` for the GGN (:math:`s`).
        spectral: evaluate through one eigendecomposition of :math:`D` (one group and one component only;
            otherwise ignored).
    """

    def __init__(
        self,
        groups: ParameterGroups,
        theta_sq_norms: Tensor,
        f: Tensor,
        y: Tensor,
        scale_size: int,
        components: Tensor,
        fisher: bool,
        spectral: bool = False,
    ) -> None:
        super().__init__(groups, theta_sq_norms, f, y, scale_size)
        self.components = components
        self.fisher = bool(fisher)
        self.structure = "full_ef" if fisher else "full_ggn"
        self.spectral = bool(spectral) and groups.num_groups == 1 and components.shape[0] == 1
        self._eigenvalues: Tensor | None = None

    def dense(self, likelihood: Likelihood) -> Tensor:
        weights = component_weights(self.scale(likelihood), self.fisher)
        return torch.einsum("k,kpq->pq", weights, self.components)

    def eigenvalues(self) -> Tensor:
        """The eigenvalues of the single component :math:`D`, computed once, ``(P,)`` (clamped at 0)."""
        if self._eigenvalues is None:
            self._eigenvalues = torch.linalg.eigvalsh(self.components[0]).clamp_min(0)
        return self._eigenvalues

    def log_det(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\log|H + P_0|`: :math:`O(P)` spectrally, else an :math:`O(P^3)` Cholesky factorization."""
        delta = self.prior_precision_vector(prior_precision)
        if self.spectral:
            weight = component_weights(self.scale(likelihood), self.fisher)[0]
            return (weight * self.eigenvalues() + delta[0]).log().sum()
        matrix = self.dense(likelihood) + torch.diag(delta[self.column_groups])
        return _cholesky_log_det(matrix)


class FunctionSpaceCurvature(Curvature):
    r"""The full GGN / EF through the per-group Grams of its unit rows, :math:`U_g U_g^\top` (``(G, R, R)``).

    :math:`\log|H + P_0| = \sum_g P_g \log\delta_g + \log|I_R + W^{1/2} (\sum_g U_g U_g^\top / \delta_g)
    W^{1/2}|` (module docstring), with the row weights :math:`w_r = s_{k(r)}` (GGN) or :math:`s_0^2` (EF).

    Args:
        groups, theta_sq_norms, f, y, scale_size: as :class:`~ntkgp.laplace.weight_space.Curvature`.
        grams: ``(G, R, R)``.
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
        r""":math:`\log|H + P_0| - \log|P_0|`, the function-space determinant."""
        delta = self.prior_precision_vector(prior_precision)
        if self.spectral:
            s = self.scale(likelihood)[0]
            w = s * s if self.fisher else s
            return torch.log1p(w * self.eigenvalues() / delta[0]).sum()
        return _FunctionSpaceLogDet.apply(delta.reciprocal(), self.row_weights(likelihood), self.grams)

    def log_det(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\log|H + P_0|`: :math:`O(R)` spectrally, else an :math:`O(R^3)` Cholesky factorization."""
        delta = self.prior_precision_vector(prior_precision)
        return (self.group_sizes * delta.log()).sum() + self.log_det_ratio(delta, likelihood)

    def log_marginal_likelihood(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        # the Σ_g P_g log δ_g of log|H + P_0| and of the prior cancel: computed without them
        from ...likelihoods import log_likelihood

        delta = self.prior_precision_vector(prior_precision)
        data_fit = log_likelihood(likelihood, self.f, self.y).sum()
        return data_fit - 0.5 * (delta * self.theta_sq_norms).sum() - 0.5 * self.log_det_ratio(delta, likelihood)


def _fisher(curvature: str) -> bool:
    return choose(CurvatureKind, curvature, "curvature") is CurvatureKind.EF


def full_curvature(
    net: nn.Module,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    curvature: str = "ggn",
    prior_structure: GroupSpec = "layer",
    batch_size: int = 64,
    progress: bool = False,
    input_shape: tuple[int, ...] | None = None,
    distributed: bool = False,
    spectral: bool = False,
) -> FullCurvature:
    r"""The weight-space full GGN (``curvature="ggn"``) or EF (``"ef"``): one pass over (this rank's shard
    of) the data, per-example rows :math:`J_n^\top u_{nm}` summed as the components :math:`D_k`; with
    ``distributed``, summed over the ranks too.

    Args:
        curvature: ``"ggn"`` (:math:`u_n` the columns of :math:`\tilde L_n`) or ``"ef"`` (:math:`u_n = \tilde g_n`,
            one column per output for Gaussian likelihoods).
        spectral: see :class:`FullCurvature`.
        Others: as :func:`~ntkgp.laplace.compute_curvature`.
    """
    fisher = _fisher(curvature)
    data = DataPass.start(net, likelihood, prior_structure, input_shape, distributed)
    names = list(data.core.groups.names)
    per_output = data.scale0.shape[0] > 1
    total = 0
    for xb, fb, yb in data.batches(x, y, batch_size, progress, "full " + ("EF" if fisher else "GGN")):
        if fisher:
            g = data.unit_gradient(fb, yb)
            cot = torch.diag_embed(g) if per_output else g.unsqueeze(-1)
        else:
            cot = data.unit_hessian_sqrt(fb, yb)
        rows = data.per_example_vjps(xb, cot, names)  # (n, M, P)
        total = total + curvature_components(rows, fisher, per_output)
    data.reduce([total])
    f_all, y_all = data.collected()
    return FullCurvature(data.core.groups, data.theta_sq_norms(), f_all, y_all, data.scale0.shape[0], total,
                         fisher, spectral)


def full_ggn(net: nn.Module, x: Data, y: Tensor | None, likelihood: Likelihood, **kwargs) -> FullCurvature:
    """The weight-space full GGN, :func:`full_curvature` with ``curvature="ggn"``."""
    return full_curvature(net, x, y, likelihood, "ggn", **kwargs)


def full_ef(net: nn.Module, x: Data, y: Tensor | None, likelihood: Likelihood, **kwargs) -> FullCurvature:
    """The weight-space full empirical Fisher, :func:`full_curvature` with ``curvature="ef"``."""
    return full_curvature(net, x, y, likelihood, "ef", **kwargs)


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
) -> FunctionSpaceCurvature:
    r"""The full GGN / EF in function space: the per-group NTK Grams :math:`J_g J_g^\top` (``(G, NC, NC)``)
    contracted with the unit factors into the Grams of the unit rows (module docstring).

    Args:
        x: training inputs ``(N, ...)`` (a tensor: the Grams couple every pair of points).
        y: training targets.
        curvature: ``"ggn"`` or ``"ef"`` (the EF needs a single output scale: not a multi-output Gaussian).
        engine: an :class:`~ntkgp.ntk.NTKEngine` of ``net`` (with ``prior_structure``) to reuse: its
            structured plan and input checks are cached; by default a new one.
        validated: ``x`` is already prepared by the engine and ``y`` normalized by
            :func:`~ntkgp.likelihoods.validate_targets` (skips the per-call checks; for a training loop).
        Others: as :func:`full_curvature`.
    """
    fisher = _fisher(curvature)
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
    n, c = fb.shape
    grams = engine.group_grams(xb)  # (G, NC, NC), rows n·C + c
    if fisher:
        u = data.unit_gradient(fb, yb)  # (N, C): row n is Σ_c u_nc J_nc
        if c == 1:
            grams = grams * (u[:, 0][None, :, None] * u[:, 0][None, None, :])
        else:
            grams = torch.einsum("na,gnamb,mb->gnm", u, grams.reshape(-1, n, c, n, c), u)
        row_scale = torch.zeros(n, dtype=torch.long, device=fb.device)
    else:
        if data.scale0.shape[0] > 1 or c == 1:  # Gaussian: unit root I
            row_scale = torch.arange(n * c, device=fb.device) % data.scale0.shape[0]
            if data.scale0.shape[0] == 1 and c == 1:
                root = data.unit_hessian_sqrt(fb, yb)[:, 0, 0]  # (N,), 1 for a Gaussian likelihood
                if not bool((root == 1).all()):
                    grams = grams * (root[None, :, None] * root[None, None, :])
        else:
            root = data.unit_hessian_sqrt(fb, yb)  # (N, C, M)
            grams = torch.einsum("ncm,gncod,odk->gnmok", root, grams.reshape(-1, n, c, n, c), root)
            grams = grams.reshape(-1, n * c, n * c)
            row_scale = torch.zeros(n * c, dtype=torch.long, device=fb.device)
    f_all, y_all = data.collected()
    return FunctionSpaceCurvature(data.core.groups, data.theta_sq_norms(), f_all, y_all, data.scale0.shape[0],
                                  grams, row_scale, fisher, spectral)


def exact_curvature(
    net: nn.Module,
    x: Tensor,
    y: Tensor,
    likelihood: Likelihood,
    curvature: str = "ggn",
    prior_structure: GroupSpec = "layer",
    batch_size: int = 64,
    input_shape: tuple[int, ...] | None = None,
    spectral: bool = False,
    space: str = "auto",
    engine=None,
    validated: bool = False,
) -> FullCurvature | FunctionSpaceCurvature:
    r"""The exact full GGN / EF in the cheaper space: function space when its side :math:`R` (``N·C`` for the
    GGN, ``N`` for the EF) is at most :math:`P`, weight space otherwise (``space="auto"``, by
    :func:`~ntkgp.options.choose_space`), or as ``space="weight"`` / ``"function"`` says. The multi-output Gaussian EF is weight space only.

    Cost of the build: :math:`O(R^2 P)` or :math:`O(R P^2)`; of each evaluation :math:`O(R^3)` or
    :math:`O(P^3)`, :math:`O(\min(R, P))` with ``spectral`` (one group, one output scale).
    """
    space = choose(Space, space, "space")
    fisher = _fisher(curvature)
    if space is Space.AUTO:
        from ...likelihoods import is_gaussian, num_outputs

        c = num_outputs(likelihood)
        num_params = sum(p.numel() for p in net.parameters() if p.requires_grad)
        space = choose_space(space, num_params, int(x.shape[0]) * (1 if fisher else c))
        if fisher and is_gaussian(likelihood) and c > 1:  # the multi-output Gaussian EF is weight space only
            space = Space.WEIGHT
    if space is Space.FUNCTION:
        return function_space_curvature(net, x, y, likelihood, curvature, prior_structure, input_shape, spectral,
                                        engine, validated)
    return full_curvature(net, x, y, likelihood, curvature, prior_structure, batch_size, False, input_shape,
                          spectral=spectral)
