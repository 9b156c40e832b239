r"""Last-layer Laplace: a full Laplace posterior over the parameters of one layer, the others fixed at
:math:`\theta^*`, from the layer's features (:mod:`~ntkgp.laplace.weight_space.last_layer.curvature`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ....ntk.features import Layer
from ....option_groups import accepts_flat_keywords
from ....options import CurvatureKind, OptionAttribute, Structure, choice
from ...ggn.curvature import Curvature as CurvatureData
from ...ggn.data_pass import Data
from ..full.laplace import DensePosterior, FullLaplace
from .curvature import fit_last_layer
from .features import feature_layer, head_features, last_layer_names
from ..posterior.pass_options import PassOptions
from ..posterior.weight_posterior import check_before_pass, check_name


class LayerRoute:
    """The feature route of a posterior over one layer: decided by its pass over the data, or, for a posterior
    restored from a curvature (``from_curvature``, ``from_state_dict``), at its first prediction."""

    _route_pending = False

    def head(self, x: Tensor) -> Layer | None:
        """The layer in structured form on the feature route (decided on the prepared ``x`` if not yet), else
        ``None``."""
        if self._route_pending:
            self.feature_layer = feature_layer(self.function, self.layer, x)
            self._route_pending = False
        return self.feature_layer

    def _restored(self):
        """``self`` after ``from_curvature``: the layer from the curvature's parameter names, the route pending.

        Raises:
            ValueError: when the curvature's parameters are not those of one module.
        """
        modules = {n.rpartition(".")[0] for n in self.names}
        if len(modules) != 1:
            raise ValueError(f"curvature must be over one layer's parameters, got {list(self.names)}")
        self.layer = modules.pop()
        self.feature_layer = None
        self._route_pending = True
        return self


class LastLayerLaplace(LayerRoute, FullLaplace):
    r"""The full Laplace posterior over the last layer's weight and bias; all other weights stay at
    :math:`\theta^*`.

    For a last ``nn.Linear`` layer :math:`f = W \phi(x) + b` the Jacobian is
    :math:`J(x) = I_C \otimes [\phi(x)^\top, 1]`: the GGN :math:`H = \sum_n \tilde\Lambda_n \otimes \tilde\phi_n
    \tilde\phi_n^\top` (or the EF) comes from one forward pass over the data, and the GLM predictive from the
    features of the test points (:mod:`~ntkgp.laplace.weight_space.last_layer.curvature`); :math:`P = C (d + 1)`,
    memory :math:`O(K P^2)`, and the dense algebra of :class:`FullLaplace` applies. Another layer (or one whose output
    is not the network's) takes per-example Jacobians. Sampling methods of the predictive perturb only this layer.

    Args:
        net: the trained network (never modified).
        x: training inputs, or an iterable of ``(x_b, y_b)`` batches with ``y=None``.
        y: training targets.
        likelihood: a supported likelihood.
        layer: the module's name in ``net.named_modules()``; default the last module that owns trainable
            parameters.
        curvature: ``"ggn"`` (default) or ``"ef"``.
        prior_precision: :math:`\delta`, a float or one per group.
        prior_structure: ``"layer"`` (default: one :math:`\delta` for the layer), ``"parameter"`` (weight and
            bias separately), ``"network"`` or a mapping name → group.
        options: how the passes run, a :class:`~ntkgp.laplace.weight_space.PassOptions` (``batch_size`` of the
            curvature pass, ``chunk_size`` at prediction time, ``progress``; ``None``: its defaults). Its fields as
            flat keywords (``batch_size=128``) still work, with a ``FutureWarning``, for one release.
        input_shape: the shape of one input, for flat inputs.

    ``layer`` holds the module's name (the default resolved) and is fixed after construction; :attr:`feature_layer`
    is the layer in structured form on the feature route, else ``None`` (:meth:`head`); :attr:`evidence_curvature` the layer's
    :class:`~ntkgp.laplace.weight_space.FullCurvature` (its evidence, :meth:`log_marginal_likelihood`).

    Raises:
        ValueError: when ``layer`` names no module, or a module without trainable parameters of its own.

    Example:
        >>> posterior = LastLayerLaplace(net, x, y, SoftmaxLikelihood(10), prior_precision=1.0)
        >>> posterior.names
        ['head.weight', 'head.bias']
    """

    layer = OptionAttribute(check_name, fixed="the posterior is over this layer's parameters")

    @accepts_flat_keywords(options=PassOptions)
    def __init__(
        self,
        net: nn.Module,
        x: Data,
        y: Tensor | None,
        likelihood: Likelihood,
        layer: str | None = None,
        curvature: str = "ggn",
        prior_precision: float | Tensor = 1.0,
        prior_structure: str | Mapping[str, str] = "layer",
        options: PassOptions | None = None,
        input_shape: tuple[int, ...] | None = None,
    ) -> None:
        batch_size, chunk_size, progress = self._pass_settings(options)
        kind = choice(CurvatureKind)(curvature, "curvature")
        name, names = last_layer_names(net, layer)
        fn, groups = check_before_pass(net, likelihood, prior_precision, prior_structure, input_shape, chunk_size,
                                       names)
        structure = Structure.FULL_EF if kind is CurvatureKind.EF else Structure.FULL_GGN
        fitted, self.feature_layer = fit_last_layer(fn, groups, likelihood, name, structure, x, y, batch_size,
                                                    progress)
        self.layer = name
        self.evidence_curvature: CurvatureData = fitted
        DensePosterior.__init__(self, fn, likelihood, groups, prior_precision, fitted.components, kind)

    @classmethod
    def from_curvature(cls, curvature: CurvatureData, net: nn.Module, likelihood: Likelihood,
                       prior_precision: float | Tensor = 1.0, input_shape: tuple[int, ...] | None = None,
                       chunk_size: int = 256) -> LastLayerLaplace:
        """The posterior of one layer's full curvature already computed (:func:`last_layer_curvature`, or a
        :meth:`state_dict`'s), without a pass over the data; the route decided at the first prediction.

        Raises:
            TypeError: for another curvature than a :class:`~ntkgp.laplace.weight_space.FullCurvature`.
            ValueError: for a curvature over the parameters of several modules.
        """
        return super().from_curvature(curvature, net, likelihood, prior_precision, input_shape, chunk_size)._restored()

    def _structure_name(self) -> str:
        return f"last_layer_{self.curvature.value}"

    def jacobian(self, x: Tensor) -> Tensor:
        r"""Per-example Jacobians of a prepared chunk, ``(n, C, P)``: :math:`I_C \otimes \tilde\phi^\top` in the
        network's flat order on the feature route (one forward pass), else by ``vmap(jacrev)``."""
        layer = self.head(x)
        if layer is None:
            return self.function.jacobian(x)
        return feature_jacobian(self.function, layer, x)

    def _log_marginal_likelihood(self, prior_precision: Tensor) -> Tensor:
        return layer_evidence(self, prior_precision)


def layer_evidence(posterior, prior_precision: Tensor) -> Tensor:
    r"""The Laplace-GGN evidence of a posterior over one layer's parameters (or a subnetwork's): that of the
    curvature it was built from (:attr:`evidence_curvature`,
    :meth:`~ntkgp.laplace.weight_space.Curvature.log_marginal_likelihood`: ``docs/math.md``, "Laplace-GGN
    evidence") for prior precisions ``(G,)`` at the likelihood's current noise or temperature, differentiable in
    both; the network checked unchanged first."""
    posterior.check_network()
    return posterior.evidence_curvature.log_marginal_likelihood(prior_precision, posterior.likelihood)


def feature_jacobian(function, layer: Layer, x: Tensor) -> Tensor:
    r""":math:`J = I_C \otimes \tilde\phi^\top` of a prepared chunk in the flat order of ``function``'s
    :math:`\theta` (the layer's parameters), ``(n, C, P)``, from one forward pass."""
    phi, f = head_features(function, layer, x)
    n, c = f.shape
    index = layer.index(function.offset, function.device)  # (C, d_a)
    out = phi.new_zeros(n, c, function.num_params)
    rows = torch.arange(c, device=phi.device)[:, None].expand_as(index)
    out[:, rows, index] = phi[:, None, :].expand(n, c, phi.shape[1])
    return out
