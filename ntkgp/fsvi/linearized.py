r"""Outputs and covariances of a network linearized about arbitrary weights, with element-wise variances.

For weights :math:`\theta` and a diagonal weight covariance :math:`\operatorname{diag}(v)` the linearized
network :math:`f(x; \theta) + J_\theta(x)(\theta' - \theta)`, :math:`\theta' \sim N(\theta, \operatorname{diag}(v))`,
has the output covariance

.. math::
    \Sigma(x, x') = J_\theta(x) \operatorname{diag}(v) J_\theta(x')^\top \in \mathbb R^{C \times C},

an empirical NTK with one variance per weight (docs/fsvi.md, "The linearized covariance"). Unlike
:class:`ntkgp.NTKEngine`, which works at fixed trained weights with one precision per group, everything here is
a differentiable function of :math:`\theta` *and* :math:`v` (what FSVI trains). It uses the NTK engine's layer
features (:mod:`ntkgp.ntk.features`, with ``graph=True``), so :math:`J` is never formed for linear layers:

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
* **every other parameter** (normalization layers, layers that fail the engine's safety rule): per-example
  Jacobians by ``torch.func.vmap(jacrev)``, contracted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..ntk import check_eval_mode, check_outputs
from ..ntk.checks import prepare_inputs
from ..ntk.features import Layer, candidate_layers, layer_features, layer_jacobians, verify_layers
from ..ntk.functional import forward, per_example_jacobians

Params = Mapping[str, Tensor]


class _PairContraction(torch.autograd.Function):
    r""":math:`T_{n c, m d} = \sum_i \gamma_{1, n c i} B_{n m i} \gamma_{2, m d i}` as ``(N1, C, N2·C)``, by chunks of
    columns ``m``, every step a batched matrix product over ``m``.

    With :math:`W_{m, nc, i} = \gamma_{1, nci} B_{nmi}` (one element-wise product per chunk, from
    :math:`B^\top` transposed once), :math:`T_{\cdot, m \cdot}^\top = \gamma_{2, m} W_m^\top` is a product of a
    ``(C, d_out)`` and a ``(d_out, N1·C)`` matrix for each ``m`` (``C`` rows: the other way round, ``C`` columns,
    is several times slower on a CPU). The backward pass uses the same shapes: with the output gradient
    :math:`\bar T_m^\top` ``(C, N1·C)``, :math:`\bar\gamma_{2, m} = \bar T_m^\top W_m`,
    :math:`V_m = \bar T_m \gamma_{2, m}` and then :math:`\bar B_{nmi} = \sum_c \gamma_{1,nci} V_{m,nci}` and
    :math:`\bar\gamma_{1,nci} = \sum_m B_{nmi} V_{m,nci}`. Autograd through a broadcast product would keep the
    ``N1·N2·C·d_out`` product for the backward pass and reduce over the broadcast dimensions there, which on a
    CPU is memory-bound and dominated FSVI's step.

    ``symmetric=True`` (the same :math:`\gamma` on both sides, ``B`` symmetric: a covariance) reads only the
    blocks :math:`n \le m` of ``B`` (the lower ones may be left zero; they receive no gradient) and computes
    :math:`T = T' + T'^\top` with :math:`T'` the contraction of :math:`B'_{nm} = B_{nm}` for :math:`n < m`,
    :math:`\tfrac12 B_{nn}` on the diagonal and 0 below (:math:`B = B' + B'^\top`, :math:`T` is linear in
    :math:`B` and :math:`T(B'^\top) = T(B')^\top`): only the blocks :math:`n \le m` are contracted (half the
    work, forward and backward); the backward pass is that of :math:`T'` for :math:`\bar T' = \bar T + \bar T^\top`.
    First-order only (FSVI needs the gradient of its objective, not its Hessian)."""

    # elements of one chunk's W (1 MiB in float32). Per-chunk overhead against keeping W in cache: 2¹⁸ was
    # fastest for K = 32, C = 10, d_out = 256 on a 2-core CPU (one thread), 2¹⁹ close
    CHUNK_ELEMENTS = 2**18

    @staticmethod
    def _chunk(n1: int, c: int, d_out: int) -> int:
        return max(1, _PairContraction.CHUNK_ELEMENTS // (n1 * c * d_out))

    @staticmethod
    def _upper(n: int, like: Tensor) -> Tensor:
        """The factors of :math:`B'` ``(n, n, 1)``: 1 for ``n < m``, ½ for ``n = m``, 0 for ``n > m``."""
        ones = torch.ones(n, n, dtype=like.dtype, device=like.device)
        return (ones.triu(1) + 0.5 * torch.eye(n, dtype=like.dtype, device=like.device))[:, :, None]

    @staticmethod
    def forward(ctx, g1: Tensor, b: Tensor, g2: Tensor, symmetric: bool = False) -> Tensor:
        n1, c, d_out = g1.shape
        n2 = g2.shape[0]
        bt = (b * _PairContraction._upper(n1, b) if symmetric else b).transpose(0, 1).contiguous()  # (N2, N1, d)
        out = (g1.new_zeros if symmetric else g1.new_empty)(n2, c, n1 * c)  # Tᵀ (T'ᵀ), [m, d, (n, c)]
        step = _PairContraction._chunk(n1, c, d_out)
        for s in range(0, n2, step):
            e = min(s + step, n2)
            r = e if symmetric else n1  # rows n < e hold the blocks n ≤ m
            w = (g1[None, :r] * bt[s:e, :r, None, :]).view(e - s, r * c, d_out)  # W_m
            out[s:e, :, : r * c] = torch.bmm(g2[s:e], w.transpose(1, 2))
        ctx.save_for_backward(g1, bt, g2)
        ctx.symmetric = symmetric
        out = out.view(n2 * c, n1 * c)
        return (out + out.T if symmetric else out.T.contiguous()).view(n1, c, n2 * c)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        g1, bt, g2 = ctx.saved_tensors
        symmetric = ctx.symmetric
        n1, c, d_out = g1.shape
        n2 = g2.shape[0]
        need_g1, need_b, need_g2 = ctx.needs_input_grad[:3]
        grad = grad.reshape(n1 * c, n2 * c)
        # T̄ᵀ (T̄'ᵀ when symmetric), [m, d, (n, c)]
        grad = (grad + grad.T if symmetric else grad.T.contiguous()).view(n2, c, n1 * c)
        grad_g1 = g1.new_zeros(n1, c, d_out) if need_g1 else None
        grad_bt = (bt.new_zeros if symmetric else bt.new_empty)(bt.shape) if need_b else None
        grad_g2 = torch.empty_like(g2) if need_g2 else None
        step = _PairContraction._chunk(n1, c, d_out)
        for s in range(0, n2, step):
            e = min(s + step, n2)
            k, r = e - s, (e if symmetric else n1)
            gm = grad[s:e, :, : r * c]  # T̄_mᵀ, (k, C, r·C)
            if need_g2:
                w = (g1[None, :r] * bt[s:e, :r, None, :]).view(k, r * c, d_out)
                grad_g2[s:e] = torch.bmm(gm, w)
            if need_g1 or need_b:
                v = torch.bmm(gm.transpose(1, 2), g2[s:e]).view(k, r, c, d_out)  # V_m
                if need_b:
                    grad_bt[s:e, :r] = (v * g1[None, :r]).sum(2)
                if need_g1:
                    grad_g1[:r] += (v * bt[s:e, :r, None, :]).sum(0)
        grad_b = None
        if need_b:
            grad_b = grad_bt.transpose(0, 1)
            grad_b = grad_b * _PairContraction._upper(n1, grad_b) if symmetric else grad_b.contiguous()
        return grad_g1, grad_b, grad_g2, None


class _SymmetricGram(torch.autograd.Function):
    r""":math:`X X^\top` with the backward pass :math:`\bar X = (\bar G + \bar G^\top) X`: one product, where
    autograd through ``x @ x.T`` takes one for each of the two operands."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x @ x.T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return (grad + grad.T) @ x


