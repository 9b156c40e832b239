r"""The full (dense) GGN and empirical Fisher in weight space, and the choice of space for the exact evidence.

.. math::
    H_{\mathrm{GGN}}(s) = \sum_n J_n^\top \Lambda_n J_n = \sum_k s_k D_k, \qquad
    H_{\mathrm{EF}}(s) = \sum_n J_n^\top g_n g_n^\top J_n = \sum_{k, k'} s_k s_{k'} D_{kk'},

stored as components computed once with the unit factors of the likelihood (``docs/math.md``, "Laplace-GGN
evidence"; :mod:`ntkgp.laplace.ggn.scaling`): for a Gaussian likelihood with ``C`` outputs one component per
output, :math:`D_c = \sum_n J_{nc}^\top J_{nc}` (per pair of outputs for the EF, with
:math:`\tilde g_n = g_n / s`); otherwise (a tempered classification likelihood) one component with
:math:`\tilde\Lambda_n = \Lambda_n / s_0`, :math:`\tilde g_n = g_n / s_0`. A new noise or temperature
re-weights the components without another pass over the data: **the curvature is built once per**
:math:`\theta^*` and every later evaluation of :math:`\log|H + P_0|` for new :math:`(\delta, s)` costs one
``P × P`` Cholesky factorization of :math:`P_0^{-1/2}(H + P_0)P_0^{-1/2}`
(:func:`~ntkgp.laplace.ggn.exact_log_det.scaled_log_det`), :math:`O(P^3)`, exact and differentiable in
every :math:`\delta_g` and in :math:`s`. Memory: the ``K`` components, :math:`K P^2` numbers (:math:`K = 1`
for classification and one Gaussian output, :math:`C` per-output Gaussian, :math:`C^2` for its EF), plus
:math:`3 P^2` while an evaluation and its gradient run.

The same :math:`\log|H + P_0|` has a function-space representation through the Grams of the unit rows
(:class:`~ntkgp.laplace.weight_space.FunctionSpaceCurvature`, :math:`O(R^3)` per evaluation, :math:`R = NC` for
the GGN, :math:`N` for the EF); :func:`exact_curvature` builds the one with the smaller side. Sums over the data:
the weight-space build splits over the ranks of a ``torch.distributed`` group (``distributed=True``).

With a **single prior precision** (one group) and a single output scale, both have a spectral form: one
eigendecomposition per :math:`\theta^*`, then every evaluation is :math:`O(\min(R, P))`
(:math:`\log|H + P_0| = \sum_i \log(w \lambda_i + \delta)`). Pass ``spectral=True`` (or let
:func:`~ntkgp.training.train_marglik` decide).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ...likelihoods import num_outputs
from ...linalg import add_lower_gram_, gram, mirror_lower
from ...ntk import ParameterGroups
from ...ntk.groups import GroupSpec
from ...options import CurvatureKind, Space, choose
from ...progress import check_progress
from .curvature import Curvature
from .data_pass import Data, DataPass
from .exact_log_det import scaled_log_det, spectral_log_det_ratio
from .gram_curvature import FunctionSpaceCurvature, function_space_curvature
from .layer_ggn import blocks_of_root
from .low_rank_groups import GroupSchur, low_rank_cheaper
from .sampled_ggn import check_no_samples_for_fisher
from .scaling import unit_gradient, unit_hessian_sqrt
from .space import exact_space, has_function_form, site_columns

DECOMPOSE_AFTER = 1  # evaluations per network state by the Cholesky route before the low-rank decomposition

__all__ = [
    "FullCurvature",
    "curvature_components",
    "dense_components",
    "exact_curvature",
    "full_curvature",
    "full_ef",
    "full_ggn",
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
        return gram(rows.transpose(0, 1))
    return gram(rows.reshape(-1, rows.shape[-1]))[None]


class ComponentSum:
    r"""The sum of :func:`curvature_components` over chunks of rows, without a ``(K, P, P)`` temporary per chunk:
    the lower triangles of the Grams accumulate in place (:func:`~ntkgp.linalg.add_lower_gram_`) and are mirrored
    once by :meth:`total` (the per-output EF, an ``einsum``, is added as a whole)."""

    def __init__(self, fisher: bool, per_output: bool) -> None:
        self.fisher, self.per_output = bool(fisher), bool(per_output)
        self._sum: Tensor | None = None

    def add(self, rows: Tensor) -> None:
        """Add the components of the rows ``(n, M, P)`` (as :func:`curvature_components`)."""
        if self.fisher and self.per_output:
            part = curvature_components(rows, True, True)
            self._sum = part if self._sum is None else self._sum.add_(part)
            return
        a = rows.transpose(0, 1) if self.per_output else rows.reshape(1, -1, rows.shape[-1])
        if self._sum is None:
            self._sum = a.new_zeros(a.shape[0], a.shape[-1], a.shape[-1])
        add_lower_gram_(self._sum, a)

    def add_sum(self, component: Tensor) -> None:
        """Add one component's sum ``(P, P)``, exactly symmetric, formed otherwise (the layer blocks of
        :func:`~ntkgp.laplace.ggn.layer_ggn.blocks_of_root`; one component only): its lower triangle
        joins the Grams' and :meth:`total` mirrors it with them."""
        if self.per_output:
            raise ValueError("a component's sum is one (P, P) matrix: not for per-output components")
        if self._sum is None:
            self._sum = component.new_zeros(1, *component.shape)
        self._sum[0].add_(component)

    def total(self) -> Tensor:
        """The components ``(K, P, P)``, exactly symmetric."""
        if self._sum is None:
            raise ValueError("no rows were added (empty data)")
        return self._sum if self.fisher and self.per_output else mirror_lower(self._sum)


