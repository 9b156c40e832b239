r"""SFR's dual statistics: the training data projected onto the inducing inputs, kept per parameter group.

SFR (Scannell et al.) summarizes :math:`N` points by sums over the data (docs/math.md, "SFR"):

.. math::
    B_u = \sum_n K_{Z x_n} \Lambda_n K_{x_n Z}, \qquad
    \tilde y_u = \sum_n K_{Z x_n} r_n, \quad r_n = \Lambda_n (f_n - m_n) + g_n,

with :math:`f_n = f(x_n;\theta^*)`, prior mean :math:`m_n`, :math:`g_n = \nabla_f \log p(y_n|f_n)`,
:math:`\Lambda_n = -\nabla^2_f \log p(y_n|f_n)`.

**Why per group.** The kernel is :math:`K = \sum_g w_g K_g` with :math:`w_g = 1/\delta_g`. Storing
:math:`A_{gh} = \sum_n K_{g, Z x_n} \Lambda_n K_{h, x_n Z}` and :math:`b_g = \sum_n K_{g, Z x_n} r_n` gives
:math:`B_u = \sum_{gh} w_g w_h A_{gh}` and :math:`\tilde y_u = \sum_g w_g b_g` for *any* :math:`\delta`: a change of
the prior precisions (and learning them by the sparse evidence) never touches the data or the Jacobians
again. The price is :math:`G^2` times the memory of :math:`B_u` and about :math:`G^2` times the flops of the
accumulation (one GEMM with the :math:`G` cross-Grams stacked); with ``prior_structure="network"`` (:math:`G = 1`)
there is no overhead.

**Why per "slot".** Likelihood hyperparameters stay differentiable too. For Gaussian likelihoods the
statistics are accumulated without the noise (:math:`\Lambda = 1`, :math:`r = y - m`) and weighted by
:math:`1/\sigma_c^2` afterwards, one slot per output :math:`c`. For the classification likelihoods the
statistics are untempered and weighted by :math:`1/T`. Output couplings:

* ``"joint"``: one :math:`MC \times MC` system (``K = M·C`` rows, interleaved order ``m·C + c``) with the full
  :math:`C \times C` Hessians (``L_n L_n^T = \Lambda_n`` from :func:`~ntkgp.likelihoods.hessian_sqrt`);
  slots: one per output for Gaussian likelihoods (memory ``C·(G·M·C)²``), otherwise one.
* ``"independent"``: ``C`` systems of size ``M``, one per output, with the kernel's diagonal blocks
  :math:`K_{cc}` and the diagonal of :math:`\Lambda_n` (the public SFR code); slot ``c`` = output ``c``.

The class also keeps what the collapsed evidence needs: :math:`t_g = \sum_n \operatorname{tr}(\Lambda_n
K_g(x_n, x_n))` and the data-fit constants.
"""

from __future__ import annotations

import math

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ...distributed import all_reduce_sum
from ...likelihoods import (
    gradient,
    hessian,
    hessian_sqrt,
    likelihood_temperature,
    log_likelihood,
    noise_variance,
    validate_targets,
)
from ...ntk import NTKEngine
from ...options import OutputCoupling, choose

__all__ = ["DualStatistics", "system_grams", "system_grams_and_diagonal"]


def system_grams(engine: NTKEngine, x1: Tensor, x2: Tensor, coupling: OutputCoupling | str) -> Tensor:
    r"""Per-group Grams arranged as the systems SFR solves, unweighted by :math:`\delta`.

    * ``"joint"``: ``(G, 1, N1·C, N2·C)``, interleaved rows and columns;
    * ``"independent"``: ``(G, C, N1, N2)``, the diagonal output blocks :math:`[K_g]_{(n,c),(m,c)}`.

    ``"independent"`` uses :meth:`NTKEngine.output_grams` (only the diagonal output blocks are formed when
    every parameter takes the engine's structured route: ``C`` times fewer flops than the full Gram).
    """
    return system_grams_and_diagonal(engine, x1, x2, coupling, with_diagonal=False)[0]


