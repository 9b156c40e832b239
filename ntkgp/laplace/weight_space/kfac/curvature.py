r"""Kronecker-factored GGN (KFAC) without damping (Immer et al. 2021, eq. 9 and §A.3).

For a layer :math:`z = \Theta \bar a` with :math:`\Theta = [W \mid b]` (``nn.Linear``; ``nn.Conv2d`` on unfolded
patches; the in- and out-projections of ``nn.MultiheadAttention`` on the positions,
:mod:`ntkgp.ntk.attention_features`) and :math:`\bar a = [a; 1]` (the 1 only when the bias is trainable), the
exact GGN block is
:math:`\sum_n \sum_m (\sum_t \Gamma_{nmt} \otimes \bar a_{nt})(\cdot)^\top` with
:math:`\Gamma_{nmt} = \partial (L_{n,:m}^\top f_n) / \partial z_{nt}` the output gradient back-propagated from
column :math:`m` of :math:`L_n` (:math:`L_n L_n^\top = \Lambda_n`) at location :math:`t`. KFAC approximates it by

.. math::
    H_l \approx G_l \otimes A_l, \qquad A_l = \sum_n \sum_t \bar a_{nt} \bar a_{nt}^\top, \qquad
    G_l = \frac{1}{N T_l} \sum_n \sum_m \sum_t \Gamma_{nmt} \Gamma_{nmt}^\top,

in the row-major order of :math:`\operatorname{vec}(\Theta)` (output index major). :math:`T_l` is the number of
locations per example: the spatial positions of a convolution, the extra dimensions of a linear layer's
input, 1 for ``(N, d)`` inputs. This is the *KFAC-expand* convention (Eschenhagen et al. 2023), the KFC of
Grosse & Martens (2016) for a sum over the data set: on sequences (``nn.Linear`` on ``(N, T, d)``) the :math:`T`
positions count as examples. ``kfac_approximation="reduce"`` gives their *KFAC-reduce*, the locations reduced per
example first (:func:`kfac_ggn`). For ``nn.Linear`` on ``(N, d)`` inputs and
:math:`N = 1` the product is the exact GGN block.

No damping: each block :math:`H_l + \delta_l I` is exact through the factors' eigendecompositions: with
eigenvalues :math:`q_i` of :math:`A_l` and :math:`w_j` of :math:`G_l`,
:math:`\log|H_l + \delta_l I| = \sum_{ij} \log(q_i w_j + \delta_l)` (the log-determinant of linear_operator's
``KroneckerProductAddedDiagLinearOperator``, evaluated directly: a step costs :math:`O(d_{out} d_a)` per
layer). The eigendecompositions are computed once per factor, at the first use that needs them (a log-determinant,
the evidence, a posterior's covariance, sampling or predictive; not in the pass over the data: linear_operator's, in
double precision, rounding-negative eigenvalues chopped at 0). Weight and
bias form one block and must share a prior group. Parameters outside ``nn.Linear`` / ``nn.Conv2d`` (normalisation layers, embeddings,
...) get the exact diagonal GGN block (:mod:`~ntkgp.laplace.weight_space.diagonal.curvature`): normalization layers' affine
parameters and embedding tables from the same forward and backward passes
(:mod:`~ntkgp.laplace.weight_space.layers.norm_layers`), free parameters added to the activations (a learned position) from
the output gradients at the sum (:mod:`ntkgp.ntk.additive_features`), any other by per-example vector-Jacobian
products. An attention projection that fails the layer plan's check joins the diagonal instead of raising.

Likelihood hyperparameters: :math:`G_l = \sum_k s_k G_{lk}` with components from the unit factors
(:mod:`~ntkgp.laplace.ggn.scaling`). With one component (one noise, or a temperature)
:math:`\log|s\,\tilde G \otimes A + \delta I| = d_l \log s + \log|\tilde G \otimes A + (\delta/s) I|`, so no
factor is decomposed again; with per-output Gaussian noise (:math:`K = C`)
:math:`\sum_k s_k G_{lk}` is eigendecomposed at each evaluation (:math:`O(d_{\text{out}}^3)` per layer, no
pass over the data).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from gpytorch.likelihoods import Likelihood
from linear_operator.operators import (
    DenseLinearOperator,
    KroneckerProductLinearOperator,
)
from torch import Tensor, nn

from ....ntk.inputs import rows
from ....ntk import ParameterGroups
from ....ntk.groups import GroupSpec
from ...ggn.curvature import Curvature
from ...ggn.data_pass import Data, DataPass
from ..diagonal.curvature import diagonal_ggn_components
from ...ggn.exact_log_det import diagonal_log_det
from .blocks import KroneckerFactor, KroneckerFactors
from .factor_sums import FactorSums
from ..layers.curvature_layers import structured_layers, usable_layers
from ..layers.norm_layers import DiagonalSums, diagonal_layers


class KroneckerGGN(Curvature):
    r"""Block-diagonal KFAC GGN: one :class:`KroneckerFactors` block per ``Linear``/``Conv2d`` layer and an
    exact diagonal for the remaining parameters (module docstring).

    Args:
        groups: the prior-precision groups of the network's trainable parameters.
        theta_sq_norms: :math:`\|\theta^*_g\|^2` per group.
        f: network outputs at :math:`\theta^*`.
        y: normalised targets.
        scale_size: length of the likelihood's output scale.
        blocks: the Kronecker blocks.
        diagonal_names: the parameters outside the blocks.
        diagonal_components: their GGN diagonal components, shape ``(K, P_diag)``.
    """

    structure = "kfac"

    def __init__(
        self,
        groups: ParameterGroups,
        theta_sq_norms: Tensor,
        f: Tensor,
        y: Tensor,
        scale_size: int,
        blocks: list[KroneckerFactors],
        diagonal_names: list[str],
        diagonal_components: Tensor,
    ) -> None:
        super().__init__(groups, theta_sq_norms, f, y, scale_size)
        self.blocks = blocks  # decomposed at their first use (KroneckerFactors.decompose), not here
        self.diagonal_names = diagonal_names
        self.diagonal_components = diagonal_components
        index = dict(zip(groups.names, groups.group_of))
        self.diagonal_groups = torch.cat(
            [torch.full((n,), index[name]) for name, n in zip(groups.names, groups.numels) if name in diagonal_names]
            or [torch.zeros(0, dtype=torch.long)]
        ).to(f.device)
        self._unit_spectrum: tuple[Tensor, Tensor] | None = None

    def unit_spectrum(self) -> tuple[Tensor, Tensor]:
        r"""With one output-scale component (``K = 1``) every eigenvalue of :math:`H` is :math:`s` times one of
        these: the products :math:`w_j q_i` of every block and the diagonal, ``(1, P)``, and their groups
        ``(P,)``; formed once, at the first call (the blocks' decompositions with it)."""
        if self._unit_spectrum is None:
            eigen = [block.eigenvalues() for block in self.blocks]
            self._unit_spectrum = (
                torch.cat([torch.outer(w, q).reshape(-1) for q, w in eigen]
                          + [self.diagonal_components.reshape(-1)]).unsqueeze(0),
                torch.cat([torch.tensor([b.group for b in self.blocks], device=self.f.device).repeat_interleave(
                    torch.tensor([q.numel() * w.numel() for q, w in eigen], device=self.f.device)),
                    self.diagonal_groups]),
            )
        return self._unit_spectrum

    def diagonal_spectrum(self) -> tuple[Tensor, Tensor, int] | None:
        if self.scale_size != 1:
            return None
        unit, groups = self.unit_spectrum()
        return unit[0], groups, 1

    def output_eigenvalues(self, block: KroneckerFactors, scale: Tensor) -> Tensor:
        r"""Eigenvalues of :math:`\sum_k s_k G_k`, ``(d_out,)``, differentiable in :math:`s`."""
        if scale.shape[0] == 1:
            return scale * block.eigenvalues()[1]
        return KroneckerFactor(block.output_factor(scale)).eigvalsh()

    def log_det(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\sum_l \log|G_l \otimes A_l + \delta_l I| + \sum_{p \notin \text{blocks}} \log(H_{pp} + \delta)`."""
        delta = self.prior_precision_vector(prior_precision)
        scale = self.scale(likelihood)
        if scale.shape[0] == 1:  # one pass over all eigenvalues, O(P)
            return diagonal_log_det(scale, delta, *self.unit_spectrum())
        total = torch.log(scale @ self.diagonal_components + delta[self.diagonal_groups]).sum()
        for block in self.blocks:
            total = total + block.log_det(scale, delta[block.group])
        return total

    def _state_fields(self) -> dict:
        blocks = [{"module": b.module, "weight": b.weight, "bias": b.bias, "group": b.group,
                   "input_factor": b.input_factor, "output_factors": b.output_factors} for b in self.blocks]
        return {"blocks": blocks, "diagonal_names": list(self.diagonal_names),
                "diagonal_components": self.diagonal_components}

    @classmethod
    def _from_state(cls, common: tuple, state: Mapping) -> KroneckerGGN:
        blocks = [KroneckerFactors(b["module"], b["weight"], b["bias"], int(b["group"]), b["input_factor"],
                                   b["output_factors"]) for b in state["blocks"]]
        return cls(*common, blocks, list(state["diagonal_names"]), state["diagonal_components"])

    def dense(self, likelihood: Likelihood) -> Tensor:
        r"""The block-diagonal :math:`H` as ``(P, P)``; each block :math:`G \otimes A` (linear_operator's
        ``KroneckerProductLinearOperator``, densified) is permuted from the order of
        :math:`\operatorname{vec}([W \mid b])` to the network's order (``weight`` then ``bias``)."""
        scale = self.scale(likelihood)
        names = list(self.groups.names)
        offsets = dict(zip(names, torch.tensor((0,) + self.groups.numels).cumsum(0).tolist()))
        out = torch.zeros(self.num_params, self.num_params, dtype=self.dtype, device=self.f.device)
        for block in self.blocks:
            d_out, d_a = block.output_factors.shape[-1], block.input_factor.shape[0]
            fan_in = d_a - (block.bias is not None)
            o, i = torch.meshgrid(torch.arange(d_out), torch.arange(d_a), indexing="ij")
            index = offsets[block.weight] + o * fan_in + i
            if block.bias is not None:
                index = torch.where(i == fan_in, offsets[block.bias] + o, index)
            index = index.reshape(-1)
            kron = KroneckerProductLinearOperator(
                DenseLinearOperator(block.output_factor(scale)), DenseLinearOperator(block.input_factor)
            ).to_dense()
            out[index[:, None], index[None, :]] = kron
        if self.diagonal_names:
            cols = torch.cat([torch.arange(offsets[n], offsets[n] + self.groups.numels[names.index(n)])
                              for n in names if n in self.diagonal_names])
            out[cols, cols] = scale @ self.diagonal_components
        return out


def check_kfac_approximation(kfac_approximation: str) -> None:
    """Raise ``ValueError`` unless ``kfac_approximation`` is ``"expand"`` or ``"reduce"``."""
    if kfac_approximation not in ("expand", "reduce"):
        raise ValueError(f"kfac_approximation must be 'expand' or 'reduce', got {kfac_approximation!r}")


def kfac_ggn(
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
    kfac_approximation: str = "expand",
) -> KroneckerGGN:
    r"""KFAC factors :math:`A_l, G_l` of every ``Linear``/``Conv2d`` layer (module docstring) and the exact
    diagonal GGN of the other parameters, batch by batch.

    Cost: one forward and :math:`M` backward passes per batch (:math:`M = C - 1` for a softmax, the columns of
    :meth:`~ntkgp.laplace.ggn.data_pass.DataPass.unit_hessian_root`; plus per-example passes for parameters
    outside the layers and the normalization and embedding layers of :mod:`~ntkgp.laplace.weight_space.layers.norm_layers`) and the factors' products, :math:`T_l d_{in}^2 + M T_l d_{out}^2` per example and layer
    (:mod:`~ntkgp.laplace.weight_space.kfac.factor_sums`); memory
    :math:`O(\text{batch} \cdot \text{activations} + \sum_l d_a^2 + K d_{out}^2)`: one output's gradients at a time,
    the factors' float64 sums. With ``mc_samples`` :math:`= S`, :math:`S` backward passes per batch instead of
    :math:`M` (:mod:`~ntkgp.laplace.ggn.sampled_ggn`). ``kfac_approximation``: ``"expand"`` (module
    docstring) or ``"reduce"``: a layer's :math:`T_l` locations reduced per example first,
    :math:`A_l = \sum_n \bar a_n \bar a_n^\top` with :math:`a_n = T_l^{-1} \sum_t a_{nt}` and
    :math:`G_l = N^{-1} \sum_n \sum_m \Gamma_{nm} \Gamma_{nm}^\top` with :math:`\Gamma_{nm} = \sum_t \Gamma_{nmt}`
    (Eschenhagen et al. 2023; exact for :math:`N = 1` when the locations are averaged right after the layer). The
    two coincide for layers with one location.
    Arguments as :func:`~ntkgp.laplace.compute_curvature`.
    """
    check_kfac_approximation(kfac_approximation)
    data = DataPass.start(net, likelihood, prior_structure, input_shape, distributed, mc_samples, generator)
    pg, dtype, device = data.core.groups, data.core.dtype, data.core.device
    layers = structured_layers(net, pg, strict=True)
    in_blocks = {n for layer in layers for n in (layer.weight, layer.bias) if n is not None}
    diagonal_names = [n for n in pg.names if n not in in_blocks]
    num_components = data.scale0.shape[0]
    sums = FactorSums(layers, num_components, reduce_locations=kfac_approximation == "reduce")
    diag_total = torch.zeros(num_components, 0, dtype=dtype, device=device)
    generic_total, generic = 0, diagonal_names
    elementwise = DiagonalSums(num_components)  # normalization and embedding layers, from the same passes
    first = [True]

    def forward(xb: Tensor, root) -> Tensor:  # the batch's one forward pass, and its backward passes
        if first:  # the layers checked on the first batch's first example
            first.clear()
            kept = usable_layers(data.core, layers, rows(xb, 0, 1), strict=True)
            if len(kept) != len(layers):  # attention projections that fail the check: to the exact diagonal
                dropped = {n for layer in layers if layer not in kept for n in layer.parameter_names}
                layers[:] = kept
                diagonal_names[:] = [n for n in pg.names if n in dropped or n in diagonal_names]
            elementwise.layers = diagonal_layers(data, diagonal_names, rows(xb, 0, 1))
        features = data.core.features(xb, layers + elementwise.layers, root,
                                      reduce=elementwise.routed(sums.reduce))  # G: in sums.reduce
        sums.add_inputs(features.inputs)
        return features.outputs

    for xb, fb, yb in data.batches(x, y, batch_size, progress, "KFAC", forward):
        generic = [n for n in diagonal_names if n not in elementwise.names]
        if generic:
            generic_total = generic_total + diagonal_ggn_components(data, xb, fb, yb, generic, [])
    if diagonal_names:
        diag_total = elementwise.merge(data, diagonal_names, generic, generic_total)
    a_sum, g_sum, locations = sums.factors()
    if data.distributed:  # sums over every rank's shard (float64)
        counts = torch.tensor([locations[layer.name] for layer in layers], device=device)
        data.reduce([a_sum[layer.name] for layer in layers] + [g_sum[layer.name] for layer in layers] + [counts]
                    + ([diag_total] if diagonal_names else []))
        locations = dict(zip([layer.name for layer in layers], counts.tolist()))
    f_all, y_all = data.collected()
    index = dict(zip(pg.names, pg.group_of))
    blocks = [
        KroneckerFactors(
            layer.name, layer.weight, layer.bias, index[layer.weight], a_sum[layer.name].to(dtype),
            (g_sum[layer.name] / locations[layer.name]).to(dtype),
        )
        for layer in layers
    ]
    return KroneckerGGN(pg, data.theta_sq_norms(), f_all, y_all, num_components, blocks, diagonal_names, diag_total)
