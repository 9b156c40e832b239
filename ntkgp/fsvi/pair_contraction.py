r"""The two contractions of FSVI's linearized covariance with hand-written backward passes.

:class:`PairContraction` is :math:`T_{nc,md} = \sum_i \gamma_{1,nci} B_{nmi} \gamma_{2,mdi}` (the covariance of a
linear layer with element-wise weight variances, :mod:`ntkgp.fsvi.linearized`), :class:`SymmetricGram` is
:math:`X X^\top` with a one-product backward pass; :func:`unit_gradients` tells the output layer's output
gradients (the unit vectors), for which no contraction is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..memory import PAIR_CONTRACTION_BYTES, chunk_rows


class PairContraction(torch.autograd.Function):
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

    # bytes of one chunk's W (:data:`ntkgp.memory.PAIR_CONTRACTION_BYTES`, 1 MiB: 2¹⁸ float32 numbers)
    CHUNK_BYTES = PAIR_CONTRACTION_BYTES

    @staticmethod
    def _chunk(n1: int, c: int, d_out: int, dtype: torch.dtype) -> int:
        return chunk_rows(PairContraction.CHUNK_BYTES, n1 * c * d_out, dtype)

    @staticmethod
    def _upper(n: int, like: Tensor) -> Tensor:
        """The factors of :math:`B'` ``(n, n, 1)``: 1 for ``n < m``, ½ for ``n = m``, 0 for ``n > m``."""
        ones = torch.ones(n, n, dtype=like.dtype, device=like.device)
        return (ones.triu(1) + 0.5 * torch.eye(n, dtype=like.dtype, device=like.device))[:, :, None]

    @staticmethod
    def forward(ctx, g1: Tensor, b: Tensor, g2: Tensor, symmetric: bool = False) -> Tensor:
        n1, c, d_out = g1.shape
        n2 = g2.shape[0]
        bt = (b * PairContraction._upper(n1, b) if symmetric else b).transpose(0, 1).contiguous()  # (N2, N1, d)
        out = (g1.new_zeros if symmetric else g1.new_empty)(n2, c, n1 * c)  # Tᵀ (T'ᵀ), [m, d, (n, c)]
        step = PairContraction._chunk(n1, c, d_out, g1.dtype)
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
        step = PairContraction._chunk(n1, c, d_out, g1.dtype)
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
            grad_b = grad_b * PairContraction._upper(n1, grad_b) if symmetric else grad_b.contiguous()
        return grad_g1, grad_b, grad_g2, None


class SymmetricGram(torch.autograd.Function):
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


def unit_gradients(g: Tensor) -> bool:
    r"""Whether the output gradients ``(N, C, d_out)`` are the unit vectors, :math:`\gamma_{nci} = \delta_{ci}`: those
    of the network's output layer (``f = z``), constants without a graph."""
    _, c, d_out = g.shape
    unit = torch.eye(c, dtype=g.dtype, device=g.device)
    return d_out == c and not g.requires_grad and torch.equal(g, unit.expand_as(g))
