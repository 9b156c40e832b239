r"""SFR's dual statistics: the training data projected onto the inducing inputs, kept per parameter group
(or, with ``statistics="combined"``, for the combined kernel at fixed prior precisions).

SFR (Scannell et al.) summarizes :math:`N` points by sums over the data (docs/math.md, "SFR"):

.. math::
    B_u = \sum_n K_{Z x_n} \Lambda_n K_{x_n Z}, \qquad
    \tilde y_u = \sum_n K_{Z x_n} r_n, \quad r_n = \Lambda_n (f_n - m_n) + g_n,

with :math:`f_n = f(x_n;\theta^*)`, prior mean :math:`m_n`, :math:`g_n = \nabla_f \log p(y_n|f_n)`,
:math:`\Lambda_n = -\nabla^2_f \log p(y_n|f_n)`.

**Why per group.** The kernel is :math:`K = \sum_g w_g K_g` with :math:`w_g = 1/\delta_g`. Storing :math:`A_{gh} =
\sum_n K_{g, Z x_n} \Lambda_n K_{h, x_n Z}` and :math:`b_g = \sum_n K_{g, Z x_n} r_n` gives :math:`B_u = \sum_{gh} w_g
w_h A_{gh}` and :math:`\tilde y_u = \sum_g w_g b_g` for *any* :math:`\delta`: a change of the prior precisions (and
learning them by the sparse evidence) never touches the data or the Jacobians again. The price is :math:`G^2` times
the memory of :math:`B_u` and about :math:`G^2` times the flops of the accumulation (one GEMM with the :math:`G`
cross-Grams stacked); with ``prior_structure="network"`` (:math:`G = 1`) there is no overhead.

**Combined** (``SFR(..., memory=SFRMemoryOptions(statistics="combined"))``). The statistics are accumulated for the
combined kernel :math:`K = \sum_g w_g K_g` at the :math:`\delta` current when the data are passed, i.e. as one
group: each batch's cross-Grams are summed with the weights :math:`w_g` before the accumulation, which gives
:math:`A = \sum_{gh} w_g w_h A_{gh}`, :math:`b = \sum_g w_g b_g`, :math:`t = \sum_g w_g t_g` (equal to rounding) in
:math:`G^2` times less memory (``(S, K, K)``) and about :math:`G^2` times fewer accumulation flops. The
:math:`\delta` used is kept in the buffer ``prior_precision``; the statistics hold for that :math:`\delta` only and
carry no gradient in it, so :meth:`DualStatistics.projected` and :meth:`DualStatistics.trace_term` raise for any
other weights and for weights that require grad (the model checks :math:`\delta` first, at every call, with
:meth:`DualStatistics.check_prior_precision`). The slot weights (noise, temperature) are applied afterwards as in
the per-group mode, so they stay differentiable.

**Why per "slot".** Likelihood hyperparameters stay differentiable too. For Gaussian likelihoods the statistics are
accumulated without the noise (:math:`\Lambda = 1`, :math:`r = y - m`) and weighted by :math:`1/\sigma_c^2`
afterwards, one slot per output :math:`c`. For the classification likelihoods the statistics are untempered and
weighted by :math:`1/T`. Output couplings:

* ``"joint"``: one :math:`MC \times MC` system (``K = M·C`` rows, interleaved order ``m·C + c``) with the full
  :math:`C \times C` Hessians (``L_n L_n^T = \Lambda_n`` from :func:`~ntkgp.likelihoods.hessian_sqrt`);
  slots: one per output for Gaussian likelihoods (memory ``C·(G·M·C)²``), otherwise one.
* ``"independent"``: ``C`` systems of size ``M``, one per output, with the kernel's diagonal blocks
  :math:`K_{cc}` and the diagonal of :math:`\Lambda_n` (the public SFR code); slot ``c`` = output ``c``.

**Precision.** The sums are kept in :func:`statistics_dtype` (float64, also for a float32 network): the
network's numbers (cross-Grams, outputs, offsets) arrive in its dtype and are summed in float64, so the
rounding of the sums (about :math:`\epsilon \operatorname{tr} B_u`, large next to :math:`K_{ZZ}`'s small
eigenvalues when :math:`N` is large or the noise small) is that of float64; what remains is the features'
own rounding (docs/sfr.md, "float32").

The class also keeps what the collapsed evidence needs: :math:`t_g = \sum_n \operatorname{tr}(\Lambda_n
K_g(x_n, x_n))` and the data-fit constants.
"""

