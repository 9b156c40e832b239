r"""Outputs and covariances of a network linearized about arbitrary weights, with element-wise variances.

For weights :math:`\theta` and a diagonal weight covariance :math:`\operatorname{diag}(v)` the linearized
network :math:`f(x; \theta) + J_\theta(x)(\theta' - \theta)`, :math:`\theta' \sim N(\theta, \operatorname{diag}(v))`,
has the output covariance

.. math::
    \Sigma(x, x') = J_\theta(x) \operatorname{diag}(v) J_\theta(x')^\top \in \mathbb R^{C \times C},

an empirical NTK with one variance per weight (docs/fsvi.md, "The linearized covariance"). Unlike
:class:`ntkgp.NTKEngine`, which works at fixed trained weights with one precision per group, everything here is
a differentiable function of :math:`\theta` *and* :math:`v` (what FSVI trains), and :math:`J` is never formed
for ``nn.Linear`` layers:

* **structured route** (every ``nn.Linear`` layer ``z = W a + b`` called once per forward pass on ``(N, d_in)``
  inputs): with the back-propagated output gradients :math:`\gamma_{nc} = \partial f_c(x_n)/\partial z` and the
  layer inputs :math:`a_n`,

  .. math::
      \Sigma_{(n,c),(m,d)} \mathrel{+}= \sum_i \gamma_{nc,i}\, \gamma_{md,i}
          \Big(\sum_j S_{ij}\, a_{nj} a_{mj} + s_{b,i}\Big),

  for weight variances :math:`S` and bias variances :math:`s_b`. The bracket is one GEMM over the pairs
  :math:`(n, m)` (only :math:`n \le m` for a symmetric covariance), cost :math:`\tfrac12 N^2 d_\text{in} d_\text{out}`,
  then :math:`\tfrac12 (NC)^2 d_\text{out}` for the contraction with :math:`\gamma`. A variance that is one number
  per tensor costs only :math:`\tfrac12 N^2 d_\text{in} + \tfrac12 (NC)^2 d_\text{out}` (the NTK's form).
  ``a`` and :math:`\gamma` come from one forward pass with hooks and one batched backward pass over the ``C``
  outputs, built with ``create_graph`` so that :math:`\Sigma` is differentiable in :math:`\theta`.
* **contraction route** (every other parameter: convolutions, normalization layers, linear layers used more
  than once or with weights shared): per-example Jacobians by ``torch.func.vmap(jacrev)``, contracted.

Each linear layer is checked once, on a probe example, against autograd's Jacobian before it takes the
structured route.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from ..ntk import check_eval_mode, check_inputs, check_outputs

Params = Mapping[str, Tensor]


@dataclass
class _Plan:
    """Which parameters take the structured route (per ``nn.Linear`` module) and which are contracted."""

    structured: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> {"weight"|"bias": name}
    generic: list[str] = field(default_factory=list)
    num_outputs: int = 0


@dataclass
class _Features:
    """Everything the covariance needs at one set of inputs.

    ``inputs[m]`` is ``a`` ``(N, d_in)``, ``grads[m]`` is :math:`\\gamma` ``(N, C, d_out)`` per structured module;
    ``jacobians[name]`` is ``(N, C, numel)`` per contracted parameter.
    """

    outputs: Tensor
    inputs: dict[str, Tensor]
    grads: dict[str, Tensor]
    jacobians: dict[str, Tensor]


class LinearizedNetwork:
    """A network's outputs and linearized covariances :math:`J_\\theta \\operatorname{diag}(v) J_\\theta^\\top` at
    weights passed in, never the network's own.

    Args:
        net: any ``nn.Module`` mapping ``(N, *input_shape)`` to ``(N, C)``; BatchNorm and dropout must be in
            eval mode. Held by reference and never modified (hooks are attached only during a call).
        input_shape: shape of one input as the network expects it; inputs arriving as flat ``(N, D)``
            matrices (GPyTorch's convention) are reshaped to ``(N, *input_shape)``.
        strategy: ``"auto"`` (structured route for the linear layers that pass the probe check) or
            ``"contraction"`` (Jacobians for every parameter; the reference route).
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
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        check_eval_mode(net)
        named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("net has no trainable parameters (all have requires_grad=False)")
        self.net = net
        self.names: tuple[str, ...] = tuple(n for n, _ in named)
        self.shapes: dict[str, torch.Size] = {n: p.shape for n, p in named}
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.strategy = strategy
        self.chunk_size = int(chunk_size)
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
        check_inputs(x, argument)
        x = x.to(dtype=like.dtype, device=like.device) if x.is_floating_point() else x.to(device=like.device)
        if self.input_shape is not None and tuple(x.shape[1:]) != self.input_shape:
            if x.dim() == 2 and x.shape[1] == math.prod(self.input_shape):
                return x.reshape(x.shape[0], *self.input_shape)
            raise ValueError(
                f"{argument} must have shape (N, {', '.join(map(str, self.input_shape))}) or "
                f"(N, {math.prod(self.input_shape)}), got {tuple(x.shape)}"
            )
        return x

    def forward(self, params: Params, x: Tensor) -> Tensor:
        """``f(x; θ)`` of shape ``(N, C)`` for the trainable parameters ``params`` (differentiable in both)."""
        f = functional_call(self.net, dict(params), (x,))
        check_outputs(f, x.shape[0])
        return f

    def num_outputs(self, params: Params, x: Tensor) -> int:
        """C (one forward pass of ``x[:1]`` the first time)."""
        return self.plan(params, x).num_outputs

    # ------------------------------------------------------------------ which route for which parameter
    def _linear_candidates(self) -> dict[str, dict[str, str]]:
        """``nn.Linear`` modules whose trainable parameters are theirs alone (not shared with another module)."""
        owners: dict[int, int] = {}
        for _, module in self.net.named_modules(remove_duplicate=False):
            for p in module.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        trainable = set(self.names)
        candidates = {}
        for name, module in self.net.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            kinds = {}
            for kind in ("weight", "bias"):
                p = getattr(module, kind)
                full = f"{name}.{kind}" if name else kind
                if p is not None and full in trainable:
                    if owners.get(id(p), 0) != 1:
                        kinds = {}
                        break
                    kinds[kind] = full
            if kinds:
                candidates[name] = kinds
        return candidates

    def plan(self, params: Params, x: Tensor) -> _Plan:
        """Decide the route of every parameter, checked once on the probe ``x[:1]``."""
        if self._plan is not None:
            return self._plan
        candidates = {} if self.strategy == "contraction" else self._linear_candidates()
        probe = {n: p.detach().requires_grad_() for n, p in params.items()}
        with torch.enable_grad():
            feats, bad = self._capture(probe, x[:1], candidates, create_graph=False)
        structured = {m: kinds for m, kinds in candidates.items() if m not in bad}
        if structured:
            names = [n for kinds in structured.values() for n in kinds.values()]
            exact = self._jacobians(probe, x[:1], names)
            keep = {}
            for m, kinds in structured.items():
                a, gam = feats.inputs[m][0], feats.grads[m][0]  # (d_in,), (C, d_out)
                ok = True
                for kind, n in kinds.items():
                    approx = (gam[:, :, None] * a[None, None, :]).flatten(1) if kind == "weight" else gam
                    ref = exact[n][0]
                    tol = 1e-4 if ref.dtype == torch.float32 else 1e-9
                    ok &= bool(torch.allclose(approx, ref, rtol=tol, atol=tol * (1 + ref.abs().max().item())))
                if ok:
                    keep[m] = kinds
            structured = keep
        taken = {n for kinds in structured.values() for n in kinds.values()}
        self._plan = _Plan(structured, [n for n in self.names if n not in taken], feats.outputs.shape[1])
        return self._plan

    # ------------------------------------------------------------------ features
    def _capture(
        self, params: Params, x: Tensor, modules: Mapping[str, object], create_graph: bool
    ) -> tuple[_Features, set[str]]:
        """One forward pass with hooks (inputs ``a`` and outputs ``z`` of ``modules``) and one backward pass
        batched over the ``C`` outputs for :math:`\\gamma`. Returns the features and the modules that cannot
        take the structured route (called more than once, or not on ``(N, d)`` inputs)."""
        seen: dict[str, list[tuple[Tensor, Tensor]]] = {m: [] for m in modules}
        handles = []
        named = dict(self.net.named_modules())
        for m in modules:
            handles.append(named[m].register_forward_hook(lambda mod, inp, out, m=m: seen[m].append((inp[0], out))))
        try:
            f = self.forward(params, x)
        finally:
            for h in handles:
                h.remove()
        n, c = f.shape
        bad = {m for m, calls in seen.items() if len(calls) != 1 or calls[0][0].dim() != 2 or calls[0][0].shape[0] != n}
        good = [m for m in modules if m not in bad]
        inputs, grads = {}, {}
        if good:
            outs = [seen[m][0][1] for m in good]
            cot = torch.eye(c, dtype=f.dtype, device=f.device)[:, None, :].expand(c, n, c)
            gs = torch.autograd.grad(
                f, outs, cot, create_graph=create_graph, allow_unused=True, is_grads_batched=True
            )
            for m, g, z in zip(good, gs, outs):
                g = torch.zeros(c, *z.shape, dtype=z.dtype, device=z.device) if g is None else g
                inputs[m] = seen[m][0][0]
                grads[m] = g.transpose(0, 1)  # (N, C, d_out)
        return _Features(f, inputs, grads, {}), bad

    def _jacobians(self, params: Params, x: Tensor, names: Sequence[str]) -> dict[str, Tensor]:
        """Per-example Jacobians ``(N, C, numel)`` of the parameters ``names`` (differentiable in ``params``)."""
        if not names:
            return {}
        chosen = {n: params[n] for n in names}

        def single(sub: dict[str, Tensor], xi: Tensor) -> Tensor:
            return functional_call(self.net, {**params, **sub}, (xi.unsqueeze(0),)).squeeze(0)

        jac = vmap(jacrev(single), in_dims=(None, 0))(chosen, x)
        return {n: jac[n].reshape(x.shape[0], jac[n].shape[1], -1) for n in names}

    def features(self, params: Params, x: Tensor, create_graph: bool) -> _Features:
        """Outputs, layer features and contracted Jacobians at ``x`` (prepared inputs).

        With ``create_graph=True`` every result is differentiable in ``params`` (and ``x``); otherwise all are
        detached and ``params`` are only read.
        """
        plan = self.plan(params, x)
        with torch.enable_grad():
            if create_graph:
                params = {n: p if p.requires_grad else p.detach().requires_grad_() for n, p in params.items()}
            else:
                params = {n: p.detach().requires_grad_() for n, p in params.items()}
                x = x.detach()
            feats, bad = self._capture(params, x, plan.structured, create_graph)
            if bad:
                raise RuntimeError(
                    f"linear layers {sorted(bad)} behaved differently than on the probe example (called a different "
                    "number of times or on inputs of another shape); use strategy='contraction'"
                )
            feats.jacobians = self._jacobians(params, x, plan.generic)
        if not create_graph:
            feats = _Features(
                feats.outputs.detach(),
                {m: t.detach() for m, t in feats.inputs.items()},
                {m: t.detach() for m, t in feats.grads.items()},
                {n: t.detach() for n, t in feats.jacobians.items()},
            )
        return feats

    # ------------------------------------------------------------------ covariances from features
    @staticmethod
    def _weighted_inputs(a1: Tensor, a2: Tensor, vw: Tensor | None, vb: Tensor | None, d_out: int, symmetric: bool) -> Tensor:
        r""":math:`B_{nm,i} = \sum_j S_{ij} a_{1,nj} a_{2,mj} + s_{b,i}`, shape ``(N1, N2, d_out)``.

        One GEMM of the element-wise products of input pairs with :math:`S^\top`; for a symmetric covariance only
        the pairs :math:`n \le m` are multiplied (half the cost) and mirrored."""
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
            full = full.index_copy(0, iu * n1 + ju, half).index_copy(0, ju * n1 + iu, half)
            return full.view(n1, n1, d_out)
        b = (a1[:, None, :] * a2[None, :, :]).reshape(n1 * n2, -1) @ s.T
        if vb is not None:
            b = b + vb
        return b.view(n1, n2, d_out)

    def _grid(self, f1: _Features, f2: _Features, variances: Params, symmetric: bool) -> Tensor:
        r""":math:`J(X_1) \operatorname{diag}(v) J(X_2)^\top`, ``(N1·C, N2·C)``, from the features of both input sets."""
        plan = self._plan
        n1, c = f1.outputs.shape
        n2 = f2.outputs.shape[0]
        total = f1.outputs.new_zeros(n1 * c, n2 * c)
        for m, kinds in plan.structured.items():
            a1, a2, g1, g2 = f1.inputs[m], f2.inputs[m], f1.grads[m], f2.grads[m]
            d_out = g1.shape[-1]
            vw = variances[kinds["weight"]] if "weight" in kinds else None
            vb = variances[kinds["bias"]] if "bias" in kinds else None
            if (vw is None or vw.dim() == 0) and (vb is None or vb.dim() == 0):
                # one variance per tensor: the NTK's form (a1·a2 v_w + v_b) ⊙ (γ1·γ2)
                factor = vw * (a1 @ a2.T) if vw is not None else a1.new_zeros(n1, n2)
                if vb is not None:
                    factor = factor + vb
                gram = (g1.reshape(n1 * c, d_out) @ g2.reshape(n2 * c, d_out).T).view(n1, c, n2, c)
                total = total + (gram * factor[:, None, :, None]).view(n1 * c, n2 * c)
                continue
            b = self._weighted_inputs(a1, a2, vw, vb, d_out, symmetric)  # (N1, N2, d_out)
            if c == 1:
                term = ((g1[:, 0, None, :] * b) * g2[None, :, 0, :]).sum(-1)
            else:
                u = b[:, :, None, :] * g2[None, :, :, :]  # (N1, N2, C, d_out)
                term = torch.bmm(g1, u.reshape(n1, n2 * c, d_out).transpose(1, 2))  # (N1, C, N2·C)
            total = total + term.reshape(n1 * c, n2 * c)
        for n in plan.generic:
            v = variances[n]
            j1, j2 = f1.jacobians[n].flatten(0, 1), f2.jacobians[n].flatten(0, 1)
            total = total + (j1 * (v.reshape(-1) if v.dim() > 0 else v)) @ j2.T
        return total

    def _diag(self, feats: _Features, variances: Params) -> Tensor:
        r"""Per-point blocks :math:`J(x_n) \operatorname{diag}(v) J(x_n)^\top`, ``(N, C, C)``."""
        n, c = feats.outputs.shape
        out = feats.outputs.new_zeros(n, c, c)
        for m, kinds in self._plan.structured.items():
            a, g = feats.inputs[m], feats.grads[m]
            vw = variances[kinds["weight"]] if "weight" in kinds else None
            vb = variances[kinds["bias"]] if "bias" in kinds else None
            weighted = g.new_zeros(n, g.shape[-1])
            if vw is not None:
                weighted = a.square() @ vw.expand(g.shape[-1], a.shape[1]).T  # (N, d_out)
            if vb is not None:
                weighted = weighted + vb
            out = out + (g * weighted[:, None, :]) @ g.transpose(1, 2)
        for name in self._plan.generic:
            v = variances[name]
            j = feats.jacobians[name]
            out = out + (j * (v.reshape(-1) if v.dim() > 0 else v)) @ j.transpose(1, 2)
        return out

    # ------------------------------------------------------------------ public covariances
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
        return feats.outputs, [self._grid(feats, feats, v, symmetric=True) for v in variances]

    def cross_covariance(self, params: Params, variances: Params, x1: Tensor, x2: Tensor) -> Tensor:
        """:math:`J(x_1) \\operatorname{diag}(v) J(x_2)^\\top`, ``(N1·C, N2·C)``, by chunks of rows (temporaries of
        at most about 2²⁴ numbers per layer). Differentiable when gradients are enabled."""
        grad = torch.is_grad_enabled()
        f2 = self.features(params, x2, grad)
        c, n2 = f2.outputs.shape[1], x2.shape[0]
        width = max([1] + [f2.inputs[m].shape[1] + c * f2.grads[m].shape[2] for m in self._plan.structured])
        step = max(1, min(self.chunk_size, 2**24 // (n2 * width)))
        rows = [self._grid(self.features(params, x1[s : s + step], grad), f2, variances, symmetric=False)
                for s in range(0, x1.shape[0], step)]
        return torch.cat(rows)

    def diag_blocks(self, params: Params, variances: Params, x: Tensor) -> tuple[Tensor, Tensor]:
        """``f(x; θ)`` ``(N, C)`` and the per-point blocks :math:`J(x_n) \\operatorname{diag}(v) J(x_n)^\\top`,
        ``(N, C, C)``, by chunks, never the ``(N·C)²`` matrix. Differentiable when gradients are enabled."""
        grad = torch.is_grad_enabled()
        outs, blocks = [], []
        for s in range(0, x.shape[0], self.chunk_size):
            feats = self.features(params, x[s : s + self.chunk_size], grad)
            outs.append(feats.outputs)
            blocks.append(self._diag(feats, variances))
        return torch.cat(outs), torch.cat(blocks)
