r"""The Laplace evidence without forming the kernel: a matrix-free ``LinearOperator`` and GPyTorch's CG + SLQ.

The log-determinant of the evidence (docs/math.md, "Laplace-GGN evidence") is

.. math::
    \log\lvert B \rvert, \qquad B = I_{Nk} + L^\top K L, \qquad
    K = J P_0^{-1} J^\top = \sum_g \delta_g^{-1} J_g J_g^\top,

with :math:`L` the block-diagonal site factor (:math:`L_n L_n^\top = \Lambda_n`; for a Gaussian likelihood
:math:`L = \sigma^{-1} I` and :math:`\log|B| = \log|K + \sigma^2 I| - NC\log\sigma^2`).
:class:`LaplaceSiteOperator` is :math:`B` as a ``linear_operator`` ``LinearOperator`` whose product is
:math:`v + L^\top J P_0^{-1} J^\top L v` (:class:`~ntkgp.ntk.products.NTKProducts`: a
vector-Jacobian then a Jacobian-vector product, structured per layer), represented by the tensors
:math:`(L, \delta)`. Its ``inv_quad_logdet`` is GPyTorch's: preconditioned CG with :math:`t` probe
vectors, the log-determinant by stochastic Lanczos quadrature, and in the backward pass the stochastic trace
estimate :math:`\operatorname{tr}(B^{-1}\partial B) \approx \frac1t \sum_i (B^{-1} z_i)^\top \partial B\,
(P^{-1} z_i)`, :math:`z_i \sim N(0, P)`, whose :math:`\partial B` comes from the operator's bilinear
derivative:

.. math::
    \frac{\partial\, u^\top B v}{\partial \delta_g} = -\delta_g^{-2}\,
        \langle J_g^\top L u,\, J_g^\top L v\rangle, \qquad
    \frac{\partial\, u^\top B v}{\partial L_n} = (K L v)_n u_n^\top + (K L u)_n v_n^\top,

so the gradient reaches :math:`\delta` and, through :math:`L`, the noise and the temperature. The
preconditioner :math:`P = I + \hat A` is a randomized Nyström approximation :math:`\hat A \preceq
L^\top K L` of rank :math:`r` (one product with :math:`r` columns), with :math:`\log|P|` added to the
quadrature of :math:`P^{-1}B` (GPyTorch's variance-reduction scheme).
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from linear_operator import settings
from linear_operator.operators import LinearOperator

from ...caching import ValueCache
from ...kernels import NTKKernel
from ...ntk.products import NTKProducts
from .algebra import block_apply
from .routes import EvidenceOptions, check_options

__all__ = [
    "LaplaceSiteOperator",
    "MatrixFreeNTKOperator",
    "NystromPreconditioner",
    "kernel_products",
    "matrix_free_log_det",
]

_PRODUCTS: weakref.WeakKeyDictionary[NTKKernel, ValueCache] = weakref.WeakKeyDictionary()


def kernel_products(kernel: NTKKernel, x: torch.Tensor) -> NTKProducts:
    """The :class:`~ntkgp.ntk.products.NTKProducts` of ``kernel`` at ``x``, cached by the values
    of ``x`` and of the network's weights and buffers (one entry per kernel)."""
    cache = _PRODUCTS.setdefault(kernel, ValueCache(size=1))
    engine = kernel.engine
    state = engine.network_state()
    return cache.get_or_compute("products", [x], lambda: engine.products(x), state=state)


