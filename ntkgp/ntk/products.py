r"""Products with the NTK's Jacobian at fixed weights and inputs, :math:`J^\top v` and :math:`J u`, without a
Jacobian: the one matrix-free implementation (the engine's ``vjp``/``jvp``/``matvec`` and the matrix-free
evidence, :mod:`ntkgp.laplace.function_space.matrix_free`, which multiplies by :math:`K = J P_0^{-1} J^\top`
hundreds of times at the same :math:`\theta^*` and :math:`X`).

:class:`NTKProducts` prepares once what the products need and then applies them as a few matrix products per
layer (``docs/math.md``, "Structured form"):

* the layer plan's single-location layers (``nn.Linear`` on ``(N, d)`` inputs): their layer inputs
  :math:`a_n` and back-propagated output gradients :math:`\Gamma_{nc} = \partial f_c(x_n)/\partial z_n` are
  computed once and kept, and

  .. math::
      J_W^\top v = \sum_n \Big(\sum_c v_{nc}\Gamma_{nc}\Big) a_n^\top, \qquad
      (J_W U)_{nc} = \Gamma_{nc}^\top U a_n, \qquad
      J_b^\top v = \sum_{n,c} v_{nc}\Gamma_{nc}, \qquad (J_b u)_{nc} = \Gamma_{nc}^\top u,

  one GEMM over all examples each (memory :math:`N(C\sum_l d^{out}_l + \sum_l d^{in}_l)` numbers);
* every other parameter (convolutions, normalization layers, anything the safety rule leaves out; every
  parameter for a plan without layers, the engine's one-shot products): one ``torch.func.vjp`` /
  ``torch.func.jvp`` pass per chunk of examples, restricted to those parameters (memory
  :math:`O(\text{chunk}\cdot(\text{activations} + k P))`; :meth:`NetworkCore.vjp_columns
  <ntkgp.ntk.network.NetworkCore.vjp_columns>`, :meth:`NetworkCore.jvp_dict <ntkgp.ntk.network.NetworkCore.jvp_dict>`,
  on ntkgp's private copy of the network, by reverse over reverse for a network without forward-mode derivatives).

Tangents in parameter space are lists with one ``(numel, k)`` tensor per parameter of :math:`\theta`, in the
order of ``core.names``. Rows are in GPyTorch's interleaved order ``n·C + c``. Inputs that require grad keep
their graph through every product when ``graph`` is set (second-order autograd through the features).
"""

from __future__ import annotations

import torch
from torch import Tensor
from ..memory import GRAM_BLOCK_BYTES, chunk_rows
from .feature_pass import FeatureSet
from .layer_plan import LayerPlan
from .network import NetworkCore
from .inputs import detach, num_rows
from .inputs import rows as take_rows

__all__ = ["NTKProducts"]

#: Bytes per temporary in a structured product (rows are processed in blocks below this size;
#: :data:`ntkgp.memory.GRAM_BLOCK_BYTES`).
BLOCK_BYTES = GRAM_BLOCK_BYTES


