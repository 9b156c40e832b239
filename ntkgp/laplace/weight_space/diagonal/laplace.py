r"""Diagonal Laplace: :math:`\Sigma = \operatorname{diag}(1 / (H_{pp}(s) + \delta_{g(p)}))` from the diagonal
GGN or EF.

Everything is elementwise: :math:`\Sigma v = v / (h + \delta)`, :math:`\eta = z / \sqrt{h + \delta}`,
:math:`\log|\Sigma^{-1}| = \sum_p \log(h_p + \delta_{g(p)})`. The GLM closed form
:math:`J \Sigma J^\top` uses, for ``Linear``/``Conv2d`` layers, the layer inputs and output gradients at the
test points (:func:`~ntkgp.laplace.weight_space.layers.kronecker_form.kronecker_sandwich` with identity bases): with one
location :math:`[J \Sigma J^\top]_{cc'} = \sum_o \gamma_{co} \gamma_{c'o} \sum_i \bar a_i^2 \Sigma_{oi}`,
never the Jacobian; other parameters take per-example Jacobians.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ....ntk.network import NetworkCore
from ....option_groups import accepts_flat_keywords
from ....options import CurvatureKind, OptionAttribute, choice
from ...ggn.curvature import Curvature
from ...ggn.data_pass import Data
from ...ggn.sampled_ggn import check_no_samples_for_fisher
from .curvature import DiagonalCurvature, DiagonalEF, DiagonalGGN, diagonal_ef, diagonal_ggn
from ..layers.kronecker_form import (
    kronecker_features,
    kronecker_root,
    kronecker_sandwich,
    layer_index,
)
from ..layers.curvature_layers import usable_layers
from ..posterior.pass_options import PassOptions
from ..posterior.weight_posterior import WeightPosterior, check_before_pass, check_likelihood, group_spec


class DiagLaplace(WeightPosterior):
    r"""The diagonal Laplace posterior (module docstring).

    Args:
        net: the trained network, BatchNorm/dropout in eval mode; never modified.
        x: training inputs ``(N, ...)``, or an iterable of ``(x_b, y_b)`` batches with ``y=None``.
        y: training targets.
        likelihood: a supported likelihood; its noise or temperature at each later call sets :math:`s`.
        curvature: ``"ggn"`` (default: the diagonal of the GGN) or ``"ef"`` (of the empirical Fisher).
        prior_precision: :math:`\delta`, a float or one per group.
        prior_structure: ``"layer"`` (default), ``"network"``, ``"parameter"`` or a mapping name → group.
        options: how the passes run, a :class:`~ntkgp.laplace.weight_space.PassOptions` (``batch_size`` of the
            curvature pass, ``chunk_size`` at prediction time, ``progress``; ``None``: its defaults). Its fields as
            flat keywords (``batch_size=128``) still work, with a ``FutureWarning``, for one release.
        mc_samples: ``None`` (the exact GGN) or :math:`S` sampled roots of a softmax likelihood's Hessian per
            example (:mod:`~ntkgp.laplace.ggn.sampled_ggn`; GGN only).
        generator: the samples' ``torch.Generator`` (``None``: torch's global one).
        input_shape: the shape of one input, for flat inputs.

    ``curvature`` (``"ggn"`` or ``"ef"``) is fixed after construction; the diagonal it names is
    :attr:`diagonal_curvature`.

    Example:
        >>> posterior = DiagLaplace(net, x, y, likelihood, curvature="ef", prior_structure="parameter")
        >>> posterior.prior_precision = torch.full((posterior.groups.num_groups,), 3.0)
        >>> variances = posterior.glm_covariance(x_test).diagonal(dim1=-2, dim2=-1)
    """

    curvature = OptionAttribute(choice(CurvatureKind), fixed="the diagonal was computed for it")
    curvature_classes: ClassVar[Mapping[str, type[Curvature]]] = {
        "diag_ggn": DiagonalGGN, "diag_ef": DiagonalEF}

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
        mc_samples: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        batch_size, chunk_size, progress = self._pass_settings(options)
        kind = choice(CurvatureKind)(curvature, "curvature")
        check_no_samples_for_fisher(kind is not CurvatureKind.GGN, mc_samples)
        check_before_pass(net, likelihood, prior_precision, prior_structure, input_shape, chunk_size)
        sampled = {} if mc_samples is None else {"mc_samples": mc_samples, "generator": generator}
        computed = (diagonal_ggn if kind is CurvatureKind.GGN else diagonal_ef)(
            net, x, y, likelihood, group_spec(prior_structure), batch_size, progress, input_shape, **sampled)
        self._setup(computed, net, likelihood, prior_precision, input_shape, chunk_size)

    @classmethod
    def from_curvature(
        cls,
        curvature: Curvature,
        net: nn.Module,
        likelihood: Likelihood,
        prior_precision: float | Tensor = 1.0,
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 256,
    ) -> DiagLaplace:
        """The posterior of a diagonal curvature already computed (``structure="diag_ggn"`` or ``"diag_ef"``).

        Raises:
            TypeError: when ``curvature`` is not diagonal.
        """
        check_likelihood(likelihood)
        self = cls.__new__(cls)
        self._setup(curvature, net, likelihood, prior_precision, input_shape, chunk_size)
        return self

    def _setup(self, curvature, net, likelihood, prior_precision, input_shape, chunk_size) -> None:
        if not isinstance(curvature, DiagonalCurvature):
            raise TypeError(
                f"curvature must be diagonal (diag_ggn or diag_ef), got {type(curvature).__name__}"
            )
        fn = NetworkCore(net, list(curvature.groups.names), input_shape, chunk_size)
        super().__init__(fn, likelihood, curvature.groups, prior_precision, curvature.scale_size)
        self.structure = curvature.structure
        self.curvature = "ef" if curvature.structure == "diag_ef" else "ggn"
        self.diagonal_curvature = curvature
        #: the curvature the posterior was built from (its evidence); the same object as ``diagonal_curvature``
        self.evidence_curvature = curvature
        self._layers = None

    def _log_marginal_likelihood(self, prior_precision: Tensor) -> Tensor:
        return self.evidence_curvature.log_marginal_likelihood(prior_precision, self.likelihood)

    def precision_diagonal(self) -> Tensor:
        r""":math:`h(s) + \delta`, ``(P,)``."""
        return self.cached(
            "diagonal",
            lambda: self.diagonal_curvature.diagonal(self.likelihood).detach() + self.prior_precision_columns(),
        )

    def _precision_matmul(self, v: Tensor) -> Tensor:
        return v * self.precision_diagonal()[:, None]

    def _covariance_matmul(self, v: Tensor) -> Tensor:
        return v / self.precision_diagonal()[:, None]

    def _sample(self, z: Tensor) -> Tensor:
        return z * self.precision_diagonal().rsqrt()

    def log_det_precision(self) -> Tensor:
        return self.precision_diagonal().log().sum()

    def dense_precision(self) -> Tensor:
        return torch.diag(self.precision_diagonal())

    def _structured(self, x: Tensor) -> tuple[list, list[str], Tensor]:
        """The verified layers with their flat indices, the other parameters' names and flat indices."""
        if self._layers is None:
            fn = self.function
            layers = usable_layers(fn, None, x, strict=False)
            covered = {n for layer in layers for n in (layer.weight, layer.bias) if n is not None}
            rest = [n for n in fn.names if n not in covered]
            index = [torch.arange(fn.offset(n), fn.offset(n) + fn.numels[fn.names.index(n)]) for n in rest]
            rest_index = torch.cat(index or [torch.zeros(0, dtype=torch.long)]).to(fn.device)
            self._layers = ([(layer, layer_index(fn, layer)) for layer in layers], rest, rest_index)
        return self._layers

    def _glm_covariance(self, x: Tensor) -> Tensor:
        layers, rest, rest_index = self._structured(x)
        variance = self.precision_diagonal().reciprocal()
        features = kronecker_features(self.function, x, [layer for layer, _ in layers]) if layers else {}
        out = 0
        for layer, index in layers:
            out = out + kronecker_sandwich(*features[layer.name], variance[index])
        if rest:
            jac = self.function.jacobian(x, rest)
            out = out + (jac * variance[rest_index]) @ jac.mT
        return out

    def _glm_root(self, x: Tensor) -> Tensor:
        layers, rest, rest_index = self._structured(x)
        variance = self.precision_diagonal().reciprocal()
        features = kronecker_features(self.function, x, [layer for layer, _ in layers]) if layers else {}
        roots = [kronecker_root(*features[layer.name], variance[index]) for layer, index in layers]
        if rest:
            roots.append(self.function.jacobian(x, rest) * variance[rest_index].sqrt())
        return torch.cat(roots, dim=-1)