def _columns(rhs: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (rhs.unsqueeze(-1), True) if rhs.dim() == 1 else (rhs, False)


class MatrixFreeNTKOperator(LinearOperator):
    r"""The NTK Gram :math:`K = \sum_g \delta_g^{-1} J_g J_g^\top` (``(N·C, N·C)``) as a matrix-free operator.

    Represented by the prior precisions ``(G,)``, so solves and log-determinants through GPyTorch give
    gradients in :math:`\delta`. Products cost one vector-Jacobian and one Jacobian-vector product per
    column block; the diagonal comes from the per-point blocks (no Gram).

    Args:
        prior_precision: :math:`\delta`, shape ``(G,)``.
        products: the products of the network at the inputs.
    """

    def __init__(self, prior_precision: torch.Tensor, products: NTKProducts) -> None:
        super().__init__(prior_precision, products=products)
        self.products = products
        self.prior_precision = prior_precision

    def _size(self) -> torch.Size:
        m = self.products.num_rows
        return torch.Size([m, m])

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        r, vec = _columns(rhs)
        w = self.prior_precision.detach().reciprocal()
        out = self.products.matvec(r, w).to(rhs)
        return out.squeeze(-1) if vec else out

    def _diagonal(self) -> torch.Tensor:
        blocks = self.products.engine.diag_blocks(self.products.x)  # (G, N, C, C)
        w = self.prior_precision.detach().reciprocal().to(blocks)
        return torch.einsum("g,gncc->nc", w, blocks).reshape(-1).to(self.prior_precision)

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor) -> tuple:
        delta = self.prior_precision
        if not delta.requires_grad:
            return (None,)
        with torch.no_grad():
            left, right = _columns(left_vecs)[0], _columns(right_vecs)[0]
            inner = self.products.group_inner(self.products.transpose(left), self.products.transpose(right))
            return (-inner.to(delta) / delta.detach().square(),)