class NTKProducts:
    r"""Per-parameter products :math:`J(X)^\top v` and :math:`J(X) u` of a network at its current weights.

    Built once for fixed weights and inputs (the layer features of the single-location layers are computed
    and kept); the network is never modified, and later changes of its weights are not seen (build a new one).
    Made by :meth:`ntkgp.ntk.NTKEngine.products`.

    Args:
        core: the network.
        plan: its layer plan for ``x`` (which layers take the structured form).
        x: prepared inputs ``(N, ...)``.
        graph: keep the graph to ``x`` (otherwise ``x`` and everything kept are detached).
        engine: the engine that made it, kept as :attr:`engine` (for its Grams at ``x``).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> from ntkgp.ntk import NTKEngine
        >>> products = NTKEngine(net).products(torch.randn(5, 3))
        >>> products.matvec(torch.randn(10, 4), torch.ones(2)).shape
        torch.Size([10, 4])
    """

    def __init__(self, core: NetworkCore, plan: LayerPlan, x: Tensor, graph: bool = False, engine=None) -> None:
        self.core = core
        self.engine = engine
        self.graph = graph
        self.x = x if graph else detach(x)
        self.num_data = num_rows(x)
        self.num_outputs = core.num_outputs(x)
        self.names = core.names
        self.shapes = core.shapes
        self.group_of = core.groups.group_of
        self.num_groups = core.groups.num_groups
        index = {n: i for i, n in enumerate(self.names)}
        n, c = self.num_data, self.num_outputs
        self.layers: list[tuple[Tensor, Tensor, int | None, int | None]] = []
        if plan.single:
            with torch.set_grad_enabled(graph and torch.is_grad_enabled()):
                feats = FeatureSet(core, plan, self.x, graph, columns=False)
            for layer in plan.single:
                gam = feats.grads[layer.name].reshape(n, c, -1)
                kinds = [index.get(layer.weight), index.get(layer.bias)]
                self.layers.append((feats.inputs[layer.name], gam, *kinds))
        #: Preconditioner sketches kept for later hyperparameter steps (:func:`ntkgp.laplace.function_space.matrix_free_log_det`).
        self.sketches: dict = {}
        covered = {n for layer in plan.single for n in layer.parameter_names}
        self.generic = [i for i, name in enumerate(self.names) if name not in covered]

    # ------------------------------------------------------------------ sizes
    @property
    def num_rows(self) -> int:
        """``N·C``."""
        return self.num_data * self.num_outputs

    @property
    def dtype(self) -> torch.dtype:
        return self.core.dtype

    @property
    def device(self) -> torch.device:
        return self.core.device

    def feature_numbers(self) -> int:
        """How many numbers the kept layer features hold: :math:`N (C \\sum d^{out} + \\sum d^{in})`."""
        return sum(a.numel() + g.numel() for a, g, _, _ in self.layers)

    def _blocks(self, width: int):
        rows = chunk_rows(BLOCK_BYTES, width, self.dtype)
        for s in range(0, self.num_data, rows):
            yield s, min(s + rows, self.num_data)

    # ------------------------------------------------------------------ products
    def transpose(self, v: Tensor) -> list[Tensor]:
        r""":math:`J^\top v` for ``v`` of shape ``(N·C, k)``: one ``(numel, k)`` tensor per parameter."""
        n, c = self.num_data, self.num_outputs
        k = v.shape[-1]
        vv = v.reshape(n, c, k).to(dtype=self.dtype, device=self.device)
        out: list[Tensor | None] = [None] * len(self.names)
        for a, gam, wi, bi in self.layers:
            d_in, d_out = a.shape[1], gam.shape[2]
            w = torch.zeros(d_in, d_out * k, dtype=self.dtype, device=self.device) if wi is not None else None
            b = torch.zeros(d_out, k, dtype=self.dtype, device=self.device) if bi is not None else None
            for s, e in self._blocks(max(d_out, d_in) * k):
                g = torch.bmm(gam[s:e].transpose(1, 2), vv[s:e])  # (n_b, d_out, k): Σ_c v_nc Γ_nc
                if w is not None:
                    w.addmm_(a[s:e].T, g.reshape(e - s, d_out * k))
                if b is not None:
                    b += g.sum(0)
            if w is not None:
                out[wi] = w.view(d_in, d_out, k).transpose(0, 1).reshape(d_out * d_in, k)
            if b is not None:
                out[bi] = b
        if self.generic:
            for i, t in zip(self.generic, self._generic_transpose(vv)):
                out[i] = t
        return out  # type: ignore[return-value]

    def apply(self, u: list[Tensor | None]) -> Tensor:
        r""":math:`J u` for per-parameter tangents ``(numel, k)`` (as :meth:`transpose` returns): ``(N·C, k)``.

        An entry ``None`` stands for a zero tangent (its layer is skipped).
        """
        n, c = self.num_data, self.num_outputs
        k = next(t for t in u if t is not None).shape[-1]
        out = torch.zeros(n, c, k, dtype=self.dtype, device=self.device)
        for a, gam, wi, bi in self.layers:
            d_in, d_out = a.shape[1], gam.shape[2]
            tw = u[wi] if wi is not None else None
            tb = u[bi] if bi is not None else None
            if tw is None and tb is None:
                continue
            w = tw.to(a).reshape(d_out, d_in, k).transpose(0, 1).reshape(d_in, d_out * k) if tw is not None else None
            b = tb.to(a).reshape(1, d_out, k) if tb is not None else None
            for s, e in self._blocks(max(d_out, d_in) * k):
                if w is not None:
                    z = (a[s:e] @ w).view(e - s, d_out, k)
                    z = z + b if b is not None else z
                else:
                    z = b.expand(e - s, d_out, k)
                out[s:e].baddbmm_(gam[s:e], z)
        if self.generic and any(u[i] is not None for i in self.generic):
            zeros = [
                torch.zeros(self.core.numels[i], k, dtype=self.dtype, device=self.device) for i in self.generic
            ]
            tangents = [z if u[i] is None else u[i] for i, z in zip(self.generic, zeros)]
            out += self._generic_apply(tangents).view(n, c, k)
        return out.view(n * c, k)

    def weighted(self, t: list[Tensor], weights: Tensor) -> list[Tensor]:
        """Each parameter's tangent times the weight of its group (``weights`` of shape ``(G,)``)."""
        w = weights.to(dtype=self.dtype, device=self.device)
        return [ti * w[g] for ti, g in zip(t, self.group_of)]

    def group_part(self, t: list[Tensor], group: int) -> list[Tensor | None]:
        """The tangents of the parameters of one group (``None`` for the others), for :meth:`apply`."""
        return [ti if g == group else None for ti, g in zip(t, self.group_of)]

    def matvec(self, v: Tensor, weights: Tensor) -> Tensor:
        r""":math:`\sum_g w_g J_g J_g^\top v` for ``v`` ``(N·C, k)`` and group weights ``(G,)`` (e.g. :math:`1/\delta`)."""
        return self.apply(self.weighted(self.transpose(v), weights))

    def group_inner(self, s: list[Tensor], t: list[Tensor]) -> Tensor:
        r""":math:`\sum_{p \in g} \langle s_p, t_p \rangle` per group, shape ``(G,)`` (summed over the ``k`` columns)."""
        out = torch.zeros(self.num_groups, dtype=self.dtype, device=self.device)
        for si, ti, g in zip(s, t, self.group_of):
            out[g] += (si * ti).sum()
        return out

    # ------------------------------------------------------------------ generic parameters (torch.func)
    def _generic_transpose(self, vv: Tensor) -> list[Tensor]:
        names = [self.names[i] for i in self.generic]
        k = vv.shape[-1]
        total = None
        for s, e in self.core.chunks(self.num_data, "J^T v"):
            grads = self.core.vjp_columns(take_rows(self.x, s, e), names, vv[s:e])
            grads = {name: g.reshape(-1, k) for name, g in grads.items()}
            total = grads if total is None else {name: total[name] + grads[name] for name in total}
        return [total[name] for name in names]

    def _generic_apply(self, u: list[Tensor]) -> Tensor:
        k = u[0].shape[-1]
        tangents = {  # (k, *shape): one tangent per column
            self.names[i]: t.to(dtype=self.dtype, device=self.device).T.reshape(k, *self.shapes[i])
            for i, t in zip(self.generic, u)
        }
        rows = [self.core.jvp_dict(take_rows(self.x, s, e), tangents)[1].permute(1, 2, 0)
                for s, e in self.core.chunks(self.num_data, "J u")]
        return torch.cat(rows).reshape(-1, k)
