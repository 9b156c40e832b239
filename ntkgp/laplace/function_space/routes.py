r"""Which route computes the log-determinant of the Laplace evidence, and with which settings.

The term :math:`\log|I_{Nk} + L^\top K L|` of :func:`ntkgp.laplace.laplace_log_marginal_likelihood` has
four routes (``method=``; ``docs/scaling.md``):

* ``"cholesky"``: a dense Cholesky factorization in function space (:math:`(Nk)^2`) or weight space
  (:math:`P^2`), whichever is smaller (:func:`~ntkgp.laplace.ggn.space.exact_space`); exact, the curvature built once per
  network state (:mod:`~ntkgp.laplace.function_space.evidence_curvature`), then :math:`O(\min(Nk, P)^3)` per
  hyperparameter step.
* ``"eigen"``: one prior precision and sites whose curvature is a scalar multiple of a fixed matrix: one
  eigendecomposition, then :math:`O(\min(Nk, P))` per step (:mod:`ntkgp.laplace.function_space.eigen`); exact.
* ``"matrix_free"``: the kernel as a matrix-free ``LinearOperator``, GPyTorch's preconditioned CG and
  stochastic Lanczos quadrature (:mod:`ntkgp.laplace.function_space.matrix_free`); a stochastic estimate, memory
  :math:`O(N(C\sum d^{out} + \sum d^{in}) + Nk(t + r))`.
* ``"auto"`` (default): ``"matrix_free"`` when the dense routes would need more than
  :attr:`EvidenceOptions.dense_memory_limit` bytes, else ``"eigen"`` where it is valid, else ``"cholesky"``
  (:func:`choose_method`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...memory import DENSE_EVIDENCE_BYTES
from ...options import EvidenceMethod, Space, choose
from ...validation import count, integer, real_number
from ..ggn.space import exact_space

__all__ = [
    "DENSE_MEMORY_LIMIT",
    "EvidenceMethod",
    "EvidenceOptions",
    "choose_method",
    "dense_memory_bytes",
]

#: Default bytes the dense routes may use before ``method="auto"`` switches to the matrix-free route (4 GiB;
#: :data:`ntkgp.memory.DENSE_EVIDENCE_BYTES`).
DENSE_MEMORY_LIMIT = DENSE_EVIDENCE_BYTES


@dataclass(frozen=True)
class EvidenceOptions:
    r"""Settings of the evidence routes. A field left ``None`` takes GPyTorch's current setting.

    Attributes:
        dense_memory_limit: bytes the dense routes (``"cholesky"``, ``"eigen"``) may use before
            ``method="auto"`` takes the matrix-free route (:func:`dense_memory_bytes`); default 4 GiB.
        num_probes: probe vectors :math:`t` of the stochastic trace/log-determinant estimate
            (``gpytorch.settings.num_trace_samples``, default 10).
        cg_tolerance: relative residual at which CG stops (``gpytorch.settings.cg_tolerance``, default 1).
        max_cg_iterations: at most this many CG iterations (``gpytorch.settings.max_cg_iterations``, 1000).
        lanczos_iterations: Lanczos steps of the quadrature, and the minimum number of CG iterations
            (``gpytorch.settings.max_lanczos_quadrature_iterations``, default 20).
        preconditioner_rank: rank :math:`r` of the randomized Nyström preconditioner (0: none;
            ``gpytorch.settings.max_preconditioner_size``, default 15).
        seed: seed of the probe vectors and the preconditioner's test matrix (``None``: torch's global
            generator, as GPyTorch does).

    Raises:
        ValueError: for a field out of range, naming it.

    Example:
        >>> EvidenceOptions(num_probes=32, cg_tolerance=0.01, seed=0).num_probes
        32
    """

    dense_memory_limit: int = DENSE_MEMORY_LIMIT
    num_probes: int | None = None
    cg_tolerance: float | None = None
    max_cg_iterations: int | None = None
    lanczos_iterations: int | None = None
    preconditioner_rank: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        count(self.dense_memory_limit, "dense_memory_limit")  # bytes
        integer(self.num_probes, "num_probes", 1, allow_none=True)
        integer(self.max_cg_iterations, "max_cg_iterations", 1, allow_none=True)
        integer(self.lanczos_iterations, "lanczos_iterations", 1, allow_none=True)
        integer(self.preconditioner_rank, "preconditioner_rank", 0, allow_none=True)
        integer(self.seed, "seed", 0, 2**63 - 2, allow_none=True)  # the preconditioner's stream is seeded with seed + 1
        if self.cg_tolerance is not None:
            real_number(self.cg_tolerance, "cg_tolerance", low_open=True, high_open=False)


def check_options(options: EvidenceOptions | None, argument: str = "options") -> EvidenceOptions:
    """``options`` or the defaults; raises ``TypeError`` naming the argument for anything else."""
    if options is None:
        return EvidenceOptions()
    if not isinstance(options, EvidenceOptions):
        raise TypeError(
            f"{argument} must be an ntkgp.laplace.EvidenceOptions or None, got {type(options).__name__}"
        )
    return options


def dense_memory_bytes(
    num_params: int,
    num_groups: int,
    num_data: int,
    num_outputs: int,
    rank: int,
    dtype: torch.dtype,
    space: Space | str,
    components: int = 1,
) -> int:
    r"""Bytes the dense routes hold at most, in ``space`` (``"auto"``: the space they would take).

    .. math::
        \text{function: } \big(G (NC)^2 + G (Nk)^2 + 3 (Nk)^2\big)\,b, \qquad
        \text{weight: } \big((NC + Nk) P + (K + 3) P^2\big)\,b

    (function space: the kernel's cached per-group Grams, the Grams of the unit rows (the same tensor for a
    Gaussian likelihood), the site matrix, its factor and inverse; weight space: the kernel's cached Jacobian,
    the rows of one chunk at most, the ``K`` curvature components (``components``: 1, or ``C`` per-output
    Gaussian noises, ``C²`` for their empirical Fisher) and the ``P × P`` matrix, its factor and inverse),
    :math:`b` bytes per number.
    """
    b = dtype.itemsize
    nc, nk, p = num_data * num_outputs, num_data * rank, num_params
    if exact_space(space, p, nk) is Space.FUNCTION:
        return (num_groups * (nc * nc + nk * nk) + 3 * nk * nk) * b
    return ((nc + nk) * p + (components + 3) * p * p) * b


def choose_method(
    method: EvidenceMethod | str,
    dense_bytes: int,
    options: EvidenceOptions,
    eigen_problem: str | None,
) -> EvidenceMethod:
    """Resolve ``method="auto"`` (an explicit method is returned as it is, after validation).

    Args:
        method: the requested method.
        dense_bytes: :func:`dense_memory_bytes` of the problem.
        options: the settings (``dense_memory_limit``).
        eigen_problem: why the eigen route does not apply, or ``None`` when it does.

    Returns:
        ``MATRIX_FREE`` when ``dense_bytes > options.dense_memory_limit``, else ``EIGEN`` when it applies,
        else ``CHOLESKY``.
    """
    method = choose(EvidenceMethod, method, "method")
    if method is not EvidenceMethod.AUTO:
        return method
    if dense_bytes > options.dense_memory_limit:
        return EvidenceMethod.MATRIX_FREE
    return EvidenceMethod.EIGEN if eigen_problem is None else EvidenceMethod.CHOLESKY
