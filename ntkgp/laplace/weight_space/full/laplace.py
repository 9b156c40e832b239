r"""Full Laplace: a dense ``(P, P)`` GGN or empirical Fisher and its Cholesky factor (small :math:`P`).

.. math::
    \Sigma^{-1} = H(s) + P_0 = L L^\top, \qquad \Sigma v = L^{-\top} L^{-1} v, \qquad
    \eta = L^{-\top} z \sim N(0, \Sigma), \qquad \log|\Sigma^{-1}| = 2 \sum_p \log L_{pp},

and the GLM covariance :math:`J \Sigma J^\top = (L^{-1} J^\top)^\top (L^{-1} J^\top)` with the root
:math:`R = (L^{-1} J^\top)^\top`. The Cholesky factor is computed once per value of :math:`(\delta, s)`:
:math:`O(P^3)`; every test point then costs one Jacobian and a triangular solve, :math:`O(C P^2)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from gpytorch.likelihoods import Likelihood
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor, nn

from ....option_groups import accepts_flat_keywords
from ....options import CurvatureKind, OptionAttribute, choice
from ...ggn.curvature import Curvature as CurvatureData
from ...ggn.data_pass import Data
from ...ggn.full_curvature import FullCurvature, component_weights, full_curvature
from ...ggn.scaling import scale_size
from ....ntk.network import NetworkCore
from ..posterior.pass_options import PassOptions
from ..posterior.weight_posterior import WeightPosterior, check_before_pass, check_likelihood, group_spec


class DensePosterior(WeightPosterior):
    r"""A posterior with a dense precision :math:`\sum_k w_k(s) \tilde H_k + P_0` (module docstring).

    Args:
        function: the network function over :math:`\theta`.
        likelihood: the likelihood.
        groups: prior-precision groups of :math:`\theta`.
        prior_precision: :math:`\delta` (float or ``(G,)``).
        components: the curvature components ``(K, P, P)``
            (:func:`~ntkgp.laplace.ggn.full_curvature.dense_components`).
        curvature: ``"ggn"`` or ``"ef"`` (how the components are weighted by :math:`s`; fixed after
            construction).
    """

    curvature = OptionAttribute(choice(CurvatureKind), fixed="the curvature matrix was computed for it")

    def __init__(
        self,
        function: NetworkCore,
        likelihood: Likelihood,
        groups,
        prior_precision: float | Tensor,
        components: Tensor,
        curvature: CurvatureKind | str,
    ) -> None:
        super().__init__(function, likelihood, groups, prior_precision, scale_size(likelihood))
        self.curvature = curvature
        self.structure = self._structure_name()
        self.components = components

    #: the :class:`~ntkgp.laplace.weight_space.Curvature` the components belong to (its evidence), or ``None``
    #: where the posterior was built from the components alone
    evidence_curvature: CurvatureData | None = None

    def _log_marginal_likelihood(self, prior_precision: Tensor) -> Tensor:
        if self.evidence_curvature is None:
            return super()._log_marginal_likelihood(prior_precision)
        return self.evidence_curvature.log_marginal_likelihood(prior_precision, self.likelihood)

    def _structure_name(self) -> str:
        return f"full_{self.curvature.value}"

    def curvature_matrix(self) -> Tensor:
        r""":math:`H(s)` for the likelihood's current noise or temperature, ``(P, P)``."""
        weights = component_weights(self.scale(), self.curvature is CurvatureKind.EF)
        return torch.einsum("k,kpq->pq", weights, self.components)

    def dense_precision(self) -> Tensor:
        return self.curvature_matrix() + torch.diag(self.prior_precision_columns())

    def cholesky(self) -> Tensor:
        r"""The lower Cholesky factor :math:`L` of :math:`H(s) + P_0` (jitter only if it fails, warned)."""
        return self.cached("cholesky", lambda: psd_safe_cholesky(self.dense_precision()))

    def _precision_matmul(self, v: Tensor) -> Tensor:
        return self.dense_precision() @ v

    def _covariance_matmul(self, v: Tensor) -> Tensor:
        return torch.cholesky_solve(v, self.cholesky())

    def _sample(self, z: Tensor) -> Tensor:
        return torch.linalg.solve_triangular(self.cholesky().T, z.T, upper=True).T

    def log_det_precision(self) -> Tensor:
        return 2 * self.cholesky().diagonal().log().sum()

    def jacobian(self, x: Tensor) -> Tensor:
        """Per-example Jacobians of a prepared chunk, ``(n, C, P)``."""
        return self.function.jacobian(x)

    def _glm_root(self, x: Tensor) -> Tensor:
        jac = self.jacobian(x)
        n, c, p = jac.shape
        solved = torch.linalg.solve_triangular(self.cholesky(), jac.reshape(n * c, p).T, upper=False)
        return solved.T.reshape(n, c, p)

    def _glm_covariance(self, x: Tensor) -> Tensor:
        root = self._glm_root(x)
        return root @ root.mT


