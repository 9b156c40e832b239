r"""Outputs and covariances of a network linearized about arbitrary weights, with element-wise variances.

For weights :math:`\theta` and a diagonal weight covariance :math:`\operatorname{diag}(v)` the linearized
network :math:`f(x; \theta) + J_\theta(x)(\theta' - \theta)`, :math:`\theta' \sim N(\theta, \operatorname{diag}(v))`,
has the output covariance

.. math::
    \Sigma(x, x') = J_\theta(x) \operatorname{diag}(v) J_\theta(x')^\top \in \mathbb R^{C \times C},

an empirical NTK with one variance per weight (docs/fsvi.md, "The linearized covariance"). Unlike
:class:`ntkgp.NTKEngine`, which works at fixed trained weights with one precision per group, everything here is
a differentiable function of :math:`\theta` *and* :math:`v` (what FSVI trains). It uses ntkgp's one network core
(:class:`~ntkgp.ntk.network.NetworkCore`), layer plan (:mod:`ntkgp.ntk.layer_plan`) and layer features
(:mod:`ntkgp.ntk.features`, with ``graph=True``), so :math:`J` is never formed for linear layers:

* **linear layers** ``z = W a + b`` on ``(N, d_in)`` inputs: with the back-propagated output gradients
  :math:`\gamma_{nc} = \partial f_c(x_n)/\partial z` and the layer inputs :math:`a_n`,

  .. math::
      \Sigma_{(n,c),(m,d)} \mathrel{+}= \sum_i \gamma_{nc,i}\, \gamma_{md,i}
          \Big(\sum_j S_{ij}\, a_{nj} a_{mj} + s_{b,i}\Big),

  for weight variances :math:`S` and bias variances :math:`s_b`. The bracket is one GEMM over the pairs
  :math:`(n, m)` (only :math:`n \le m` for a symmetric covariance), cost :math:`\tfrac12 N^2 d_\text{in} d_\text{out}`,
  then :math:`(NC)^2 d_\text{out}` for the contraction with :math:`\gamma`. A variance that is one number per
  tensor costs only :math:`N^2 d_\text{in} + (NC)^2 d_\text{out}` (the NTK's form).
* **convolutions** (and linear layers on extra dimensions): per-example Jacobian blocks assembled from the same
  features, :math:`\sum_t \Gamma_{nct} a_{nt}^\top`, then contracted.
* **normalization layers' affine parameters and embedding tables** (the layer plan's elementwise layers,
  :mod:`ntkgp.ntk.norm_features`): per-example rows from the same features (:math:`\sum_t \hat x_{nt} \odot
  \Gamma_{nct}`, :math:`\sum_t \Gamma_{nct}`; the output gradients scattered by token id), contracted.
* **every other parameter** (layers that fail the safety rule, recurrent weights): per-example Jacobians by
  ``torch.func.vmap(jacrev)``, contracted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..ntk.checks import check_outputs, check_shape, prepare_inputs
from ..ntk.features import Layer
from ..ntk.layer_plan import LayerPlan, plan_layers
from ..ntk.network import NetworkCore
from ..validation import positive_count
from .pair_contraction import PairContraction, SymmetricGram, unit_gradients

Params = Mapping[str, Tensor]


@dataclass
class _Features:
    """Everything the covariance needs at one set of inputs.

    ``inputs[m]`` is ``a`` ``(N, d_in)`` and ``grads[m]`` is :math:`\\gamma` ``(N, C, d_out)`` per pair-form
    layer (the layer plan's single-location layers); ``jacobians[name]`` is ``(N, C, numel)`` per other parameter.
    """

    outputs: Tensor
    inputs: dict[str, Tensor]
    grads: dict[str, Tensor]
    jacobians: dict[str, Tensor]

    def rows(self, start: int, stop: int) -> _Features:
        """The features of the inputs ``start:stop`` (views, no copy)."""
        part = lambda d: {k: v[start:stop] for k, v in d.items()}  # noqa: E731
        return _Features(self.outputs[start:stop], part(self.inputs), part(self.grads), part(self.jacobians))


class LinearizedNetwork:
    """A network's outputs and linearized covariances :math:`J_\\theta \\operatorname{diag}(v) J_\\theta^\\top` at
    weights passed in, never the network's own.

    Args:
        net: any ``nn.Module`` mapping ``(N, *input_shape)`` to ``(N, C)``; BatchNorm and dropout must be in
            eval mode. Held by reference and never modified (hooks are attached only during a call).
        input_shape: shape of one input as the network expects it; inputs arriving as flat ``(N, D)``
            matrices (GPyTorch's convention) are reshaped to ``(N, *input_shape)``.
        strategy: ``"auto"`` (layer features for the linear and convolution layers that pass the safety rule
            of the layer plan, :mod:`ntkgp.ntk.layer_plan`) or ``"contraction"`` (Jacobians for every
            parameter; the reference route).
        chunk_size: examples per chunk for the covariances used at prediction (memory bound).

    Raises:
        TypeError: ``net`` is not an ``nn.Module``.
        ValueError: ``net`` has no trainable parameters, BatchNorm/dropout in training mode, or an unknown
            ``strategy``.
    """

    STRATEGIES = ("auto", "contraction")

    def __init__(
        self,
        net: nn.Module,
        input_shape: Sequence[int] | None = None,
        strategy: str = "auto",
        chunk_size: int = 256,
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if strategy not in self.STRATEGIES:
            raise ValueError(f"strategy must be one of {self.STRATEGIES}, got {strategy!r}")
        shape = None if input_shape is None else tuple(input_shape)
        self.core = NetworkCore(net, input_shape=shape, chunk_size=chunk_size)
        self.strategy = strategy
        self._plan: LayerPlan | None = None

    def __deepcopy__(self, memo: dict) -> LinearizedNetwork:
        # A copy of a model refers to the same user network: never duplicate it.
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        memo[id(self)] = new
        return new

    net = property(lambda self: self.core.net, doc="The network (held by reference).")
    names = property(lambda self: tuple(self.core.names), doc="The trainable parameters' names.")
    @property
    def input_shape(self) -> tuple[int, ...] | None:
        """The shape of one input, or ``None`` (may be set once it is known, e.g. from the first images seen)."""
        return self.core.input_shape

    @input_shape.setter
    def input_shape(self, shape: Sequence[int] | None) -> None:
        self.core.input_shape = check_shape(shape, "input_shape")

    @property
    def chunk_size(self) -> int:
        """Examples per chunk (assignable: it bounds memory and changes no result)."""
        return self.core.chunk_size

    @chunk_size.setter
    def chunk_size(self, value: int) -> None:
        self.core.chunk_size = positive_count(value, "chunk_size")

    # ------------------------------------------------------------------ inputs and outputs
    def prepare(self, x: Tensor, like: Tensor, argument: str = "x") -> Tensor:
        """Check ``x`` and bring it to the dtype and device of ``like`` and to the network's input shape."""
        return prepare_inputs(x, argument, like.dtype, like.device, self.input_shape)

    def forward(self, params: Params, x: Tensor) -> Tensor:
        """``f(x; θ)`` of shape ``(N, C)`` for the trainable parameters ``params`` (differentiable in both)."""
        f = self.core.call(dict(params), x)
        check_outputs(f, x.shape[0])
        return f

    def num_outputs(self, params: Params, x: Tensor) -> int:
        """C (one forward pass of ``x[:1]`` the first time)."""
        self.plan(params, x)
        return self._num_outputs

    def plan(self, params: Params, x: Tensor) -> LayerPlan:
        """The layer plan (the route of every parameter), checked once on the probe ``x[:1]`` at ``params``."""
        if self._plan is not None:
            return self._plan
        detached = {**self.core.functional_params(), **{n: p.detach() for n, p in params.items()}}
        with torch.no_grad():
            self._num_outputs = self.forward(detached, x[:1]).shape[1]
        self.core.autodiff(x[:1])  # how the network is differentiated, or a clear error now (ntkgp.ntk.autodiff)
        probe = x[:1] if self.strategy == "auto" else None
        self._plan = plan_layers(self.net, detached, self.core.names, probe, runner=self.core.module(),
                                 elementwise=True)
        return self._plan

    def features(self, params: Params, x: Tensor, create_graph: bool) -> _Features:
        """Outputs, pair-form features and Jacobian blocks at ``x`` (prepared inputs).

        With ``create_graph=True`` every result is differentiable in ``params`` (those that require grad) and
        ``x``; otherwise all are detached.
        """
        plan = self.plan(params, x)
        if not create_graph:
            params = {n: p.detach() for n, p in params.items()}
            x = x.detach()
        layers = (*plan.layers, *plan.elementwise)  # norm layers, embeddings: rows from the same features
        feats = self.core.features(x, layers, graph=create_graph, params=dict(params))
        inputs, grads, jacobians = {}, {}, {}
        pairs = {layer.name for layer in plan.single}
        for layer in layers:
            a, g = feats.inputs[layer.name], feats.grads[layer.name]  # (N, d_in, T), (N, C, d_out, T)
            if layer.name in pairs:
                inputs[layer.name], grads[layer.name] = a[..., 0], g[..., 0]
            else:
                jacobians.update(layer.jacobians(a, g))
        if plan.generic:
            with torch.set_grad_enabled(create_graph and torch.is_grad_enabled()):
                jacobians.update(self.core.jacobian_chunk(x, plan.generic, params=dict(params)))
        return _Features(feats.outputs, inputs, grads, jacobians)

    @staticmethod
    def _variances(variances: Params, layer: Layer) -> tuple[Tensor | None, Tensor | None]:
        """The layer's weight variances as ``(d_out, d_in)`` (or one number) and its bias variances."""
        vw = None if layer.weight is None else variances[layer.weight]
        vw = vw.reshape(vw.shape[0], -1) if vw is not None and vw.dim() > 1 else vw
        return vw, None if layer.bias is None else variances[layer.bias]

    # ------------------------------------------------------------------ covariances from features
    @staticmethod
    def _weighted_inputs(
        a1: Tensor, a2: Tensor, vw: Tensor | None, vb: Tensor | None, d_out: int, symmetric: bool,
        upper_only: bool = False,
    ) -> Tensor:
        r""":math:`B_{nm,i} = \sum_j S_{ij} a_{1,nj} a_{2,mj} + s_{b,i}`, shape ``(N1, N2, d_out)``.

        One GEMM of the element-wise products of input pairs with :math:`S^\top`; for a symmetric covariance only
        the pairs :math:`n \le m` are multiplied (half the cost) and mirrored, or, with ``upper_only`` (for a
        reader of the blocks :math:`n \le m` only: the symmetric :class:`_PairContraction`), left zero below."""
        n1, n2 = a1.shape[0], a2.shape[0]
        if vw is None:
            return vb.expand(d_out).expand(n1, n2, d_out)
        s = vw.expand(d_out, a1.shape[1])
        if symmetric:
            iu, ju = torch.triu_indices(n1, n1, device=a1.device)
            half = (a1.index_select(0, iu) * a1.index_select(0, ju)) @ s.T
            if vb is not None:
                half = half + vb
            full = half.new_zeros(n1 * n1, d_out)
            full = full.index_copy(0, iu * n1 + ju, half)
            if not upper_only:
                full = full.index_copy(0, ju * n1 + iu, half)
            return full.view(n1, n1, d_out)
        b = (a1[:, None, :] * a2[None, :, :]).reshape(n1 * n2, -1) @ s.T
        if vb is not None:
            b = b + vb
        return b.view(n1, n2, d_out)

    def _grid(self, f1: _Features, f2: _Features, variances: Params, symmetric: bool) -> Tensor:
        r""":math:`J(X_1) \operatorname{diag}(v) J(X_2)^\top`, ``(N1·C, N2·C)``, from the features of both
        input sets."""
        n1, c = f1.outputs.shape
        n2 = f2.outputs.shape[0]
        total = f1.outputs.new_zeros(n1 * c, n2 * c)
        for layer in self._plan.single:
            m = layer.name
            a1, a2, g1, g2 = f1.inputs[m], f2.inputs[m], f1.grads[m], f2.grads[m]
            d_out = g1.shape[-1]
            vw, vb = self._variances(variances, layer)
            if (vw is None or vw.dim() == 0) and (vb is None or vb.dim() == 0):
                # one variance per tensor: the NTK's form (a1·a2 v_w + v_b) ⊙ (γ1·γ2)
                factor = vw * (a1 @ a2.T) if vw is not None else a1.new_zeros(n1, n2)
                if vb is not None:
                    factor = factor + vb
                if symmetric:
                    gram = SymmetricGram.apply(g1.reshape(n1 * c, d_out))
                else:
                    gram = g1.reshape(n1 * c, d_out) @ g2.reshape(n2 * c, d_out).T
                total = total + (gram.view(n1, c, n2, c) * factor[:, None, :, None]).view(n1 * c, n2 * c)
                continue
            if unit_gradients(g1) and unit_gradients(g2):
                # the output layer: T_{nc,md} = δ_cd B_{nm,c}, no contraction
                b = self._weighted_inputs(a1, a2, vw, vb, d_out, symmetric)
                total = total + torch.diag_embed(b).transpose(1, 2).reshape(n1 * c, n2 * c)
                continue
            b = self._weighted_inputs(a1, a2, vw, vb, d_out, symmetric, upper_only=symmetric and c > 1)
            if c == 1:
                term = ((g1[:, 0, None, :] * b) * g2[None, :, 0, :]).sum(-1)
            else:
                term = PairContraction.apply(g1, b, g2, symmetric)  # (N1, C, N2·C)
            total = total + term.reshape(n1 * c, n2 * c)
        for n in f1.jacobians:
            v = variances[n]
            j1, j2 = f1.jacobians[n].flatten(0, 1), f2.jacobians[n].flatten(0, 1)
            total = total + (j1 * (v.reshape(-1) if v.dim() > 0 else v)) @ j2.T
        return total

    def blocks_from_features(self, feats: _Features, variances: Params, variances_only: bool = False) -> Tensor:
        r"""Per-point blocks :math:`J(x_n) \operatorname{diag}(v) J(x_n)^\top`, ``(N, C, C)`` (with
        ``variances_only``, their diagonals ``(N, C)``), from the features of ``x`` (:meth:`features`):
        :math:`\gamma_n \operatorname{diag}(S a_n^{\odot 2} + s_b) \gamma_n^\top` per linear layer, cost
        :math:`N d_\text{in} d_\text{out} + N C^2 d_\text{out}`."""
        n, c = feats.outputs.shape
        out = feats.outputs.new_zeros((n, c) if variances_only else (n, c, c))
        for layer in self._plan.single:
            a, g = feats.inputs[layer.name], feats.grads[layer.name]
            vw, vb = self._variances(variances, layer)
            weighted = g.new_zeros(n, g.shape[-1])
            if vw is not None:
                weighted = a.square() @ vw.expand(g.shape[-1], a.shape[1]).T  # (N, d_out)
            if vb is not None:
                weighted = weighted + vb
            if variances_only:
                out = out + (g.square() * weighted[:, None, :]).sum(-1)
            else:
                out = out + (g * weighted[:, None, :]) @ g.transpose(1, 2)
        for name in feats.jacobians:
            v = variances[name]
            j = feats.jacobians[name]
            v = v.reshape(-1) if v.dim() > 0 else v
            out = out + ((j.square() * v).sum(-1) if variances_only else (j * v) @ j.transpose(1, 2))
        return out

    # ------------------------------------------------------------------ public covariances
    def covariance_from_features(self, feats: _Features, variances: Params) -> Tensor:
        r""":math:`J(x) \operatorname{diag}(v) J(x)^\top` ``(N·C, N·C)`` from the features of ``x``
        (:meth:`features`)."""
        return self._grid(feats, feats, variances, symmetric=True)

    def jvp(self, feats: _Features, tangents: Params) -> Tensor:
        r""":math:`J_\theta(x) u` ``(N, C)`` for parameter-shaped tangents :math:`u`, from the features of ``x``:
        :math:`\gamma_{nc} \cdot (U a_n + u_b)` per linear layer, contracted Jacobians for the rest (no extra pass;
        differentiable in θ, :math:`u` and ``x`` when the features are)."""
        out = torch.zeros_like(feats.outputs)
        for layer in self._plan.single:
            a, g = feats.inputs[layer.name], feats.grads[layer.name]
            z = g.new_zeros(g.shape[0], g.shape[-1])
            if layer.weight is not None:
                z = a @ tangents[layer.weight].reshape(g.shape[-1], -1).T
            if layer.bias is not None:
                z = z + tangents[layer.bias]
            out = out + (g @ z[:, :, None]).squeeze(-1)
        for name, j in feats.jacobians.items():
            out = out + j @ tangents[name].reshape(-1)
        return out

    def covariance(
        self, params: Params, variances: Sequence[Params], x: Tensor, create_graph: bool = True
    ) -> tuple[Tensor, list[Tensor]]:
        r"""``f(x; θ)`` ``(N, C)`` and, for each variance set :math:`v`, :math:`J_\theta(x) \operatorname{diag}(v)
        J_\theta(x)^\top` of shape ``(N·C, N·C)`` in interleaved order; the features are computed once.

        Args:
            params: the weights θ, one tensor per trainable parameter name.
            variances: variance sets; each maps every parameter name to a tensor of its shape (element-wise)
                or a 0-dim tensor (one variance for the tensor: cheaper).
            x: inputs ``(N, ...)`` (already prepared).
            create_graph: keep the results differentiable in ``params``, ``variances`` and ``x``.
        """
        feats = self.features(params, x, create_graph)
        return feats.outputs, [self.covariance_from_features(feats, v) for v in variances]

    def cross_covariance(self, params: Params, variances: Params, x1: Tensor, x2: Tensor) -> Tensor:
        """:math:`J(x_1) \\operatorname{diag}(v) J(x_2)^\\top`, ``(N1·C, N2·C)``, by chunks of rows (temporaries of
        at most about 2²⁴ numbers per layer). Differentiable when gradients are enabled."""
        grad = torch.is_grad_enabled()
        f2 = self.features(params, x2, grad)
        c, n2 = f2.outputs.shape[1], x2.shape[0]
        width = max([1] + [f2.inputs[m].shape[1] + c * f2.grads[m].shape[2] for m in f2.inputs])
        step = max(1, min(self.chunk_size, 2**24 // (n2 * width)))
        rows = [self._grid(self.features(params, x1[s : s + step], grad), f2, variances, symmetric=False)
                for s in range(0, x1.shape[0], step)]
        return torch.cat(rows)

    def batched_covariance(
        self, params: Params, variances: Params, x1: Tensor, x2: Tensor | None = None
    ) -> Tensor:
        r""":math:`J(x_{1,b}) \operatorname{diag}(v) J(x_{2,b})^\top` for every batch element ``b``: inputs
        ``(*batch1, N1, D)`` and ``(*batch2, N2, D)`` (flat rows, batch shapes broadcast; ``x2=None``: the symmetric
        covariance of ``x1``), result ``(*batch, N1·C, N2·C)``. The features are computed once per row of each input
        (by chunks of about ``chunk_size`` rows; ``x2`` without batch dimensions, e.g. observed inputs, once for
        all elements), then each element's block from its rows: cost :math:`B N_1 N_2` pairs, never the pairs
        across elements. Differentiable when gradients are enabled."""
        grad = torch.is_grad_enabled()
        like = next(iter(params.values()))
        square = x2 is None
        x2 = x1 if square else x2
        batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
        (n1, d), n2 = x1.shape[-2:], x2.shape[-2]
        count1, count2 = math.prod(x1.shape[:-2]), math.prod(x2.shape[:-2])
        index1 = torch.arange(count1).view(x1.shape[:-2]).expand(batch).reshape(-1).tolist()
        index2 = torch.arange(count2).view(x2.shape[:-2]).expand(batch).reshape(-1).tolist()

        def features(x: Tensor, count: int, n: int, argument: str) -> list[_Features]:
            """One feature set per slice of ``x`` (slices grouped into chunks of about ``chunk_size`` rows)."""
            rows = self.prepare(x.reshape(count * n, d), like, argument)
            group = max(1, self.chunk_size // max(n, 1))
            out = []
            for s in range(0, count, group):
                e = min(s + group, count)
                feats = self.features(params, rows[s * n : e * n], grad)
                out.extend(feats.rows(k * n, (k + 1) * n) for k in range(e - s))
            return out

        f1 = features(x1, count1, n1, "x1")
        f2 = f1 if square else features(x2, count2, n2, "x2")
        blocks = [self._grid(f1[i], f2[j], variances, symmetric=square) for i, j in zip(index1, index2)]
        out = torch.stack(blocks)
        return out.view(*batch, *out.shape[-2:])

    def diag_blocks(self, params: Params, variances: Params, x: Tensor) -> tuple[Tensor, Tensor]:
        """``f(x; θ)`` ``(N, C)`` and the per-point blocks :math:`J(x_n) \\operatorname{diag}(v) J(x_n)^\\top`,
        ``(N, C, C)``, by chunks, never the ``(N·C)²`` matrix. Differentiable when gradients are enabled."""
        grad = torch.is_grad_enabled()
        outs, blocks = [], []
        for s in range(0, x.shape[0], self.chunk_size):
            feats = self.features(params, x[s : s + self.chunk_size], grad)
            outs.append(feats.outputs)
            blocks.append(self.blocks_from_features(feats, variances))
        return torch.cat(outs), torch.cat(blocks)
