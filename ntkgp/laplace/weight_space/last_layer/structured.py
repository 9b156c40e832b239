r"""KFAC and diagonal Laplace posteriors over the last layer, from its features.

With :math:`J(x) = I_C \otimes \tilde\phi(x)^\top` (:mod:`~ntkgp.laplace.weight_space.last_layer.features`) the GLM
covariance of a test point needs only :math:`\tilde\phi(x)`, one forward pass, no backward pass:

- KFAC, :math:`\Sigma = (U_G \otimes U_A) \operatorname{diag}(\operatorname{vec} W) (U_G \otimes U_A)^\top`
  (:class:`~ntkgp.laplace.weight_space.KFACLaplace`): :math:`J \Sigma J^\top = U_G \operatorname{diag}(v) U_G^\top`,
  :math:`v_o = \sum_i W_{oi} \tilde a_i^2`, :math:`\tilde a = U_A^\top \tilde\phi`; a joint root
  :math:`R_{c,(o,i)} = U_{G,co} W_{oi}^{1/2} \tilde a_i`;
- diagonal, :math:`\Sigma = \operatorname{diag}(\sigma^2)`: :math:`J \Sigma J^\top = \operatorname{diag}(v)`,
  :math:`v_c = \sum_i \sigma^2_{ci} \tilde\phi_i^2`.

Cost per test point :math:`O(d_a^2 + C d_a + C^2)` (KFAC; :math:`O(C d_a)` diagonal), memory linear in ``C`` besides
the ``(n, C, C)`` result.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ....options import CurvatureKind
from ....option_groups import accepts_flat_keywords
from ....options import OptionAttribute, Structure, choice
from ...ggn.data_pass import Data
from ..diagonal.laplace import DiagLaplace
from ..kfac.laplace import KFACLaplace, _check_damping
from .curvature import fit_last_layer
from .features import head_features, last_layer_names
from .laplace import LayerRoute, layer_evidence
from ..posterior.pass_options import PassOptions
from ..posterior.weight_posterior import check_before_pass, check_name

__all__ = ["LastLayerDiagLaplace", "LastLayerKFACLaplace"]


def _fit(owner, net, x, y, likelihood, layer, structure, prior_precision, prior_structure, batch_size, progress,
         input_shape, chunk_size):
    """Check everything, fit the layer's curvature; set ``owner.layer``, ``feature_layer`` and ``evidence_curvature``
    (the evidence's); return the curvature."""
    name, names = last_layer_names(net, layer)
    fn, groups = check_before_pass(net, likelihood, prior_precision, prior_structure, input_shape, chunk_size, names)
    fitted, owner.feature_layer = fit_last_layer(fn, groups, likelihood, name, structure, x, y, batch_size, progress)
    owner.layer = name
    owner.evidence_curvature = fitted
    return fitted


class LastLayerKFACLaplace(LayerRoute, KFACLaplace):
    r"""The KFAC Laplace posterior over the last ``nn.Linear`` layer: :math:`H \approx G \otimes A`,
    :math:`A = \sum_n \tilde\phi_n \tilde\phi_n^\top`, :math:`G = \frac1N \sum_n \tilde\Lambda_n` (exact for a
    Gaussian likelihood), from one forward pass over the data; the other weights stay at :math:`\theta^*`.

    Args:
        net: the trained network (never modified); its last layer (or ``layer``) an ``nn.Linear`` whose output is
            the network's output.
        x, y, likelihood: as :class:`~ntkgp.laplace.weight_space.LastLayerLaplace`.
        layer: the module's name; default the last module that owns trainable parameters.
        prior_precision: :math:`\delta`, a float or one per group.
        prior_structure: ``"layer"`` (default) or ``"network"`` (weight and bias form one block: one group).
        damping: the damped Kronecker product (:class:`~ntkgp.laplace.weight_space.KFACLaplace`).
        options, input_shape: as :class:`~ntkgp.laplace.weight_space.LastLayerLaplace`.

    Memory :math:`O(d_a^2 + C^2)`: ``C = 1,000`` classes need no per-example ``C × C`` matrix. The evidence
    (:meth:`log_marginal_likelihood`, from :attr:`evidence_curvature`) is KFAC's without damping.

    Raises:
        ValueError: for a layer that is not an ``nn.Linear`` whose output is the network's, or a weight and bias in
            two prior groups.

    Example:
        >>> posterior = LastLayerKFACLaplace(net, x, y, SoftmaxLikelihood(10), prior_precision=1.0)
        >>> posterior.glm_covariance(x_test).shape
        torch.Size([1000, 10, 10])
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
        prior_precision: float | Tensor = 1.0,
        prior_structure: str | Mapping[str, str] = "layer",
        damping: bool = False,
        options: PassOptions | None = None,
        input_shape: tuple[int, ...] | None = None,
    ) -> None:
        batch_size, chunk_size, progress = self._pass_settings(options)
        _check_damping(damping, "damping")
        fitted = _fit(self, net, x, y, likelihood, layer, Structure.KFAC, prior_precision, prior_structure,
                      batch_size, progress, input_shape, chunk_size)
        self._setup(fitted, net, likelihood, prior_precision, damping, input_shape, chunk_size)

    @classmethod
    def from_curvature(cls, curvature, net: nn.Module, likelihood: Likelihood, prior_precision: float | Tensor = 1.0,
                       damping: bool = False, input_shape: tuple[int, ...] | None = None,
                       chunk_size: int = 256) -> LastLayerKFACLaplace:
        """The posterior of one layer's KFAC curvature already computed
        (:func:`~ntkgp.laplace.weight_space.last_layer_curvature`, or a :meth:`state_dict`'s), without a pass over
        the data; the route decided at the first prediction."""
        return super().from_curvature(curvature, net, likelihood, prior_precision, damping, input_shape,
                                      chunk_size)._restored()

    def _glm_covariance(self, x: Tensor) -> Tensor:
        layer = self.head(x)
        if layer is None:  # a Linear layer whose output is not the network's: its output gradients
            return super()._glm_covariance(x)
        (u_g, u_a, weights), = self._block_weights()
        phi, _ = head_features(self.function, layer, x)
        v = (phi @ u_a).square() @ weights.T  # (n, C): Σ_i W_oi ã_i²
        return (u_g * v[:, None, :]) @ u_g.T

    def _glm_root(self, x: Tensor) -> Tensor:
        layer = self.head(x)
        if layer is None:
            return super()._glm_root(x)
        (u_g, u_a, weights), = self._block_weights()
        phi, _ = head_features(self.function, layer, x)
        return torch.einsum("co,oi,ni->ncoi", u_g, weights.sqrt(), phi @ u_a).flatten(-2)

    def _log_marginal_likelihood(self, prior_precision: Tensor) -> Tensor:
        return layer_evidence(self, prior_precision)



class LastLayerDiagLaplace(LayerRoute, DiagLaplace):
    r"""The diagonal Laplace posterior over the last layer: :math:`\operatorname{diag} H = \sum_n
    \operatorname{diag}(\tilde\Lambda_n) \otimes \tilde\phi_n^{\odot 2}` (GGN) or :math:`\sum_n \tilde g_n^{\odot 2}
    \otimes \tilde\phi_n^{\odot 2}` (EF) from one forward pass; memory :math:`O(K P)`. A layer off the feature route
    takes per-example Jacobians.

    Args:
        net, x, y, likelihood, layer: as :class:`~ntkgp.laplace.weight_space.LastLayerLaplace`.
        curvature: ``"ggn"`` (default) or ``"ef"``.
        prior_precision, prior_structure, options, input_shape: as
            :class:`~ntkgp.laplace.weight_space.LastLayerLaplace`.

    Example:
        >>> posterior = LastLayerDiagLaplace(net, x, y, SoftmaxLikelihood(10), prior_precision=1.0)
        >>> posterior.structure
        'diag_ggn'
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
        structure = Structure.DIAG_EF if kind is CurvatureKind.EF else Structure.DIAG_GGN
        fitted = _fit(self, net, x, y, likelihood, layer, structure, prior_precision, prior_structure, batch_size,
                      progress, input_shape, chunk_size)
        self._setup(fitted, net, likelihood, prior_precision, input_shape, chunk_size)

    @classmethod
    def from_curvature(cls, curvature, net: nn.Module, likelihood: Likelihood, prior_precision: float | Tensor = 1.0,
                       input_shape: tuple[int, ...] | None = None, chunk_size: int = 256) -> LastLayerDiagLaplace:
        """The posterior of one layer's diagonal curvature already computed
        (:func:`~ntkgp.laplace.weight_space.last_layer_curvature`, or a :meth:`state_dict`'s), without a pass over
        the data; the route decided at the first prediction."""
        return super().from_curvature(curvature, net, likelihood, prior_precision, input_shape, chunk_size)._restored()

    def _variances(self, layer) -> Tensor:
        """:math:`\\sigma^2` in the Kronecker order ``(C, d_a)``."""
        return self.precision_diagonal().reciprocal()[layer.index(self.function.offset, self.function.device)]

    def _glm_covariance(self, x: Tensor) -> Tensor:
        layer = self.head(x)
        if layer is None:
            return super()._glm_covariance(x)
        phi, _ = head_features(self.function, layer, x)
        return torch.diag_embed(phi.square() @ self._variances(layer).T)

    def _glm_root(self, x: Tensor) -> Tensor:
        layer = self.head(x)
        if layer is None:
            return super()._glm_root(x)
        phi, _ = head_features(self.function, layer, x)
        scaled = phi[:, None, :] * self._variances(layer).sqrt()  # (n, C, d_a)
        c = scaled.shape[1]
        return torch.diag_embed(scaled.transpose(1, 2)).permute(0, 2, 3, 1).reshape(phi.shape[0], c, -1)

    def _log_marginal_likelihood(self, prior_precision: Tensor) -> Tensor:
        return layer_evidence(self, prior_precision)