def system_grams_and_diagonal(
    engine: NTKEngine, x1: Tensor, x2: Tensor, coupling: OutputCoupling | str, with_diagonal: bool = True
) -> tuple[Tensor, Tensor | None]:
    """:func:`system_grams` and the per-group diagonal blocks ``K_g(x2_n, x2_n)``, ``(G, N2, C, C)``.

    For independent outputs the grams and the diagonal come from :meth:`NTKEngine.output_grams` (only the
    output-diagonal entries of the blocks, which are all that coupling uses); otherwise from
    :meth:`NTKEngine.group_grams` and :meth:`NTKEngine.diag_blocks`.
    """
    if choose(OutputCoupling, coupling, "output_coupling") is OutputCoupling.INDEPENDENT:
        if not with_diagonal:
            return engine.output_grams(x1, x2), None
        grams, diag = engine.output_grams(x1, x2, with_diagonal=True)
        return grams, torch.diag_embed(diag)
    full = engine.group_grams(x1, x2)
    return full.unsqueeze(1), engine.diag_blocks(x2) if with_diagonal else None


def _add_symmetric_product(out: Tensor, w: Tensor, block: int = 256) -> None:
    """``out += w wᵀ`` for ``w`` ``(..., K, n)``, computing only the lower block triangle and mirroring it
    (about half the flops of the plain product for ``K ≫ block``)."""
    k = w.shape[-2]
    if k <= 2 * block:
        out += w @ w.mT
        return
    for i in range(0, k, block):
        e = min(i + block, k)
        rows = w[..., i:e, :] @ w[..., :e, :].mT  # block row i, columns up to and including the diagonal block
        out[..., i:e, :e] += rows
        out[..., :i, i:e] += rows[..., :i].mT