class LaplaceSiteOperator(LinearOperator):
    r""":math:`B = I + L^\top K L` (``(N·k, N·k)``) with the NTK :math:`K` matrix-free, represented by
    :math:`(L, \delta)`.

    Args:
        factor: :math:`L` as blocks ``(N, C, k)`` (:func:`ntkgp.laplace.function_space.curvature_factor`).
        prior_precision: :math:`\delta`, shape ``(G,)``.
        products: the products of the network at the inputs.
        preconditioner_rank: rank of the Nyström preconditioner (0: none).
        generator: random generator of the probes and of the preconditioner (``None``: torch's global one).
    """

    def __init__(
        self,
        factor: torch.Tensor,
        prior_precision: torch.Tensor,
        products: NTKProducts,
        preconditioner_rank: int = 0,
        generator: torch.Generator | None = None,
        sketch: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(
            factor,
            prior_precision,
            products=products,
            preconditioner_rank=preconditioner_rank,
            generator=generator,
            sketch=sketch,
        )
        self.factor = factor
        self.prior_precision = prior_precision
        self.products = products
        self.preconditioner_rank = preconditioner_rank
        self.generator = generator
        self._sketch = sketch
        self._nystrom: NystromPreconditioner | None = None

    # ------------------------------------------------------------------ the matrix
    def _size(self) -> torch.Size:
        n, _, k = self.factor.shape
        return torch.Size([n * k, n * k])

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def _sandwich(self, r: torch.Tensor) -> torch.Tensor:
        """``Lᵀ K L r`` for ``r`` ``(N·k, m)``."""
        factor = self.factor.detach()
        w = self.prior_precision.detach().reciprocal()
        kl = self.products.matvec(block_apply(factor, r), w)
        return block_apply(factor, kl.to(r), transpose=True)

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        r, vec = _columns(rhs)
        out = r + self._sandwich(r)
        return out.squeeze(-1) if vec else out

    def _diagonal(self) -> torch.Tensor:
        blocks = self.products.engine.diag_blocks(self.products.x)  # (G, N, C, C)
        w = self.prior_precision.detach().reciprocal().to(blocks)
        k_nn = torch.einsum("g,gnij->nij", w, blocks).to(self.factor)
        factor = self.factor.detach()
        inner = torch.einsum("nia,nij,nja->na", factor, k_nn, factor)
        return 1 + inner.reshape(-1)

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor) -> tuple:
        factor, delta = self.factor, self.prior_precision
        if not (factor.requires_grad or delta.requires_grad):
            return (None, None)
        products = self.products
        n, c, k = factor.shape
        with torch.no_grad():
            f = factor.detach()
            left, right = _columns(left_vecs)[0], _columns(right_vecs)[0]
            d = left.shape[-1]
            w = delta.detach().reciprocal()
            tu = products.transpose(block_apply(f, left))
            tv = products.transpose(block_apply(f, right))
            delta_grad = factor_grad = None
            if delta.requires_grad:
                delta_grad = -products.group_inner(tu, tv).to(delta) * w.square()
            if factor.requires_grad:
                ku = products.apply(products.weighted(tu, w)).to(f).view(n, c, d)
                kv = products.apply(products.weighted(tv, w)).to(f).view(n, c, d)
                factor_grad = torch.einsum("nad,ncd->nca", left.reshape(n, k, d), kv) + torch.einsum(
                    "nad,ncd->nca", right.reshape(n, k, d), ku
                )
        return (factor_grad, delta_grad)

    # ------------------------------------------------------------------ preconditioner and probes
    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=self.dtype, device=self.device)

    def sketch(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The per-group sketches :math:`Y_g = K_g \Omega` (``(G, N·C, r)``) of the test matrix
        :math:`\Omega = L Q` (:math:`Q` Gaussian ``N·k × r``, orthonormalized): one product with :math:`r`
        columns. They do not depend on :math:`\delta`, and any test matrix gives a valid preconditioner, so one
        sketch serves every hyperparameter step at the same weights and inputs (``sketch=`` of the constructor)."""
        if self._sketch is None:
            m = self.shape[-1]
            rank = min(self.preconditioner_rank, m)
            products = self.products
            with torch.no_grad():
                q, _ = torch.linalg.qr(self._randn(m, rank))
                omega = block_apply(self.factor.detach(), q)
                jt = products.transpose(omega)
                sketches = torch.stack(
                    [products.apply(products.group_part(jt, g)).to(q) for g in range(products.num_groups)]
                )
            self._sketch = (sketches, omega)
        return self._sketch

    def nystrom(self) -> NystromPreconditioner | None:
        r"""The preconditioner :math:`P = I + L^\top \hat K(\delta) L` (:class:`NystromPreconditioner`) from
        :meth:`sketch`, built once per operator (``None`` for rank 0)."""
        if self._nystrom is None and self.preconditioner_rank > 0:
            sketches, omega = self.sketch()
            with torch.no_grad():
                y = torch.einsum("g,gmr->mr", self.prior_precision.detach().reciprocal().to(omega), sketches)
                shift = math.sqrt(self.shape[-1]) * torch.finfo(self.dtype).eps * torch.linalg.norm(y)
            self._nystrom = NystromPreconditioner(self.factor, self.prior_precision, sketches, omega, shift)
        return self._nystrom

    def _preconditioner(self) -> tuple:
        precond = self.nystrom()
        if precond is None:
            return None, None, None
        return precond.solve_closure(), precond, precond.log_det()

    def _probe_vectors_and_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        m, t = self.shape[-1], settings.num_trace_samples.value()
        with torch.no_grad():
            z = self._randn(m, t)
            precond = self.nystrom()
            if precond is not None:
                root = precond.detached_root()
                z = z + root @ self._randn(root.shape[-1], t)
            norms = torch.linalg.norm(z, dim=-2, keepdim=True)
        return z / norms, norms


class NystromPreconditioner(LinearOperator):
    r"""The preconditioner :math:`P(L, \delta) = I + L^\top \hat K(\delta) L` of :math:`B = I + L^\top K L`,
    differentiable in the site factor and the prior precisions.

    :math:`\hat K` is the randomized Nyström approximation of the kernel for a test matrix :math:`\Omega`
    (Frangella, Tropp & Udell 2023): with the sketches :math:`Y_g = K_g \Omega` and a small shift
    :math:`\nu`, :math:`Y = \sum_g \delta_g^{-1} Y_g + \nu\Omega`, :math:`\Omega^\top Y = R R^\top` and
    :math:`\hat K = Y R^{-\top} R^{-1} Y^\top \preceq K + \nu I`, so :math:`P = I + W W^\top` with
    :math:`W = L^\top Y R^{-\top}` (``N·k × r``). With :math:`\Omega = L Q` at the current factor,
    :math:`L^\top \hat K L` is the Nyström approximation of :math:`L^\top K L` for the test matrix
    :math:`Q`. Because :math:`\log|P| = \log|I_r + W^\top W|` and :math:`P`'s bilinear derivative carry the
    graph to :math:`(L, \delta)`, GPyTorch's estimator of :math:`\partial\log|B|` becomes the exact
    :math:`\partial\log|P|` plus a stochastic estimate of :math:`\operatorname{tr}(B^{-1}\partial B) -
    \operatorname{tr}(P^{-1}\partial P)`, small when :math:`P` captures the top of the spectrum (the
    variance reduction of Wenger et al. 2022), in every hyperparameter.

    Args:
        factor: :math:`L`, blocks ``(N, C, k)`` (with its graph).
        prior_precision: :math:`\delta`, ``(G,)`` (with its graph).
        sketches: :math:`Y_g = K_g\Omega`, ``(G, N·C, r)``.
        test_matrix: :math:`\Omega`, ``(N·C, r)``.
        shift: :math:`\nu`, a non-negative scalar.
    """

    def __init__(self, factor, prior_precision, sketches, test_matrix, shift) -> None:
        shift = torch.as_tensor(shift, dtype=sketches.dtype, device=sketches.device)
        super().__init__(factor, prior_precision, sketches, test_matrix, shift)
        self.factor, self.prior_precision = factor, prior_precision
        self.sketches, self.test_matrix, self.shift = sketches, test_matrix, shift
        self._detached: tuple[torch.Tensor, torch.Tensor] | None = None

    def _size(self) -> torch.Size:
        n, _, k = self.factor.shape
        return torch.Size([n * k, n * k])

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def root(self) -> torch.Tensor:
        r""":math:`W` (``N·k × r``) with :math:`P = I + W W^\top`, with its graph to :math:`(L, \delta)`."""
        omega = self.test_matrix
        y = torch.einsum("g,gmr->mr", self.prior_precision.to(omega).reciprocal(), self.sketches)
        y = y + self.shift * omega
        core = omega.mT @ y
        core = (core + core.mT) / 2
        eye = torch.eye(core.shape[-1], dtype=core.dtype, device=core.device)
        scale = core.diagonal().abs().mean().clamp_min(torch.finfo(core.dtype).tiny)
        for attempt in range(4):  # the shifted core is PD in exact arithmetic; round-off may need a nudge
            jitter = 0.0 if attempt == 0 else scale * torch.finfo(core.dtype).eps * 10 ** (2 * attempt)
            chol, info = torch.linalg.cholesky_ex(core + jitter * eye)
            if int(info) == 0:
                break
        else:  # no usable sketch: P = I
            return self.factor.new_zeros(self.shape[-1], 0)
        kroot = torch.linalg.solve_triangular(chol, y.mT, upper=False).mT  # Y R^{-T}: K̂ = kroot krootᵀ
        return block_apply(self.factor.to(kroot), kroot, transpose=True)

    def _woodbury(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._detached is None:
            with torch.no_grad():
                w = self.root()
                inner = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device) + w.mT @ w
                self._detached = (w, torch.linalg.cholesky(inner))
        return self._detached

    def detached_root(self) -> torch.Tensor:
        """:meth:`root` without a graph (computed once)."""
        return self._woodbury()[0]

    def solve_closure(self):
        r"""A function ``v ↦ P⁻¹ v = v − W (I + WᵀW)⁻¹ Wᵀ v`` (detached)."""
        w, chol = self._woodbury()

        def closure(rhs: torch.Tensor) -> torch.Tensor:
            return rhs - w @ torch.cholesky_solve(w.mT @ rhs, chol)

        return closure

    def log_det(self) -> torch.Tensor:
        r""":math:`\log|P| = \log|I_r + W^\top W|`, differentiable in :math:`(L, \delta)`."""
        w = self.root()
        inner = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device) + w.mT @ w
        return torch.linalg.slogdet(inner)[1]

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        w = self.root()
        return rhs + w @ (w.mT @ rhs)


@contextlib.contextmanager
def _gpytorch_settings(options: EvidenceOptions):
    """GPyTorch's settings for one matrix-free evaluation: CG + SLQ always (never a dense Cholesky)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(settings.max_cholesky_size(0))
        stack.enter_context(settings.fast_computations(log_prob=True))
        for value, setting in (
            (options.num_probes, settings.num_trace_samples),
            (options.cg_tolerance, settings.cg_tolerance),
            (options.max_cg_iterations, settings.max_cg_iterations),
            (options.lanczos_iterations, settings.max_lanczos_quadrature_iterations),
        ):
            if value is not None:
                stack.enter_context(setting(value))
        yield


def matrix_free_log_det(
    kernel: NTKKernel, x: torch.Tensor, factor: torch.Tensor, options: EvidenceOptions | None = None
) -> torch.Tensor:
    r""":math:`\log|I + L^\top K L|` by GPyTorch's CG and stochastic Lanczos quadrature, without forming
    :math:`K`; differentiable in :math:`\delta` and in ``factor`` (a stochastic gradient).

    Memory: the layer features of the structured layers, :math:`N(C\sum_l d^{out}_l + \sum_l d^{in}_l)`
    numbers, plus :math:`O(Nk\,t + NC\,r\,G)` for the CG vectors and the preconditioner's sketches
    (``docs/scaling.md``). The features and the sketches are kept with the kernel (per network state and
    inputs, compared by value) and reused by later hyperparameter steps.

    Args:
        kernel: the NTK kernel (unbatched prior precisions).
        x: training inputs ``(N, D)`` as the kernel takes them (no input gradients).
        factor: :math:`L` as blocks ``(N, C, k)``.
        options: probes, tolerances, preconditioner rank and seed (:class:`EvidenceOptions`).

    Returns:
        A scalar tensor in ``factor``'s dtype.

    Raises:
        ValueError: for a batched kernel, inputs that require grad, or a ``factor`` of the wrong shape.
    """
    options = check_options(options)
    delta = kernel.prior_precision
    if delta.dim() != 1:
        raise ValueError(
            f"the matrix-free route needs an unbatched kernel, got prior precisions {tuple(delta.shape)}"
        )
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("x requires grad: the matrix-free route gives gradients in the hyperparameters only")
    products = kernel_products(kernel, x)
    if factor.dim() != 3 or factor.shape[:2] != (products.num_data, products.num_outputs):
        raise ValueError(
            f"factor must have shape ({products.num_data}, {products.num_outputs}, k), got {tuple(factor.shape)}"
        )
    rank = (
        settings.max_preconditioner_size.value()
        if options.preconditioner_rank is None
        else options.preconditioner_rank
    )
    generator = None
    if options.seed is not None:
        generator = torch.Generator(device=factor.device).manual_seed(options.seed)
    key = (rank, options.seed, tuple(factor.shape), factor.dtype)
    sketch = products.sketches.get(key)
    if rank > 0 and sketch is None:  # its own random stream: a seed gives the same probes at every step
        sketch_generator = None
        if options.seed is not None:
            sketch_generator = torch.Generator(device=factor.device).manual_seed(options.seed + 1)
        builder = LaplaceSiteOperator(
            factor.detach(), delta.detach().to(factor), products, rank, sketch_generator
        )
        sketch = products.sketches[key] = builder.sketch()
    operator = LaplaceSiteOperator(factor, delta.to(factor), products, rank, generator, sketch)
    with _gpytorch_settings(options):
        _, log_det = operator.inv_quad_logdet(logdet=True)
    return log_det