from __future__ import annotations

import math

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from ...distributed import all_reduce_sum, check_replicated
from ...likelihoods import (
    gradient,
    hessian,
    hessian_sqrt,
    likelihood_temperature,
    log_likelihood,
    noise_variance,
    validate_targets,
)
from ...options import OutputCoupling, choose
from .site_record import SiteRecord, merged_record

__all__ = ["DualStatistics", "statistics_dtype"]


def statistics_dtype(network_dtype: torch.dtype) -> torch.dtype:
    """The dtype SFR accumulates its statistics and solves its systems in: float64, whatever the network's
    (float32 features, float64 sums: their rounding, ``ε·tr B_u``, is then negligible; docs/sfr.md, "float32")."""
    return torch.promote_types(network_dtype, torch.float64)


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


class DualStatistics(SiteRecord):
    r"""Streamed sums over the training data that define SFR, per parameter group and slot (see module doc).

    Buffers (``S`` slots, ``G`` groups stored, ``K = M·C`` for joint coupling or ``M`` for independent outputs;
    ``G = 1`` when combined):

    * ``precision`` :math:`A`, ``(S, G·K, G·K)``: :math:`\sum_n K_{g,Zn} \Lambda_n K_{h,nZ}` in block ``(g, h)``;
    * ``residual`` :math:`b`, ``(S, G, K)``: :math:`\sum_n K_{g,Zn} r_n`;
    * ``trace`` :math:`t`, ``(S, G)``: :math:`\sum_n \operatorname{tr}(\Lambda_n K_g(x_n, x_n))`;
    * ``fit``, ``(S,)``: Gaussian: :math:`\sum_n (y_{nc} - m_{nc})^2`; otherwise
      :math:`\sum_n g_n^\top d_n - \frac12 d_n^\top \Lambda_n d_n`, :math:`d_n = m_n - f_n`;
    * ``log_lik``, ``()``: :math:`\sum_n \log p(y_n|f_n)` (untempered; unused for Gaussian);
    * ``num_data``: :math:`N`;
    * ``prior_precision``: combined only (``None`` otherwise, not in the ``state_dict``): the :math:`\delta`,
      ``(G_kernel,)``, at which the groups were combined.

    Memory ``O(S·(G·K)²)``, ``O(S·K²)`` combined: never ``O(N²)``.

    Args:
        num_groups: ``G``, the kernel's prior groups (the groups of the cross-Grams given to :meth:`accumulate`).
        num_inducing: ``M``; num_outputs: ``C``; coupling: output coupling.
        gaussian: whether the likelihood is Gaussian (slots per output, noise divided out).
        dtype, device: of the statistics.
        prior_precision: ``None`` (per group), or the :math:`\delta` ``(G,)`` at which the groups are combined
            (``statistics="combined"``).
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
        prior_precision: Tensor | None = None,
    ) -> None:
        super().__init__()
        coupling = choose(OutputCoupling, coupling, "output_coupling")
        self.coupling = coupling
        self.gaussian = gaussian
        self.num_outputs = num_outputs
        self.num_inducing = num_inducing
        self.kernel_groups = num_groups
        self.combined = prior_precision is not None
        if self.combined:
            if prior_precision.shape != (num_groups,):
                shape = tuple(prior_precision.shape)
                raise ValueError(f"prior_precision must have shape ({num_groups},), got {shape}")
            self.register_buffer("prior_precision", prior_precision.detach().to(device=device).clone())
            num_groups = 1
        else:
            self.register_buffer("prior_precision", None)
        self.num_groups = num_groups  # groups stored
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
        self.iterated_sites: bool | None = False  # sites of an iterated update (on all of Z); None: unknown

    @property
    def num_systems(self) -> int:
        return 1 if self.coupling is OutputCoupling.JOINT else self.num_outputs

    def empty_like(self) -> DualStatistics:
        r"""Fresh zero statistics of the same structure (groups, slots, dtype, device and combined :math:`\delta`)."""
        return DualStatistics(
            self.kernel_groups, self.num_inducing, self.num_outputs, self.coupling, self.gaussian,
            self.precision.dtype, self.precision.device, self.prior_precision,
        )

    # ------------------------------------------------------------------ combined statistics: δ is fixed
    def check_prior_precision(self, prior_precision: Tensor) -> None:
        r"""Raise ``RuntimeError`` if the statistics are combined and ``prior_precision`` differs from the
        :math:`\delta` they were accumulated at; a no-op per group. Values within a few units in the last place
        count as the same (:func:`_same_values`: setting δ back through the constraint's ``log``/``exp`` may
        move it by one)."""
        if not self.combined:
            return
        current = prior_precision.detach().to(self.prior_precision)
        if not _same_values(current, self.prior_precision):
            raise RuntimeError(_changed_message(self.prior_precision, current))

    def _stored_weights(self, weights: Tensor) -> Tensor:
        """The weights of the stored groups: ``weights`` per group; combined, ``ones(1)`` after checking that
        ``weights`` are those the statistics were combined at and that no gradient is asked for."""
        if not self.combined:
            return weights
        if torch.is_grad_enabled() and weights.requires_grad:
            raise RuntimeError(_GRADIENT_MESSAGE)
        self.check_prior_precision(weights.detach().reciprocal())
        return torch.ones(1, dtype=weights.dtype, device=weights.device)

    # ------------------------------------------------------------------ accumulation
    @torch.no_grad()
    def accumulate(
        self,
        likelihood: Likelihood,
        cross: Tensor,
        diag: Tensor,
        f: Tensor,
        offset: Tensor,
        y: Tensor,
    ) -> None:
        r"""Add one batch of ``b`` points (every tensor in the statistics' dtype).

        Args:
            likelihood: the model's likelihood (its current noise / temperature is divided out).
            cross: :func:`~ntkgp.models.sfr.system_grams.system_grams` of ``(Z, x_batch)``: ``(G, 1, M·C, b·C)`` or
                ``(G, C, M, b)`` (``G`` the kernel's groups; combined statistics sum them with the weights
                :math:`1/\delta` first).
            diag: per-group diagonal blocks :math:`K_g(x_n, x_n)`, ``(G, b, C, C)``.
            f: network outputs ``(b, C)``; offset: :math:`o_n = f_n - m_n` ``(b, C)``, the network output minus the
                prior mean (:func:`~ntkgp.models.sfr.streaming.mean_offset`; never formed by a subtraction
                here); y: targets of the batch.
        """
        b, c = f.shape
        if self.combined:  # one group: the cross-Grams and point blocks of the combined kernel
            weights = self.prior_precision.reciprocal().to(cross)
            cross = torch.tensordot(weights, cross, dims=1).unsqueeze(0)
            diag = torch.tensordot(weights, diag.to(cross), dims=1).unsqueeze(0)
        g_count = self.num_groups
        if self.gaussian:
            # y − m = (y − f) + o, noise divided out
            e = (validate_targets(likelihood, y, c, num_data=b).to(f) - f) + offset
            self._accumulate_gaussian(cross, diag, e)
        else:
            temperature = likelihood_temperature(likelihood)
            scale = 1.0 if temperature is None else temperature.detach().to(f)
            grad = gradient(likelihood, f, y) * scale
            lam = hessian(likelihood, f, y) * scale
            d = -offset  # m − f
            self.log_lik += log_likelihood(likelihood, f, y).sum() * scale
            if self.coupling is OutputCoupling.JOINT:
                root = hessian_sqrt(likelihood, f, y) * scale**0.5
                r = torch.einsum("nij,nj->ni", lam, offset) + grad
                w = torch.einsum("gknc,ncd->gknd", cross[:, 0].view(g_count, self.size, b, c), root)
                w = w.reshape(g_count * self.size, b * c)
                _add_symmetric_product(self.precision[0], w)
                self.residual[0] += cross[:, 0] @ r.reshape(-1)
                self.trace[0] += torch.einsum("gnij,nji->g", diag, lam)
                self.fit[0] += (grad * d).sum() - 0.5 * torch.einsum("ni,nij,nj->", d, lam, d)
            else:
                lam_diag = lam.diagonal(dim1=-2, dim2=-1)  # (b, C)
                r = lam_diag * offset + grad
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
        r"""Add the sums of ``other`` (statistics of more data with the same ``Z``) in place.

        Raises:
            ValueError: if one is combined and the other not, or they were combined at different :math:`\delta`.
        """
        if self.combined != other.combined or (
            self.combined and not torch.equal(self.prior_precision, other.prior_precision.to(self.prior_precision))
        ):
            raise ValueError(
                "cannot add dual statistics kept differently (per group and combined, or combined at different "
                "prior precisions δ)"
            )
        for name in ("precision", "residual", "trace", "fit", "log_lik", "num_data"):
            getattr(self, name).add_(getattr(other, name))
        self.iterated_sites = merged_record(self.iterated_sites, other.iterated_sites)
        return self

    @torch.no_grad()
    def all_reduce_(self, enabled: bool = True) -> DualStatistics:
        r"""Sum the statistics over the ranks of ``torch.distributed``, in place (each rank summed its shard);
        a no-op in one process or unless ``enabled`` (:func:`ntkgp.distributed.all_reduce_sum`). Combined
        statistics first check that every rank combined at the same :math:`\delta` (not summed)."""
        if self.combined:
            check_replicated([self.prior_precision], 'the prior precisions δ of statistics="combined"', enabled)
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
        Combined statistics take only the weights they were combined at, without gradient (else
        ``RuntimeError``).
        """
        weights = self._stored_weights(weights)
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
        r""":math:`\sum_n \operatorname{tr}(\Lambda_n K(x_n, x_n))` at the given weights, a scalar (combined: as
        :meth:`projected`)."""
        return torch.einsum("s,g,sg->", slot_weights, self._stored_weights(weights), self.trace)

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


_GRADIENT_MESSAGE = (
    'this SFR was built with statistics="combined": its dual statistics were accumulated at fixed prior '
    "precisions δ and carry no gradient in δ, so the evidence (or a train()-mode prediction) cannot be "
    "differentiated with respect to δ. To learn δ by the evidence, build with statistics=\"per_group\"; to "
    "differentiate in the noise or temperature only, freeze δ first: "
    "sfr.covar_module.raw_prior_precision.requires_grad_(False) (or compute under torch.no_grad() / in eval() "
    "mode when no gradient is needed)"
)


def _same_values(a: Tensor, b: Tensor, ulps: int = 16) -> bool:
    """Same shape and equal to ``ulps`` units of rounding, relatively (a change that small moves the model by
    as little as rounding does)."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=ulps * torch.finfo(b.dtype).eps, atol=0.0)


def _changed_message(recorded: Tensor, current: Tensor) -> str:
    def show(t: Tensor) -> str:
        return "[" + ", ".join(f"{v:.10g}" for v in t.detach().reshape(-1).tolist()) + "]"

    return (
        f'this SFR was built with statistics="combined": its dual statistics hold the combined kernel '
        f"Σ_g K_g/δ_g at the prior precisions δ = {show(recorded)} of the pass over the data, and cannot be "
        f"re-weighted to the current δ = {show(current)}. Set sfr.covar_module.prior_precision back to "
        "sfr.dual_statistics.prior_precision; or build a new SFR on the data at the new δ (inducing_points="
        "sfr.inducing_points keeps Z); or use statistics=\"per_group\", whose statistics follow any δ without "
        "the data (G² times their memory)"
    )
