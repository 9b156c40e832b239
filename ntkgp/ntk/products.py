r"""Matrix-free products of the NTK engine: :math:`J^\top v`, :math:`J u` and :math:`K v`.

Each is one pass of ``torch.func.vjp`` / ``torch.func.jvp`` per chunk of examples (``vmap`` over the
columns of ``v`` or ``u``), never a Jacobian: memory :math:`O(\text{chunk} \cdot (\text{activations} + k P))`.
Inputs that require grad keep their graph (``torch.func`` composes with autograd).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.func import jvp as func_jvp
from torch.func import vjp as func_vjp
from torch.func import vmap

from .functional import forward

if TYPE_CHECKING:
    from .engine import NTKEngine


def vjp(engine: NTKEngine, x: Tensor, v: Tensor) -> dict[str, Tensor]:
    """``J(X)ᵀ v`` for ``v`` ``(N·C,)`` or ``(N·C, k)`` (checked by the engine): per parameter ``(*p.shape[, k])``."""
    c = engine.num_outputs(x)
    n = x.shape[0]
    batched = v.dim() == 2
    vv = v.reshape(n, c, -1).to(dtype=engine.dtype, device=engine.device)
    params = engine.params()
    total = {name: torch.zeros(*p.shape, vv.shape[-1], dtype=p.dtype, device=p.device) for name, p in params.items()}
    for s, e in engine._chunks(n, "J^T v"):
        _, pull = func_vjp(lambda p, xs=x[s:e]: forward(engine.net, p, xs), params)
        grads = vmap(pull, in_dims=-1, out_dims=-1)(vv[s:e])[0]
        total = {name: total[name] + grads[name] for name in total}
    return total if batched else {k: t.squeeze(-1) for k, t in total.items()}


def jvp(engine: NTKEngine, x: Tensor, u: dict[str, Tensor]) -> Tensor:
    """``J(X) u`` for parameter-shaped tangents ``u`` (checked by the engine), optionally with a trailing
    ``k``: ``(N·C[, k])``."""
    params = engine.params()
    shapes = {name: p.shape for name, p in params.items()}
    batched = any(u[name].dim() == len(shapes[name]) + 1 for name in u)
    uu = {
        name: (t if batched else t.unsqueeze(-1)).to(dtype=engine.dtype, device=engine.device) for name, t in u.items()
    }
    rows = []
    for s, e in engine._chunks(x.shape[0], "J u"):

        def push(t, xs=x[s:e]):
            return func_jvp(lambda p: forward(engine.net, p, xs), (params,), (t,))[1]

        rows.append(vmap(push, in_dims=-1, out_dims=-1)(uu))
    out = torch.cat(rows).reshape(-1, rows[0].shape[-1])
    return out if batched else out.squeeze(-1)


def matvec(engine: NTKEngine, x: Tensor, v: Tensor, weights: Tensor) -> Tensor:
    """``K v = Σ_g w_g J_g (J_gᵀ v)``: one vector-Jacobian and one Jacobian-vector product per chunk."""
    jtv = vjp(engine, x, v)
    w = weights.to(dtype=engine.dtype, device=engine.device)
    scaled = {name: jtv[name] * w[g] for name, g in zip(engine.groups.names, engine.groups.group_of)}
    return jvp(engine, x, scaled)