def jacobian_rows(
    jacobian: Tensor, likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor, fisher: bool
) -> Tensor:
    r"""The rows of :func:`curvature_components` from per-example Jacobians ``(n, C, P)`` and the unit factors
    at the output scale ``scale0`` (:mod:`~ntkgp.laplace.ggn.scaling`), ``(n, M, P)``."""
    per_output = scale0.shape[0] > 1
    if fisher:
        unit = unit_gradient(likelihood, f, y, scale0)  # (n, C)
        if per_output:
            return jacobian * unit.unsqueeze(-1)
        return torch.einsum("nc,ncp->np", unit, jacobian).unsqueeze(1)
    if per_output:  # Gaussian: the unit root is I
        return jacobian
    return torch.einsum("ncp,ncm->nmp", jacobian, unit_hessian_sqrt(likelihood, f, y, scale0))


def component_weights(scale: Tensor, fisher: bool) -> Tensor:
    r"""The weights of the components for the output scale :math:`s`: :math:`s` (GGN), :math:`s s^\top` (EF)."""
    return (scale[:, None] * scale[None, :]).reshape(-1) if fisher else scale


class FullCurvature(Curvature):
    r"""The dense weight-space :math:`H = \sum_k w_k(s) D_k` (``(P, P)``), exact: :math:`\log|H + P_0|` by a
    Cholesky factorization of :math:`P_0^{-1/2}(H + P_0)P_0^{-1/2}`, or spectrally (module docstring).

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
        self._schur: GroupSchur | None = None
        self._evaluations = 0
        self.low_rank = (not self.spectral and components.shape[0] == 1 and groups.num_groups > 1
                         and low_rank_cheaper(self.group_sizes))

    @classmethod
    def from_jacobian(
        cls,
        groups: ParameterGroups,
        theta_sq_norms: Tensor,
        jacobian: Tensor,
        likelihood: Likelihood,
        f: Tensor,
        y: Tensor,
        scale0: Tensor,
        fisher: bool,
        chunk_size: int = 256,
    ) -> FullCurvature:
        r"""The curvature from the Jacobian of the training outputs, ``(N·C, P)`` (rows ``n·C + c``, columns in
        the order of ``groups.names``: the NTK kernel's), summed in chunks of ``chunk_size`` examples (the rows
        of a chunk are the only temporary, :math:`O(\text{chunk} \cdot C P)`).

        Args:
            groups, theta_sq_norms: as the constructor's.
            jacobian: :math:`J`, ``(N·C, P)``.
            likelihood: the likelihood; ``scale0`` its output scale :math:`s_0` (detached) for the unit factors.
            f, y: outputs ``(N, C)`` and normalized targets.
            fisher: the EF instead of the GGN.
            chunk_size: examples per chunk.
        """
        n, c = f.shape
        jac = jacobian.reshape(n, c, -1)
        total = ComponentSum(fisher, scale0.shape[0] > 1)
        for start in range(0, n, chunk_size):
            part = slice(start, start + chunk_size)
            total.add(jacobian_rows(jac[part], likelihood, f[part], y[part], scale0, fisher))
        return cls(groups, theta_sq_norms, f, y, scale0.shape[0], total.total(), fisher)

    def _state_fields(self) -> dict:
        return {"components": self.components}

    @classmethod
    def _from_state(cls, common: tuple, state: Mapping) -> FullCurvature:
        return cls(*common, state["components"], fisher=state["structure"] == "full_ef")

    def dense(self, likelihood: Likelihood) -> Tensor:
        weights = component_weights(self.scale(likelihood), self.fisher)
        return torch.einsum("k,kpq->pq", weights, self.components)

    def eigenvalues(self) -> Tensor:
        """The eigenvalues of the single component :math:`D`, computed once, ``(P,)`` (clamped at 0)."""
        if self._eigenvalues is None:
            self._eigenvalues = torch.linalg.eigvalsh(self.components[0]).clamp_min(0)
        return self._eigenvalues

    def log_det_ratio(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\log|H + P_0| - \log|P_0| = \log|I + P_0^{-1/2} H P_0^{-1/2}|`: :math:`O(P)` spectrally, else
        one :math:`O(P^3)` Cholesky factorization."""
        delta = self.prior_precision_vector(prior_precision)
        weights = component_weights(self.scale(likelihood), self.fisher)
        if self.spectral:
            return spectral_log_det_ratio(self.eigenvalues(), weights[0] / delta[0])
        schur = self.group_schur()
        value = None if schur is None else schur.log_det_ratio(weights, delta)
        if value is None:  # the first evaluation, another structure, or C̃ not factorized: the Cholesky route
            value = scaled_log_det(weights, delta[self.column_groups].rsqrt(), self.components)
        return value

    def group_schur(self) -> GroupSchur | None:
        r"""The fixed data of the low-rank route (:mod:`~ntkgp.laplace.ggn.low_rank_groups`), decomposed
        at evaluation ``DECOMPOSE_AFTER + 1`` (a single evaluation is one Cholesky factorization, several times
        cheaper than the decomposition), or ``None`` before, or where the route does not apply or does not pay
        (:attr:`low_rank`: one component, several groups, :func:`low_rank_cheaper`)."""
        if not self.low_rank:
            return None
        self._evaluations += 1
        if self._schur is None and self._evaluations > DECOMPOSE_AFTER:
            self._schur = GroupSchur(self.components[0], self.column_groups, self.group_sizes)
        return self._schur

    def whitened_precision(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`P_0^{-1/2}(H + P_0)P_0^{-1/2} = I + D_r (\sum_k w_k D_k) D_r`, :math:`r = \delta^{-1/2}` per
        column, ``(P, P)``: the matrix :meth:`log_det_ratio` factorizes (the weight-space site posterior's
        :math:`I + W^\top W`), differentiable in :math:`\delta` and the output scale. :math:`O(K P^2)`."""
        delta = self.prior_precision_vector(prior_precision)
        weights = component_weights(self.scale(likelihood), self.fisher)
        root = delta[self.column_groups].rsqrt()
        matrix = torch.tensordot(weights, self.components, dims=1) * root[:, None] * root
        return matrix + torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)

    def log_det(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\log|H + P_0|`: :math:`O(P)` spectrally, else an :math:`O(P^3)` Cholesky factorization."""
        delta = self.prior_precision_vector(prior_precision)
        return (self.group_sizes * delta.log()).sum() + self.log_det_ratio(delta, likelihood)


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
    progress: bool | None = None,
    input_shape: tuple[int, ...] | None = None,
    distributed: bool = False,
    spectral: bool = False,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> FullCurvature:
    r"""The weight-space full GGN (``curvature="ggn"``) or EF (``"ef"``): one pass over (this rank's shard
    of) the data, per-example rows :math:`J_n^\top u_{nm}` summed as the components :math:`D_k`; with
    ``distributed``, summed over the ranks too.

    Args:
        curvature: ``"ggn"`` (:math:`u_n` the columns of :math:`\tilde L_n`) or ``"ef"`` (:math:`u_n = \tilde g_n`,
            one column per output for Gaussian likelihoods).
        spectral: see :class:`FullCurvature`.
        mc_samples: with ``"ggn"``, :math:`S` sampled roots per example instead of the exact ones
            (:mod:`~ntkgp.laplace.ggn.sampled_ggn`).
        Others: as :func:`~ntkgp.laplace.compute_curvature`.
    """
    fisher = _fisher(curvature)
    check_no_samples_for_fisher(fisher, mc_samples)
    data = DataPass.start(net, likelihood, prior_structure, input_shape, distributed, mc_samples, generator)
    total = dense_components(data, x, y, fisher, batch_size, progress, "full " + ("EF" if fisher else "GGN"))
    data.reduce([total])
    f_all, y_all = data.collected()
    return FullCurvature(data.core.groups, data.theta_sq_norms(), f_all, y_all, data.scale0.shape[0], total,
                         fisher, spectral)


def dense_components(
    data: DataPass, x: Data, y: Tensor | None, fisher: bool, batch_size: int, progress: bool | None, desc: str,
    layer_blocks: bool = True,
) -> Tensor:
    r"""The components :math:`D_k` ``(K, P, P)`` of the dense GGN or EF over ``data.core``'s parameters (module
    docstring), one pass over (this rank's shard of) the data: the one dense builder of the package.

    Per batch, the rows :math:`J_n^\top u_{nm}` of the unit factors :math:`u_n` (the columns of :math:`\tilde L_n`,
    or :math:`\tilde g_n`) by ``data.core.per_example_vjps``, summed in place (:class:`ComponentSum`); with
    ``layer_blocks``, a GGN of one component takes the layer blocks of ``Linear`` layers from their features instead
    (:func:`~ntkgp.laplace.ggn.layer_ggn.blocks_of_root`, ``C`` times fewer multiply-adds), which needs
    the core's parameters to be whole tensors (not a subnetwork's coordinates). Memory: one batch's rows,
    :math:`O(\text{batch} \cdot C P)`, and the :math:`K P^2` sums. The caller sums over the ranks
    (``data.reduce``)."""
    names = list(data.core.groups.names)
    per_output = data.scale0.shape[0] > 1
    components = ComponentSum(fisher, per_output)
    for xb, fb, yb in data.batches(x, y, batch_size, progress, desc):
        if fisher:
            g = data.unit_gradient(fb, yb)
            cot = torch.diag_embed(g) if per_output else g.unsqueeze(-1)
        else:
            cot = data.unit_hessian_sqrt(fb, yb)
        # Linear layers: the GGN from their features, C times fewer multiply-adds than the rows (layer_ggn)
        blocks = layer_blocks and not (fisher or per_output)
        part = blocks_of_root(data.core, data.core.layer_plan(xb), xb, cot) if blocks else None
        if part is not None:
            components.add_sum(part)
        else:
            components.add(data.per_example_vjps(xb, cot, names))  # rows (n, M, P)
    return components.total()


def full_ggn(net: nn.Module, x: Data, y: Tensor | None, likelihood: Likelihood, **kwargs) -> FullCurvature:
    """The weight-space full GGN, :func:`full_curvature` with ``curvature="ggn"``."""
    return full_curvature(net, x, y, likelihood, "ggn", **kwargs)


def full_ef(net: nn.Module, x: Data, y: Tensor | None, likelihood: Likelihood, **kwargs) -> FullCurvature:
    """The weight-space full empirical Fisher, :func:`full_curvature` with ``curvature="ef"``."""
    return full_curvature(net, x, y, likelihood, "ef", **kwargs)


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
    progress: bool | None = None,
    steps: int | None = None,
) -> FullCurvature | FunctionSpaceCurvature:
    r"""The exact full GGN / EF in the cheaper space (``space="auto"``: :func:`~ntkgp.laplace.ggn.space.exact_space`
    on :math:`P` and the function-space side :math:`R`: ``N·C`` for the GGN, ``N·(C - 1)`` for a softmax GGN,
    ``N`` for the EF; ``steps``: the evaluations this build serves, where they are few), or as
    ``space="weight"`` / ``"function"`` says. The multi-output Gaussian EF is weight space only.

    Cost of the build: :math:`O(R^2 P)` or :math:`O(R P^2)`; of each evaluation :math:`O(R^3)` or
    :math:`O(P^3)`, :math:`O(\min(R, P))` with ``spectral`` (one group, one output scale).
    Arguments as :func:`full_curvature` and
    :func:`~ntkgp.laplace.ggn.gram_curvature.function_space_curvature` (``progress``: over the pass of
    either).
    """
    space = choose(Space, space, "space")
    check_progress(progress)
    if space is Space.AUTO:
        c = num_outputs(likelihood)
        num_params = sum(p.numel() for p in net.parameters() if p.requires_grad)
        rows = int(x.shape[0]) * site_columns(likelihood, c, curvature)  # the function-space side
        space = exact_space(space, num_params, rows, function_form=has_function_form(likelihood, c, curvature),
                            steps=steps)
    if space is Space.FUNCTION:
        return function_space_curvature(net, x, y, likelihood, curvature, prior_structure, input_shape, spectral,
                                        engine, validated, progress)
    return full_curvature(net, x, y, likelihood, curvature, prior_structure, batch_size, progress, input_shape,
                          spectral=spectral)
