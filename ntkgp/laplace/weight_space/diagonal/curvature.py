r"""Diagonal Laplace curvatures: the diagonal of the GGN or of the empirical Fisher (Immer et al. 2021, §3).

.. math::
    \operatorname{diag}(H_{\mathrm{GGN}}) = \sum_n \sum_m (J_n^\top L_{n,:m})^{\odot 2}, \qquad
    \operatorname{diag}(H_{\mathrm{EF}}) = \sum_n (J_n^\top g_n)^{\odot 2},
    \qquad \log|H + P_0| = \sum_p \log(H_{pp} + \delta_{g(p)}),

with :math:`L_n L_n^\top = \Lambda_n` (:func:`~ntkgp.likelihoods.hessian_sqrt`). The rows :math:`J_n^\top u` are
formed batch by batch, never the Jacobian of the data set: from layer inputs and back-propagated output
gradients for ``Linear``/``Conv2d`` layers (:mod:`~ntkgp.laplace.weight_space.layers.curvature_layers`) and for normalization
layers' affine parameters and embedding tables (:mod:`~ntkgp.laplace.weight_space.layers.norm_layers`), by per-example
vector-Jacobian products for all other parameters (and for layers called more than once per forward pass).

The likelihood's hyperparameters enter through its output scale :math:`s` (:mod:`~ntkgp.laplace.ggn.scaling`):
the diagonal is stored as components :math:`D_k` computed with the unit factors :math:`\tilde L_n, \tilde g_n`,
and re-weighted, :math:`\operatorname{diag} H = \sum_k w_k(s) D_k`, in :math:`O(KP)` per evaluation:

- GGN: :math:`w = s`; one component (tempered classification, :math:`K = 1`) or one per output (Gaussian,
  :math:`D_c = \sum_n (J_{nc})^{\odot 2}`, :math:`K = C`);
- EF: :math:`w_{cc'} = s_c s_{c'}`, :math:`D_{cc'} = \sum_n (J_{nc}^\top \tilde g_{nc}) \odot
  (J_{nc'}^\top \tilde g_{nc'})`; :math:`K = C^2` for Gaussian likelihoods (per-output noise), :math:`K = 1`
  otherwise (the EF scales as :math:`1/T^2`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ....ntk.inputs import rows
from ....ntk import ParameterGroups
from ....ntk.groups import GroupSpec
from ...ggn.curvature import Curvature
from ...ggn.data_pass import Data, DataPass
from ...ggn.exact_log_det import diagonal_log_det
from ..layers.curvature_layers import Layer, layer_features, structured_layers, usable_layers
from ....ntk.norm_features import ElementwiseLayer
from ..layers.norm_layers import diagonal_layers


class DiagonalCurvature(Curvature):
    r"""A diagonal curvature :math:`\operatorname{diag}(H) = \sum_k w_k(s) D_k` (module docstring).

    Args:
        groups: the prior-precision groups (as :class:`~ntkgp.laplace.weight_space.Curvature`).
        theta_sq_norms: :math:`\|\theta^*_g\|^2` per group.
        f: network outputs at :math:`\theta^*`.
        y: normalised targets.
        scale_size: length of the likelihood's output scale.
        components: :math:`D_k`, shape ``(K, P)``, columns in the order of ``groups.names``.
    """

    def __init__(
        self,
        groups: ParameterGroups,
        theta_sq_norms: Tensor,
        f: Tensor,
        y: Tensor,
        scale_size: int,
        components: Tensor,
    ) -> None:
        super().__init__(groups, theta_sq_norms, f, y, scale_size)
        self.components = components

    @abstractmethod
    def component_weights(self, scale: Tensor) -> Tensor:
        """The weights ``(K,)`` of the components for the output scale ``scale`` ``(scale_size,)``."""

    def diagonal(self, likelihood: Likelihood) -> Tensor:
        r""":math:`\operatorname{diag}(H)` for the likelihood's current hyperparameters, shape ``(P,)``."""
        return self.component_weights(self.scale(likelihood)) @ self.components

    def log_det(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\sum_p \log(H_{pp} + \delta_{g(p)})`, :math:`O(KP)`."""
        delta = self.prior_precision_vector(prior_precision)
        return diagonal_log_det(self.component_weights(self.scale(likelihood)), delta, self.components,
                                self.column_groups)

    def diagonal_spectrum(self) -> tuple[Tensor, Tensor, int] | None:
        if self.scale_size != 1 or self.components.shape[0] != 1:
            return None
        return self.components[0], self.column_groups, (2 if self.structure == "diag_ef" else 1)

    def dense(self, likelihood: Likelihood) -> Tensor:
        return torch.diag(self.diagonal(likelihood))

    def _state_fields(self) -> dict:
        return {"components": self.components}

    @classmethod
    def _from_state(cls, common: tuple, state: Mapping) -> DiagonalCurvature:
        return cls(*common, state["components"])


class DiagonalGGN(DiagonalCurvature):
    r"""Diagonal of the GGN :math:`\sum_n J_n^\top \Lambda_n J_n`; weights :math:`w = s`."""

    structure = "diag_ggn"

    def component_weights(self, scale: Tensor) -> Tensor:
        return scale


class DiagonalEF(DiagonalCurvature):
    r"""Diagonal of the empirical Fisher :math:`\sum_n G_n^\top G_n`, :math:`G_n = g_n^\top J_n`; weights
    :math:`w_{cc'} = s_c s_{c'}`."""

    structure = "diag_ef"

    def component_weights(self, scale: Tensor) -> Tensor:
        return (scale[:, None] * scale[None, :]).reshape(-1)


def diagonal_products(
    data: DataPass, x: Tensor, cotangents: Tensor, names: list[str], layers: list[Layer], pairs: bool
) -> Tensor:
    r"""One batch's :math:`\sum_n (J_n^\top u_{na}) \odot (J_n^\top u_{nb})` on the parameters ``names``.

    Args:
        data: the pass (network, parameters, likelihood).
        x: prepared inputs ``(n, ...)``.
        cotangents: :math:`u_{nm}`, shape ``(n, C, M)``.
        names: the parameters, in the order of the columns returned.
        layers: ``Linear``/``Conv2d`` layers whose parameters (all in ``names``) take the structured route
            (:mod:`~ntkgp.laplace.weight_space.layers.curvature_layers`): per-example gradients :math:`\sum_t \Gamma_{nmt} \bar a_{nt}^\top`,
            and for one location :math:`\sum_n \Gamma_{nm}^{\odot 2} (\bar a_n^{\odot 2})^\top`, a matrix
            product; normalization and embedding layers (:class:`~ntkgp.ntk.norm_features.ElementwiseLayer`) their
            elementwise rows; the other parameters take per-example vector-Jacobian products.
        pairs: all pairs :math:`(a, b)`, shape ``(M^2, P_{names})``; otherwise :math:`a = b`, ``(M, P_{names})``.

    Returns:
        The products, ``(M^2 or M, P_names)``.
    """
    m = cotangents.shape[-1]
    offsets = dict(zip(names, torch.tensor([0] + [data.params[n].numel() for n in names]).cumsum(0).tolist()))
    out = torch.zeros(m * m if pairs else m, offsets[names[-1]] + data.params[names[-1]].numel(),
                      dtype=data.core.dtype, device=data.core.device)
    structured = {n for layer in layers for n in (layer.weight, layer.bias) if n is not None}
    generic = [n for n in names if n not in structured]
    if generic:
        rows = data.per_example_vjps(x, cotangents, generic)  # (n, M, P_generic)
        values = torch.einsum("nap,nbp->abp", rows, rows).flatten(0, 1) if pairs else rows.square().sum(dim=0)
        start = 0
        for name in generic:
            size = data.params[name].numel()
            out[:, offsets[name] : offsets[name] + size] = values[:, start : start + size]
            start += size
    if layers:
        inputs, grads = layer_features(data, layers, x, cotangents)
        for layer in layers:
            a, g = inputs[layer.name], grads[layer.name]  # (n, d_a, T), (n, M, d_out, T)
            if isinstance(layer, ElementwiseLayer):  # normalization, embedding: elementwise rows (norm_layers)
                for name, values in layer.squares(a, g, pairs).items():
                    out[:, offsets[name] : offsets[name] + values.shape[-1]] = values
                continue
            if a.shape[-1] == 1 and pairs:
                values = torch.einsum("nao,nbo,ni->aboi", g[..., 0], g[..., 0], a[..., 0].square()).flatten(0, 1)
            elif a.shape[-1] == 1:
                values = torch.einsum("nmo,ni->moi", g[..., 0].square(), a[..., 0].square())
            else:
                per_example = torch.einsum("nmot,nit->nmoi", g, a)
                values = (
                    torch.einsum("naoi,nboi->aboi", per_example, per_example).flatten(0, 1)
                    if pairs
                    else per_example.square().sum(dim=0)
                )
            fan_in = values.shape[-1] - (layer.bias is not None)
            weight = data.params[layer.weight].numel()
            out[:, offsets[layer.weight] : offsets[layer.weight] + weight] = values[..., :fan_in].flatten(1)
            if layer.bias is not None:
                bias = offsets[layer.bias]
                out[:, bias : bias + values.shape[1]] = values[..., fan_in]
    return out


def diagonal_ggn_components(
    data: DataPass, x: Tensor, f: Tensor, y: Tensor, names: list[str], layers: list[Layer]
) -> Tensor:
    r"""One batch's GGN diagonal components :math:`D_k`, shape ``(K, P_{names})``, from :math:`\tilde L_n`.

    Column :math:`m` of :math:`\tilde L_n` contributes to component :math:`m` when :math:`K = C` (Gaussian,
    :math:`\tilde L_n = I`) and to the single component when :math:`K = 1`.
    """
    rows = diagonal_products(data, x, data.unit_hessian_sqrt(f, y), names, layers, pairs=False)  # (C, P)
    return rows if data.scale0.shape[0] == rows.shape[0] else rows.sum(dim=0, keepdim=True)


def diagonal_ggn(
    net: nn.Module,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    prior_structure: GroupSpec = "layer",
    batch_size: int = 64,
    progress: bool | None = None,
    input_shape: tuple[int, ...] | None = None,
    distributed: bool = False,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> DiagonalGGN:
    r"""The diagonal GGN :math:`\sum_n \sum_m (J_n^\top L_{n,:m})^{\odot 2}` over the data, batch by batch.

    ``Linear``/``Conv2d`` layers, normalization layers' affine parameters and embedding tables: one forward and
    :math:`C` backward passes per batch (layer features, :mod:`~ntkgp.laplace.weight_space.layers.norm_layers`);
    other parameters: per-example vector-Jacobian products, memory :math:`O(\text{batch} \cdot C \cdot P)`.
    With ``mc_samples`` :math:`= S`, :math:`S` sampled columns instead of :math:`C`
    (:mod:`~ntkgp.laplace.ggn.sampled_ggn`). Arguments as :func:`~ntkgp.laplace.compute_curvature`.
    """
    return _diagonal_pass(DiagonalGGN, "diagonal GGN", diagonal_ggn_components, net, x, y, likelihood,
                          prior_structure, batch_size, progress, input_shape, distributed, mc_samples, generator)


def diagonal_ef(
    net: nn.Module,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    prior_structure: GroupSpec = "layer",
    batch_size: int = 64,
    progress: bool | None = None,
    input_shape: tuple[int, ...] | None = None,
    distributed: bool = False,
) -> DiagonalEF:
    r"""The diagonal empirical Fisher :math:`\sum_n (J_n^\top g_n)^{\odot 2}` over the data, batch by batch.

    One backward pass per batch (:math:`C` for Gaussian likelihoods with :math:`C > 1`, to keep per-output
    noise differentiable); routes as :func:`diagonal_ggn`. Arguments as
    :func:`~ntkgp.laplace.compute_curvature`.
    """
    return _diagonal_pass(DiagonalEF, "diagonal EF", _diagonal_ef_components, net, x, y, likelihood,
                          prior_structure, batch_size, progress, input_shape, distributed)


def _diagonal_ef_components(data: DataPass, x: Tensor, f: Tensor, y: Tensor, names: list[str], layers) -> Tensor:
    r"""One batch's :math:`\sum_n (J_n^\top \tilde g_n)^{\odot 2}`, per output for a multi-output Gaussian."""
    g = data.unit_gradient(f, y)
    cot = torch.diag_embed(g) if data.scale0.shape[0] > 1 else g.unsqueeze(-1)
    return diagonal_products(data, x, cot, names, layers, pairs=True)


def _diagonal_pass(kind, label: str, components, net, x, y, likelihood, prior_structure, batch_size, progress,
                   input_shape, distributed, mc_samples=None, generator=None):
    """The one pass over the data of both diagonals: ``components(data, x, f, y, names, layers)`` summed over
    the batches (and the ranks), the layer features checked on the first batch."""
    data = DataPass.start(net, likelihood, prior_structure, input_shape, distributed, mc_samples, generator)
    names = list(data.core.groups.names)
    layers = structured_layers(net, data.core.groups, strict=False)
    total = 0
    for step, (xb, fb, yb) in enumerate(data.batches(x, y, batch_size, progress, label)):
        if step == 0:
            layers = usable_layers(data.core, layers, rows(xb, 0, 1), strict=False)
            covered = {n for layer in layers for n in layer.parameter_names}
            layers = layers + diagonal_layers(data, [n for n in names if n not in covered], rows(xb, 0, 1))
        total = total + components(data, xb, fb, yb, names, layers)
    data.reduce([total])  # sums over every rank's shard
    f_all, y_all = data.collected()
    return kind(data.core.groups, data.theta_sq_norms(), f_all, y_all, data.scale0.shape[0], total)
