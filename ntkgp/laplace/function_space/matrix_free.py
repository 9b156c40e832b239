r"""The Laplace evidence without forming the kernel: a matrix-free ``LinearOperator`` and GPyTorch's CG + SLQ.

The log-determinant of the evidence (docs/math.md, "Laplace-GGN evidence") is

.. math::
    \log\lvert B \rvert, \qquad B = I_{Nk} + L^\top K L, \qquad
    K = J P_0^{-1} J^\top = \sum_g \delta_g^{-1} J_g J_g^\top,

with :math:`L` the block-diagonal site factor (:math:`L_n L_n^\top = \Lambda_n`; for a Gaussian likelihood
:math:`L = \sigma^{-1} I` and :math:`\log|B| = \log|K + \sigma^2 I| - NC\log\sigma^2`).
:class:`~ntkgp.laplace.function_space.site_operator.LaplaceSiteOperator` is :math:`B` as a ``linear_operator`` ``LinearOperator`` whose product is
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
import threading
import weakref

import torch
from linear_operator import settings

from ...caching import ValueCache
from ...kernels import NTKKernel
from ...ntk.products import NTKProducts
from .routes import EvidenceOptions, check_options
from .site_operator import LaplaceSiteOperator

__all__ = ["kernel_products", "matrix_free_log_det"]

_PRODUCTS: weakref.WeakKeyDictionary[NTKKernel, ValueCache] = weakref.WeakKeyDictionary()


def kernel_products(kernel: NTKKernel, x: torch.Tensor) -> NTKProducts:
    """The :class:`~ntkgp.ntk.products.NTKProducts` of ``kernel`` at ``x``, cached by the values
    of ``x`` and of the network's weights and buffers (one entry per kernel)."""
    cache = _PRODUCTS.setdefault(kernel, ValueCache(size=1))
    engine = kernel.engine
    state = engine.network_state()
    return cache.get_or_compute("products", [x], lambda: engine.products(x), state=state)


#: GPyTorch's settings are process-wide class attributes, saved and restored by each ``with``: two threads inside at
#: once could restore each other's values and leave them set for good. Matrix-free evaluations are serialized.
_SETTINGS_LOCK = threading.RLock()


@contextlib.contextmanager
def _gpytorch_settings(options: EvidenceOptions):
    """GPyTorch's settings for one matrix-free evaluation: CG + SLQ always (never a dense Cholesky); one thread at a
    time (:data:`_SETTINGS_LOCK`)."""
    with _SETTINGS_LOCK, contextlib.ExitStack() as stack:
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