class DualStatistics(nn.Module):
    r"""Streamed sums over the training data that define SFR, per parameter group and slot (see module doc).

    Buffers (``S`` slots, ``G`` groups, ``K = M·C`` for joint coupling or ``M`` for independent outputs):

    * ``precision`` :math:`A`, ``(S, G·K, G·K)``: :math:`\sum_n K_{g,Zn} \Lambda_n K_{h,nZ}` in block ``(g, h)``;
    * ``residual`` :math:`b`, ``(S, G, K)``: :math:`\sum_n K_{g,Zn} r_n`;
    * ``trace`` :math:`t`, ``(S, G)``: :math:`\sum_n \operatorname{tr}(\Lambda_n K_g(x_n, x_n))`;
    * ``fit``, ``(S,)``: Gaussian: :math:`\sum_n (y_{nc} - m_{nc})^2`; otherwise
      :math:`\sum_n g_n^\top d_n - \frac12 d_n^\top \Lambda_n d_n`, :math:`d_n = m_n - f_n`;
    * ``log_lik``, ``()``: :math:`\sum_n \log p(y_n|f_n)` (untempered; unused for Gaussian);
    * ``num_data``: :math:`N`.

    Memory ``O(S·(G·K)²)``: never ``O(N²)``.
    """

    def __init__(
        self,
        num_groups: int,
        num_inducing: int,
        num_outputs: int,
        coupling: OutputCoupling | str,
        gaussian: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        coupling = choose(OutputCoupling, coupling, "output_coupling")
        self.coupling = coupling
        self.gaussian = gaussian
        self.num_outputs = num_outputs
        self.num_groups = num_groups
        self.size = num_inducing * num_outputs if coupling is OutputCoupling.JOINT else num_inducing
        slots = num_outputs if (coupling is OutputCoupling.INDEPENDENT or gaussian) else 1
        gk = num_groups * self.size
        kw = {"dtype": dtype, "device": device}
        self.register_buffer("precision", torch.zeros(slots, gk, gk, **kw))
        self.register_buffer("residual", torch.zeros(slots, num_groups, self.size, **kw))
        self.register_buffer("trace", torch.zeros(slots, num_groups, **kw))
        self.register_buffer("fit", torch.zeros(slots, **kw))
        self.register_buffer("log_lik", torch.zeros((), **kw))
        self.register_buffer("num_data", torch.zeros((), dtype=torch.long, device=device))

    @property
    def num_systems(self) -> int:
        return 1 if self.coupling is OutputCoupling.JOINT else self.num_outputs

    # ------------------------------------------------------------------ accumulation
    @torch.no_grad()
    def accumulate(
        self,
        likelihood: Likelihood,
        cross: Tensor,
        diag: Tensor,
        f: Tensor,
        m: Tensor,
        y: Tensor,
    ) -> None:
        r"""Add one batch of ``b`` points.

        Args:
            likelihood: the model's likelihood (its current noise / temperature is divided out).
            cross: :func:`system_grams` of ``(Z, x_batch)``: ``(G, 1, M·C, b·C)`` or ``(G, C, M, b)``.
            diag: per-group diagonal blocks :math:`K_g(x_n, x_n)`, ``(G, b, C, C)``.
            f: network outputs ``(b, C)``; m: prior mean ``(b, C)``; y: targets of the batch.
        """
        b, c = f.shape
        g_count = self.num_groups
        if self.gaussian:
            e = validate_targets(likelihood, y, c, num_data=b).to(f) - m  # (b, C), noise divided out
            self._accumulate_gaussian(cross, diag, e)
        else:
            temperature = likelihood_temperature(likelihood)
            scale = 1.0 if temperature is None else temperature.detach().to(f)
            grad = gradient(likelihood, f, y) * scale
            lam = hessian(likelihood, f, y) * scale
            d = m - f
            self.log_lik += log_likelihood(likelihood, f, y).sum() * scale
            if self.coupling is OutputCoupling.JOINT:
                root = hessian_sqrt(likelihood, f, y) * scale**0.5
                r = torch.einsum("nij,nj->ni", lam, -d) + grad
                w = torch.einsum("gknc,ncd->gknd", cross[:, 0].view(g_count, self.size, b, c), root)
                w = w.reshape(g_count * self.size, b * c)
                _add_symmetric_product(self.precision[0], w)
                self.residual[0] += cross[:, 0] @ r.reshape(-1)
                self.trace[0] += torch.einsum("gnij,nji->g", diag, lam)
                self.fit[0] += (grad * d).sum() - 0.5 * torch.einsum("ni,nij,nj->", d, lam, d)
            else:
                lam_diag = lam.diagonal(dim1=-2, dim2=-1)  # (b, C)
                r = lam_diag * (-d) + grad
                self._accumulate_independent(cross, lam_diag, r)
                self.trace += torch.einsum("gncc,nc->cg", diag, lam_diag)
                self.fit += (grad * d).sum(0) - 0.5 * (lam_diag * d * d).sum(0)
        self.num_data += b

    def _accumulate_gaussian(self, cross: Tensor, diag: Tensor, e: Tensor) -> None:
        b, c = e.shape
        if self.coupling is OutputCoupling.JOINT:
            g_count = self.num_groups
            per_output = cross[:, 0].view(g_count, self.size, b, c)
            for k in range(c):
                w = per_output[..., k].reshape(g_count * self.size, b)
                _add_symmetric_product(self.precision[k], w)
                self.residual[k] += per_output[..., k] @ e[:, k]
        else:
            self._accumulate_independent(cross, torch.ones_like(e), e)
        self.trace += diag.diagonal(dim1=-2, dim2=-1).sum(1).T  # (C, G)
        self.fit += (e * e).sum(0)

    def _accumulate_independent(self, cross: Tensor, weights: Tensor, r: Tensor) -> None:
        """``cross`` ``(G, C, M, b)``, per-point Hessian diagonals ``weights`` and site residuals ``r`` ``(b, C)``."""
        g_count, c, m, b = cross.shape
        w = (cross * weights.clamp_min(0).sqrt().T[None, :, None, :]).transpose(0, 1).reshape(c, g_count * m, b)
        _add_symmetric_product(self.precision, w)
        self.residual += torch.einsum("gcmn,nc->cgm", cross, r)

    @torch.no_grad()
    def add_(self, other: DualStatistics) -> DualStatistics:
        """Add the sums of ``other`` (statistics of more data with the same ``Z``) in place."""
        for name in ("precision", "residual", "trace", "fit", "log_lik", "num_data"):
            getattr(self, name).add_(getattr(other, name))
        return self

    @torch.no_grad()
    def all_reduce_(self, enabled: bool = True) -> DualStatistics:
        """Sum the statistics over the ranks of ``torch.distributed``, in place (each rank summed its shard);
        a no-op in one process or unless ``enabled`` (:func:`ntkgp.distributed.all_reduce_sum`)."""
        all_reduce_sum([getattr(self, name) for name in ("precision", "residual", "trace", "fit", "log_lik", "num_data")],
                       enabled)
        return self

    # ------------------------------------------------------------------ evaluation at hyperparameters
    def slot_weights(self, likelihood: Likelihood) -> Tensor:
        r"""Slot weights ``(S,)``: :math:`1/\sigma_c^2` (Gaussian) or :math:`1/T` (differentiable)."""
        slots = self.precision.shape[0]
        if self.gaussian:
            return noise_variance(likelihood).to(self.precision).reciprocal().expand(slots)
        temperature = likelihood_temperature(likelihood)
        one = torch.ones(slots, dtype=self.precision.dtype, device=self.precision.device)
        return one if temperature is None else one / temperature.to(one)

    def projected(self, weights: Tensor, slot_weights: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`B_u` ``(nb, K, K)`` and :math:`\tilde y_u` ``(nb, K)`` at group weights :math:`w = 1/\delta`.

        :math:`B_u = \sum_{s,g,h} v_s w_g w_h A_{s,gh}` block by block: no temporary of the size of the
        statistics (``S·(G·K)²``), only :math:`B_u` itself (and one block per term when differentiating).
        Both results are fresh tensors, never views of the statistics: the caller may overwrite them.
        """
        s, g, k = self.residual.shape
        blocks = self.precision.view(s, g, k, g, k)
        rhs = torch.einsum("g,sgk->sk", weights, self.residual)
        joint = self.coupling is OutputCoupling.JOINT
        coef = slot_weights[:, None, None] * weights[None, :, None] * weights[None, None, :]  # (S, G, G)
        if joint:  # one system: the slots are summed too
            terms = [(coef[i, a, b], blocks[i, a, :, b, :]) for i in range(s) for a in range(g) for b in range(g)]
        else:  # one system per slot
            terms = [(coef[:, a, b, None, None], blocks[:, a, :, b, :]) for a in range(g) for b in range(g)]
        if torch.is_grad_enabled() and coef.requires_grad:
            out = sum(c * block for c, block in terms)
        else:
            out = torch.zeros_like(terms[0][1])
            for c, block in terms:
                out.addcmul_(c.detach(), block) if c.dim() else out.add_(block, alpha=float(c))
        if joint:
            return out[None], (slot_weights @ rhs)[None]
        return out, slot_weights[:, None] * rhs

    def trace_term(self, weights: Tensor, slot_weights: Tensor) -> Tensor:
        r""":math:`\sum_n \operatorname{tr}(\Lambda_n K(x_n, x_n))` at the given weights, a scalar."""
        return torch.einsum("s,g,sg->", slot_weights, weights, self.trace)

    def data_fit(self, likelihood: Likelihood, slot_weights: Tensor) -> Tensor:
        r"""The part of the Gaussian-site evidence that does not involve the kernel, a scalar.

        Gaussian: :math:`\sum_c [-\frac N2 \log(2\pi\sigma_c^2) - \frac{1}{2\sigma_c^2}\sum_n (y_{nc} - m_{nc})^2]`;
        otherwise :math:`\frac1T [\sum_n \log p(y_n|f_n) + g_n^\top d_n - \frac12 d_n^\top\Lambda_n d_n]`.
        """
        if self.gaussian:
            variance = noise_variance(likelihood).to(self.fit).expand(self.num_outputs)
            n = self.num_data.to(self.fit)
            return -0.5 * (n * torch.log(2 * math.pi * variance) + self.fit / variance).sum()
        return slot_weights[0] * (self.log_lik + self.fit.sum())