class FullLaplace(DensePosterior):
    r"""The full Laplace posterior :math:`N(\theta^*, (H + P_0)^{-1})` with the dense GGN or empirical Fisher.

    .. math::
        H_{\mathrm{GGN}} = \sum_n J_n^\top \Lambda_n J_n, \qquad
        H_{\mathrm{EF}} = \sum_n J_n^\top g_n g_n^\top J_n.

    Exact (no structural approximation of :math:`H`) and therefore the reference of every other structure, for
    networks small enough for a ``(P, P)`` matrix: memory :math:`O(P^2)`, one :math:`O(P^3)` Cholesky per
    value of :math:`(\delta, s)`; its GLM predictive equals the function-space one of :class:`~ntkgp.NTKGP`.

    Args:
        net: the trained network ``(N, *input_shape) -> (N, C)``, BatchNorm/dropout in eval mode; never
            modified.
        x: training inputs ``(N, ...)``, or an iterable of ``(x_b, y_b)`` batches (e.g. a ``DataLoader``)
            with ``y=None``.
        y: training targets.
        likelihood: a supported likelihood; its noise or temperature at each later call sets :math:`s`.
        curvature: ``"ggn"`` (default) or ``"ef"``.
        prior_precision: :math:`\delta`, a float or one per group.
        prior_structure: ``"layer"`` (default), ``"network"``, ``"parameter"`` or a mapping name → group.
        options: how the passes run, a :class:`~ntkgp.laplace.weight_space.PassOptions` (``batch_size`` of the
            curvature pass, ``chunk_size`` at prediction time, ``progress``; ``None``: its defaults). Its fields as
            flat keywords (``batch_size=128``) still work, with a ``FutureWarning``, for one release.
        input_shape: the shape of one input, for flat ``(N, D)`` inputs.

    Example:
        >>> posterior = FullLaplace(net, x, y, likelihood, prior_precision=1.0)
        >>> eta = posterior.sample(100)                    # (100, P) draws of θ − θ*
        >>> blocks = posterior.glm_covariance(x_test)      # (N, C, C)
    """

    curvature_classes: ClassVar[Mapping[str, type[CurvatureData]]] = {
        "full_ggn": FullCurvature, "full_ef": FullCurvature}

    @accepts_flat_keywords(options=PassOptions)
    def __init__(
        self,
        net: nn.Module,
        x: Data,
        y: Tensor | None,
        likelihood: Likelihood,
        curvature: str = "ggn",
        prior_precision: float | Tensor = 1.0,
        prior_structure: str | Mapping[str, str] = "layer",
        options: PassOptions | None = None,
        input_shape: tuple[int, ...] | None = None,
    ) -> None:
        batch_size, chunk_size, progress = self._pass_settings(options)
        kind = choice(CurvatureKind)(curvature, "curvature")
        check_before_pass(net, likelihood, prior_precision, prior_structure, input_shape, chunk_size)
        fitted = full_curvature(net, x, y, likelihood, kind.value, group_spec(prior_structure), batch_size, progress,
                                input_shape)
        self._setup(fitted, net, likelihood, prior_precision, input_shape, chunk_size)

    @classmethod
    def from_curvature(
        cls,
        curvature: CurvatureData,
        net: nn.Module,
        likelihood: Likelihood,
        prior_precision: float | Tensor = 1.0,
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 256,
    ) -> FullLaplace:
        """The posterior of a full curvature already computed (``compute_curvature(..., structure="full_ggn")``
        or ``"full_ef"`` at the network's current weights), without another pass over the data.

        Raises:
            TypeError: when ``curvature`` is not a weight-space :class:`~ntkgp.laplace.weight_space.FullCurvature`.
        """
        check_likelihood(likelihood)
        self = cls.__new__(cls)
        self._setup(curvature, net, likelihood, prior_precision, input_shape, chunk_size)
        return self

    def _setup(self, curvature, net, likelihood, prior_precision, input_shape, chunk_size) -> None:
        if not isinstance(curvature, FullCurvature):
            raise TypeError(
                f"curvature must be a weight-space FullCurvature (full_ggn or full_ef), got {type(curvature).__name__}"
            )
        fn = NetworkCore(net, list(curvature.groups.names), input_shape, chunk_size)
        kind = CurvatureKind.EF if curvature.fisher else CurvatureKind.GGN
        DensePosterior.__init__(self, fn, likelihood, curvature.groups, prior_precision, curvature.components, kind)
        self.evidence_curvature = curvature