def _unit_gradients(g: Tensor) -> bool:
    r"""Whether the output gradients ``(N, C, d_out)`` are the unit vectors, :math:`\gamma_{nci} = \delta_{ci}`: those
    of the network's output layer (``f = z``), constants without a graph."""
    _, c, d_out = g.shape
    unit = torch.eye(c, dtype=g.dtype, device=g.device)
    return d_out == c and not g.requires_grad and torch.equal(g, unit.expand_as(g))


@dataclass
class _Plan:
    """The route of every parameter: linear layers in pair form, layers whose Jacobian blocks come from their
    features, and parameters contracted from ``vmap(jacrev)`` Jacobians."""

    layers: list[Layer] = field(default_factory=list)  # every verified layer (features are computed for these)
    pairs: list[Layer] = field(default_factory=list)  # the linear layers with one location: pair form
    generic: list[str] = field(default_factory=list)
    num_outputs: int = 0


@dataclass
class _Features:
    """Everything the covariance needs at one set of inputs.

    ``inputs[m]`` is ``a`` ``(N, d_in)`` and ``grads[m]`` is :math:`\\gamma` ``(N, C, d_out)`` per pair-form
    layer; ``jacobians[name]`` is ``(N, C, numel)`` per other parameter.
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
        strategy: ``"auto"`` (layer features for the linear and convolution layers that pass the engine's
            safety rule) or ``"contraction"`` (Jacobians for every parameter; the reference route).
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
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        check_eval_mode(net)
        named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("net has no trainable parameters (all have requires_grad=False)")
        self.net = net
        self.names: tuple[str, ...] = tuple(n for n, _ in named)
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.strategy = strategy
        self.chunk_size = chunk_size
        self._plan: _Plan | None = None

    def __deepcopy__(self, memo: dict) -> LinearizedNetwork:
        # A copy of a model refers to the same user network: never duplicate it.
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        memo[id(self)] = new
        return new

    # ------------------------------------------------------------------ inputs and outputs
    def prepare(self, x: Tensor, like: Tensor, argument: str = "x") -> Tensor:
        """Check ``x`` and bring it to the dtype and device of ``like`` and to the network's input shape."""
        return prepare_inputs(x, argument, like.dtype, like.device, self.input_shape)

    def forward(self, params: Params, x: Tensor) -> Tensor:
        """``f(x; θ)`` of shape ``(N, C)`` for the trainable parameters ``params`` (differentiable in both)."""
        f = forward(self.net, dict(params), x)
        check_outputs(f, x.shape[0])
        return f

    def num_outputs(self, params: Params, x: Tensor) -> int:
        """C (one forward pass of ``x[:1]`` the first time)."""
        return self.plan(params, x).num_outputs

    def plan(self, params: Params, x: Tensor) -> _Plan:
        """Decide the route of every parameter, checked once on the probe ``x[:1]`` (the engine's safety rule)."""
        if self._plan is not None:
            return self._plan
        detached = {n: p.detach() for n, p in params.items()}
        with torch.no_grad():
            c = self.forward(detached, x[:1]).shape[1]
        layers = []
        if self.strategy == "auto":
            layers, _ = candidate_layers(self.net, self.names)
            layers, locations, _ = verify_layers(self.net, detached, layers, x[:1])
        pairs = [la for la in layers if isinstance(la.module, nn.Linear) and locations[la.name] == 1]
        taken = {n for la in layers for n in la.parameter_names}
        self._plan = _Plan(layers, pairs, [n for n in self.names if n not in taken], c)
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
        feats = layer_features(self.net, dict(params), plan.layers, x, graph=create_graph)
        outputs = feats.outputs
        inputs, grads, jacobians = {}, {}, {}
        pair_names = {la.name for la in plan.pairs}
        for layer in plan.layers:
            a, g = feats.inputs[layer.name], feats.grads[layer.name]  # (N, d_in, T), (N, C, d_out, T)
            if layer.name in pair_names:
                inputs[layer.name], grads[layer.name] = a[..., 0], g[..., 0]
            else:
                jacobians.update(layer_jacobians(layer, a, g))
        if plan.generic:
            with torch.set_grad_enabled(create_graph and torch.is_grad_enabled()):
                jacobians.update(per_example_jacobians(self.net, dict(params), x, plan.generic))
        return _Features(outputs, inputs, grads, jacobians)

    def _variances(self, variances: Params, layer: Layer) -> tuple[Tensor | None, Tensor | None]:
        return (None if layer.weight is None else variances[layer.weight],
                None if layer.bias is None else variances[layer.bias])

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
        for layer in self._plan.pairs:
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
                    gram = _SymmetricGram.apply(g1.reshape(n1 * c, d_out))
                else:
                    gram = g1.reshape(n1 * c, d_out) @ g2.reshape(n2 * c, d_out).T
                total = total + (gram.view(n1, c, n2, c) * factor[:, None, :, None]).view(n1 * c, n2 * c)
                continue
            if _unit_gradients(g1) and _unit_gradients(g2):
                # the output layer: T_{nc,md} = δ_cd B_{nm,c}, no contraction
                b = self._weighted_inputs(a1, a2, vw, vb, d_out, symmetric)
                total = total + torch.diag_embed(b).transpose(1, 2).reshape(n1 * c, n2 * c)
                continue
            b = self._weighted_inputs(a1, a2, vw, vb, d_out, symmetric, upper_only=symmetric and c > 1)
            if c == 1:
                term = ((g1[:, 0, None, :] * b) * g2[None, :, 0, :]).sum(-1)
            else:
                term = _PairContraction.apply(g1, b, g2, symmetric)  # (N1, C, N2·C)
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
        for layer in self._plan.pairs:
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
        for layer in self._plan.pairs:
            a, g = feats.inputs[layer.name], feats.grads[layer.name]
            z = g.new_zeros(g.shape[0], g.shape[-1])
            if layer.weight is not None:
                z = a @ tangents[layer.weight].T
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
