r"""KFAC Laplace: per layer :math:`(G_l \otimes A_l + \delta_l I)^{-1}` through the eigenbases of the factors.

With :math:`A = U_A \operatorname{diag}(q) U_A^\top` and
:math:`G(s) = \sum_k s_k G_k = U_G \operatorname{diag}(w) U_G^\top` (``docs/math.md``, "Curvature structures
(KFAC, diagonal)"), the prior is added *exactly*, without damping:

.. math::
    \Sigma_l = (G \otimes A + \delta_l I)^{-1} = (U_G \otimes U_A) \operatorname{diag}(\operatorname{vec} W)
    (U_G \otimes U_A)^\top, \qquad W_{oi} = \frac{1}{w_o q_i + \delta_l},

so that, for :math:`\Theta = [W \mid b]` as a ``(d_out, d_a)`` matrix (row-major, the order of
:mod:`ntkgp.laplace.weight_space.kfac.curvature`),

- :math:`\Sigma_l \operatorname{vec}(V) = \operatorname{vec}(U_G [(U_G^\top V U_A) \odot W] U_A^\top)`;
- the layer-wise factorized sampler: :math:`\eta_l = U_G (Z \odot W^{1/2}) U_A^\top`, :math:`Z` a standard
  normal ``(d_out, d_a)`` matrix. (The review of GLM-predictive estimators, ``docs/predictive.md``, writes
  :math:`\mathrm{ch}(Q)^{-1} X \mathrm{ch}(H)^{-1}` for the prior-free block; a factor :math:`B` with
  :math:`B B^\top = \Sigma_l` needs the inverse *transposed* Cholesky factors, and with the prior the factors
  no longer separate, hence the eigenbases.)
- :math:`\log|\Sigma_l^{-1}| = \sum_{oi} \log(w_o q_i + \delta_l)`;
- the GLM closed form (the review's eq. 16) from the layer inputs and output gradients at the test points,
  :func:`~ntkgp.laplace.weight_space.layers.kronecker_form.kronecker_sandwich`, computed by
  :func:`~ntkgp.laplace.weight_space.layers.kronecker_form.kronecker_covariances` (one pass, each column's gradients
  reduced as they come).

Nothing of size :math:`P \times P` (nor a layer's :math:`d_{out} d_a \times d_{out} d_a` block) is formed:
memory :math:`O(\sum_l d_a^2 + d_{out}^2)`. Parameters outside ``Linear``/``Conv2d`` layers (normalization
layers, ...) have the curvature's exact diagonal. ``damping=True`` replaces :math:`W` by
:math:`1/((w_o + \sqrt{\delta})(q_i + \sqrt{\delta}))`, the damped Kronecker product
:math:`(G + \sqrt\delta I) \otimes (A + \sqrt\delta I)` of laplace-torch's ``KronLaplace(damping=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ....ntk.attention_features import rebuild_layer
from ....ntk.features import Layer
from ....ntk.network import NetworkCore
from ....option_groups import accepts_flat_keywords
from ....options import OptionAttribute
from ...ggn.curvature import Curvature
from ...ggn.data_pass import Data
from .curvature import KroneckerFactors, KroneckerGGN, check_kfac_approximation, kfac_ggn
from ..layers.kronecker_form import (
    kronecker_covariances,
    kronecker_features,
    kronecker_root,
    layer_index,
)
from ..layers.curvature_layers import usable_layers
from ..posterior.pass_options import PassOptions
from ..posterior.weight_posterior import WeightPosterior, check_before_pass, check_likelihood, group_spec


def _check_damping(value: object, argument: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be a bool, got {type(value).__name__}")
    return value


@dataclass
class KroneckerBlock:
    r"""A layer's factors, decomposed at their first use.

    Attributes:
        layer: the layer.
        group: its prior group.
        index: flat positions of :math:`\Theta`, ``(d_out, d_a)``.
        factors: the curvature's block: :math:`A` (``input_factor``) and :math:`G_k` (``output_factors``,
            ``(K, d_out, d_out)``), with their eigendecompositions (:meth:`KroneckerFactors.decompose`: at the
            first covariance, sample, log-determinant or predictive, not in the fit).
    """

    layer: Layer
    group: int
    index: Tensor
    factors: KroneckerFactors

    @property
    def input_factor(self) -> Tensor:
        return self.factors.input_factor

    @property
    def output_factors(self) -> Tensor:
        return self.factors.output_factors

    def output_factor(self, scale: Tensor) -> Tensor:
        r""":math:`G(s) = \sum_k s_k G_k`."""
        return self.factors.output_factor(scale)

    def eigen(self, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        r"""The eigenvalues :math:`q` and eigenvectors :math:`U_A` of :math:`A`, and those of :math:`G(s)`
        (clamped at 0): with one component from the decomposition computed once, else from an ``eigh`` of
        :math:`G(s)`."""
        q, u_a, w, u_g = self.factors.eigenbases()
        if u_g is not None:
            return q, u_a, scale * w, u_g
        w, u_g = torch.linalg.eigh(self.output_factor(scale))
        return q, u_a, w.clamp_min(0), u_g


class KFACLaplace(WeightPosterior):
    r"""The KFAC Laplace posterior (module docstring): one Kronecker block per ``Linear``/``Conv2d`` layer.

    Args:
        net: the trained network, BatchNorm/dropout in eval mode; never modified.
        x: training inputs ``(N, ...)``, or an iterable of ``(x_b, y_b)`` batches with ``y=None``.
        y: training targets.
        likelihood: a supported likelihood; its noise or temperature at each later call sets :math:`s`.
        prior_precision: :math:`\delta`, a float or one per group.
        prior_structure: ``"layer"`` (default) or ``"network"`` or a mapping that keeps each layer's weight
            and bias in one group (one Kronecker block per layer).
        damping: use the damped Kronecker product instead of the exact prior (module docstring).
        options: how the passes run, a :class:`~ntkgp.laplace.weight_space.PassOptions` (``batch_size`` of the
            curvature pass, ``chunk_size`` at prediction time, ``progress``; ``None``: its defaults). Its fields as
            flat keywords (``batch_size=128``) still work, with a ``FutureWarning``, for one release.
        mc_samples: ``None`` (the exact GGN) or :math:`S` sampled roots of a softmax likelihood's Hessian per
            example (:mod:`~ntkgp.laplace.ggn.sampled_ggn`; GGN only).
        generator: the samples' ``torch.Generator`` (``None``: torch's global one).
        input_shape: the shape of one input, for flat inputs.
        kfac_approximation: ``"expand"`` or ``"reduce"`` on layers with several locations per example
            (:func:`~ntkgp.laplace.weight_space.kfac_ggn`).

    ``damping`` may be assigned after construction (the layer covariances are formed again); the other arguments
    are fixed.

    Example:
        >>> delta = torch.tensor([1.0, 2.0])                 # one per layer
        >>> posterior = KFACLaplace(net, x, y, SoftmaxLikelihood(10), prior_precision=delta)
        >>> posterior.glm_covariance(x_test).shape          # (N, C, C), never a P×P matrix
        torch.Size([1000, 10, 10])
    """

    damping = OptionAttribute(_check_damping, on_change="_option_changed")
    curvature_classes: ClassVar[Mapping[str, type[Curvature]]] = {"kfac": KroneckerGGN}

    @accepts_flat_keywords(options=PassOptions)
    def __init__(
        self,
        net: nn.Module,
        x: Data,
        y: Tensor | None,
        likelihood: Likelihood,
        prior_precision: float | Tensor = 1.0,
        prior_structure: str | Mapping[str, str] = "layer",
        damping: bool = False,
        options: PassOptions | None = None,
        input_shape: tuple[int, ...] | None = None,
        mc_samples: int | None = None,
        generator: torch.Generator | None = None,
        kfac_approximation: str = "expand",
    ) -> None:
        batch_size, chunk_size, progress = self._pass_settings(options)
        _check_damping(damping, "damping")
        check_kfac_approximation(kfac_approximation)
        check_before_pass(net, likelihood, prior_precision, prior_structure, input_shape, chunk_size)
        curvature = kfac_ggn(net, x, y, likelihood, group_spec(prior_structure), batch_size, progress, input_shape,
                             mc_samples=mc_samples, generator=generator, kfac_approximation=kfac_approximation)
        self._setup(curvature, net, likelihood, prior_precision, damping, input_shape, chunk_size)

    @classmethod
    def from_curvature(
        cls,
        curvature: Curvature,
        net: nn.Module,
        likelihood: Likelihood,
        prior_precision: float | Tensor = 1.0,
        damping: bool = False,
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 256,
    ) -> KFACLaplace:
        """The posterior of a KFAC curvature already computed (e.g. the one whose evidence chose
        :math:`\\delta`).

        Args:
            curvature: ``compute_curvature(net, ..., structure="kfac")`` at the network's current weights.
            net: the same network.
            likelihood: the likelihood it was computed with.
            prior_precision: as the constructor's.
            damping: as the constructor's.
            input_shape: as the constructor's.
            chunk_size: as the constructor's.
        """
        check_likelihood(likelihood)
        self = cls.__new__(cls)
        self._setup(curvature, net, likelihood, prior_precision, damping, input_shape, chunk_size)
        return self

    def _setup(self, curvature, net, likelihood, prior_precision, damping, input_shape, chunk_size) -> None:
        if not isinstance(curvature, KroneckerGGN):
            raise TypeError(
                f"curvature must be a KFAC curvature (structure='kfac'), got {type(curvature).__name__}"
            )
        fn = NetworkCore(net, list(curvature.groups.names), input_shape, chunk_size)
        super().__init__(fn, likelihood, curvature.groups, prior_precision, curvature.scale_size)
        self.structure = "kfac"
        self.damping = damping
        self.blocks: list[KroneckerBlock] = []
        factors: list[KroneckerFactors] = curvature.blocks
        for f in factors:  # not decomposed here: at the first use (KroneckerBlock.eigen)
            layer = rebuild_layer(net, f.module, f.weight, f.bias)  # attention projections included
            self.blocks.append(KroneckerBlock(layer, f.group, layer_index(fn, layer), f))
        self.diagonal_names = list(curvature.diagonal_names)
        self.diagonal_components = curvature.diagonal_components
        self.diagonal_index = torch.cat(
            [
                torch.arange(fn.offset(n), fn.offset(n) + fn.numels[fn.names.index(n)], device=fn.device)
                for n in self.diagonal_names
            ]
            or [torch.zeros(0, dtype=torch.long, device=fn.device)]
        )
        self._verified = False
        #: the :class:`~ntkgp.laplace.weight_space.KroneckerGGN` the posterior was built from (its evidence)
        self.evidence_curvature = curvature

    def _log_marginal_likelihood(self, prior_precision: Tensor) -> Tensor:
        if self.damping:
            raise ValueError(
                "the evidence of a KFAC posterior is that of the exact prior (G ⊗ A + δI); with damping=True the "
                "posterior's precision is another matrix: set damping=False to evaluate or tune δ by the evidence"
            )
        return self.evidence_curvature.log_marginal_likelihood(prior_precision, self.likelihood)

    def _state_options(self) -> dict:
        return {"damping": self.damping}

    def _option_changed(self, name: str) -> None:
        """``damping`` changed: drop the layer covariances formed with the old value."""
        self._cache.clear()

    # ------------------------------------------------------------------ decomposition
    def _block_weights(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        r"""Per block :math:`(U_G, U_A, W)` for the current :math:`\delta` and :math:`s`."""

        def compute():
            scale, out = self.scale(), []
            for block in self.blocks:
                q, u_a, w, u_g = block.eigen(scale)
                delta = self.prior_precision[block.group]
                if self.damping:
                    weights = 1 / ((w + delta.sqrt())[:, None] * (q + delta.sqrt())[None, :])
                else:
                    weights = 1 / (w[:, None] * q[None, :] + delta)
                out.append((u_g, u_a, weights))
            return out

        return self.cached("blocks", compute)

    def diagonal_precision(self) -> Tensor:
        r""":math:`H_{pp}(s) + \delta_{g(p)}` of the parameters outside the blocks, ``(P_rest,)``."""
        delta = self.prior_precision_columns()[self.diagonal_index]
        if not self.diagonal_names:
            return delta
        return self.scale() @ self.diagonal_components + delta

    @staticmethod
    def _gather(block: KroneckerBlock, v: Tensor) -> Tensor:
        """``v`` ``(P, k)`` → the block's ``(k, d_out, d_a)`` matrices."""
        return v[block.index].permute(2, 0, 1)

    @staticmethod
    def _scatter(block: KroneckerBlock, out: Tensor, m: Tensor) -> None:
        out[block.index] = m.permute(1, 2, 0)

    # ------------------------------------------------------------------ WeightPosterior
    def _precision_matmul(self, v: Tensor) -> Tensor:
        out = torch.empty_like(v)
        scale = self.scale()
        for block in self.blocks:
            delta = self.prior_precision[block.group]
            g, a = block.output_factor(scale), block.input_factor
            eye_g = torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
            eye_a = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
            if self.damping:
                g, a, delta = g + delta.sqrt() * eye_g, a + delta.sqrt() * eye_a, 0
            m = self._gather(block, v)
            self._scatter(block, out, g @ m @ a + delta * m)
        out[self.diagonal_index] = v[self.diagonal_index] * self.diagonal_precision()[:, None]
        return out

    def _covariance_matmul(self, v: Tensor) -> Tensor:
        out = torch.empty_like(v)
        for block, (u_g, u_a, weights) in zip(self.blocks, self._block_weights()):
            m = u_g.T @ self._gather(block, v) @ u_a
            self._scatter(block, out, u_g @ (m * weights) @ u_a.T)
        out[self.diagonal_index] = v[self.diagonal_index] / self.diagonal_precision()[:, None]
        return out

    def _sample(self, z: Tensor) -> Tensor:
        zt = z.T
        out = torch.empty_like(zt)
        for block, (u_g, u_a, weights) in zip(self.blocks, self._block_weights()):
            self._scatter(block, out, u_g @ (self._gather(block, zt) * weights.sqrt()) @ u_a.T)
        out[self.diagonal_index] = zt[self.diagonal_index] * self.diagonal_precision().rsqrt()[:, None]
        return out.T

    def log_det_precision(self) -> Tensor:
        total = self.diagonal_precision().log().sum()
        for _, _, weights in self._block_weights():
            total = total - weights.log().sum()
        return total

    def dense_precision(self) -> Tensor:
        """:math:`H + P_0` with each block :math:`G \\otimes A + \\delta I` as an explicit Kronecker product
        (small :math:`P` only)."""
        p = self.num_params
        out = torch.zeros(p, p, dtype=self.function.dtype, device=self.function.device)
        scale = self.scale()
        for block in self.blocks:
            delta = self.prior_precision[block.group]
            g, a = block.output_factor(scale), block.input_factor
            if self.damping:
                g = g + delta.sqrt() * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
                a = a + delta.sqrt() * torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
                delta = 0
            index = block.index.reshape(-1)
            kron = torch.kron(g, a)
            out[index[:, None], index[None, :]] = kron + delta * torch.eye(
                len(index), dtype=kron.dtype, device=kron.device
            )
        out[self.diagonal_index, self.diagonal_index] = self.diagonal_precision()
        return out

    def _layers(self, x: Tensor) -> list:
        """The blocks' layers, checked against autograd on ``x`` at the first call."""
        layers = [block.layer for block in self.blocks]
        if not self._verified:
            usable_layers(self.function, layers, x, strict=True)
            self._verified = True
        return layers

    def _features(self, x: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        return kronecker_features(self.function, x, self._layers(x))

    def _glm_covariance(self, x: Tensor) -> Tensor:
        layers = self._layers(x)
        covariances = [(weights, u_g, u_a) for u_g, u_a, weights in self._block_weights()]
        out = kronecker_covariances(self.function, x, layers, covariances) if layers else 0
        if self.diagonal_names:
            jac = self.function.jacobian(x, self.diagonal_names)
            out = out + (jac / self.diagonal_precision()) @ jac.mT
        return out

    def _glm_root(self, x: Tensor) -> Tensor:
        features = self._features(x)
        roots = []
        for block, (u_g, u_a, weights) in zip(self.blocks, self._block_weights()):
            a, gamma = features[block.layer.name]
            roots.append(kronecker_root(a, gamma, weights, u_g, u_a))
        if self.diagonal_names:
            roots.append(self.function.jacobian(x, self.diagonal_names) * self.diagonal_precision().rsqrt())
        return torch.cat(roots, dim=-1)
