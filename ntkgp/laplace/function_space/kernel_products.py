r"""Products with the NTK at fixed weights and inputs, :math:`J^\top v` and :math:`J u`, without a Jacobian.

The matrix-free evidence (:mod:`ntkgp.laplace.function_space.matrix_free`) multiplies by :math:`K = J P_0^{-1} J^\top`
hundreds of times at the same :math:`\theta^*` and :math:`X`. :class:`NTKProducts` prepares once what these
products need and then applies them as a few matrix products per layer (``docs/math.md``, "Structured form"):

* ``nn.Linear`` layers with one location per example (the engine's factored layers): their layer inputs
  :math:`a_n` and back-propagated output gradients :math:`\Gamma_{nc} = \partial f_c(x_n)/\partial z_n` are
  computed once and kept, and

  .. math::
      J_W^\top v = \sum_n \Big(\sum_c v_{nc}\Gamma_{nc}\Big) a_n^\top, \qquad
      (J_W U)_{nc} = \Gamma_{nc}^\top U a_n, \qquad
      J_b^\top v = \sum_{n,c} v_{nc}\Gamma_{nc}, \qquad (J_b u)_{nc} = \Gamma_{nc}^\top u,

  one GEMM over all examples each (memory :math:`N(C\sum_l d^{out}_l + \sum_l d^{in}_l)` numbers);
* every other parameter (convolutions, normalization layers, anything the engine's safety rule leaves out):
  one ``torch.func.vjp`` / ``torch.func.jvp`` pass per chunk of examples, restricted to those parameters
  (memory :math:`O(\text{chunk}\cdot(\text{activations} + k P))`).

Tangents in parameter space are lists with one ``(numel, k)`` tensor per trainable parameter, in the order
of the engine's groups (``engine.groups.names``). Rows are in GPyTorch's interleaved order ``n·C + c``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import jvp as func_jvp
from torch.func import vjp as func_vjp
from torch.func import vmap

from ...ntk import NTKEngine, structured
from ...ntk.functional import forward

__all__ = ["NTKProducts"]

#: Numbers per temporary in a structured product (rows are processed in blocks below this size).
BLOCK_ELEMENTS = 1 << 24


class NTKProducts:
    r"""Per-parameter products :math:`J(X)^\top v` and :math:`J(X) u` of a network at its current weights.

    Built once for fixed weights and inputs (the layer features of the structured layers are computed and
    kept); the network is never modified, and later changes of its weights are not seen (build a new one).

    Args:
        engine: the NTK engine of the network (its plan decides which layers are structured).
        x: the inputs ``(N, ...)`` (flat ``(N, D)`` when the engine has an ``input_shape``); no graph is kept.

    Raises:
        ValueError: for invalid inputs (see :meth:`ntkgp.ntk.NTKEngine.prepare`).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> products = NTKProducts(NTKEngine(net), torch.randn(5, 3))
        >>> products.matvec(torch.randn(10, 4), torch.ones(2)).shape
        torch.Size([10, 4])
    """

    def __init__(self, engine: NTKEngine, x: Tensor) -> None:
        if not isinstance(engine, NTKEngine):
            raise TypeError(f"engine must be an ntkgp.ntk.NTKEngine, got {type(engine).__name__}")
        x = engine.prepare(x).detach()
        self.engine = engine
        self.x = x
        self.num_data = x.shape[0]
        self.num_outputs = engine.num_outputs(x)
        self.names = engine.groups.names
        self.shapes = engine.groups.shapes
        self.group_of = engine.groups.group_of
        self.num_groups = engine.num_groups
        plan = engine.plan(x)
        n, c = self.num_data, self.num_outputs
        self.layers: list[tuple[Tensor, Tensor, int | None, int | None]] = []
        if plan.factored:
            with torch.no_grad():
                _, feats = structured.factored_features(engine, x, plan)
            for m in plan.factored:
                kinds = plan.structured[m]
                gam = feats.grads[m].detach().reshape(n, c, -1)
                self.layers.append((feats.inputs[m].detach(), gam, kinds.get("weight"), kinds.get("bias")))
        #: Preconditioner sketches kept for later hyperparameter steps (:func:`ntkgp.laplace.function_space.matrix_free_log_det`).
        self.sketches: dict = {}
        generic = set(plan.generic) | {i for m in plan.expanded for i in plan.structured[m].values()}
        self.generic = sorted(generic)

    # ------------------------------------------------------------------ sizes
    @property
    def num_rows(self) -> int:
        """``N·C``."""
        return self.num_data * self.num_outputs

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def feature_numbers(self) -> int:
        """How many numbers the kept layer features hold: :math:`N (C \\sum d^{out} + \\sum d^{in})`."""
        return sum(a.numel() + g.numel() for a, g, _, _ in self.layers)

    def _blocks(self, width: int):
        rows = max(1, BLOCK_ELEMENTS // max(1, width))
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

    def apply(self, u: list[Tensor]) -> Tensor:
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
            w = (
                tw.to(a).reshape(d_out, d_in, k).transpose(0, 1).reshape(d_in, d_out * k)
                if tw is not None
                else None
            )
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
                torch.zeros(self.engine.groups.numels[i], k, dtype=self.dtype, device=self.device)
                for i in self.generic
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
    def _generic_params(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        params = self.engine.params()
        return params, {self.names[i]: params[self.names[i]] for i in self.generic}

    def _generic_transpose(self, vv: Tensor) -> list[Tensor]:
        params, sub = self._generic_params()
        k = vv.shape[-1]
        total = {
            name: torch.zeros(p.numel(), k, dtype=self.dtype, device=self.device) for name, p in sub.items()
        }
        for s, e in self.engine._chunks(self.num_data, "J^T v"):

            def f(ps, xs=self.x[s:e]):
                return forward(self.engine.net, {**params, **ps}, xs)

            _, pull = func_vjp(f, sub)
            grads = vmap(pull, in_dims=-1, out_dims=-1)(vv[s:e])[0]
            for name in total:
                total[name] += grads[name].reshape(-1, k)
        return [total[self.names[i]] for i in self.generic]

    def _generic_apply(self, u: list[Tensor]) -> Tensor:
        params, sub = self._generic_params()
        k = u[0].shape[-1]
        tangents = {
            self.names[i]: t.reshape(*self.shapes[i], k).to(dtype=self.dtype, device=self.device)
            for i, t in zip(self.generic, u)
        }
        rows = []
        for s, e in self.engine._chunks(self.num_data, "J u"):

            def push(t, xs=self.x[s:e]):
                return func_jvp(lambda ps: forward(self.engine.net, {**params, **ps}, xs), (sub,), (t,))[1]

            rows.append(vmap(push, in_dims=-1, out_dims=-1)(tangents))
        return torch.cat(rows).reshape(-1, k)
