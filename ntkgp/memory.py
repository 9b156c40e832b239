r"""Every default memory budget of ntkgp, in bytes, and the one rule that turns a budget into a chunk size.

A pass over data or test points that would hold an array growing with the number of rows processes the rows in
chunks: as many rows as fit the budget,

.. math::
    \text{rows} = \max\Big(1, \min\Big(\text{largest}, \Big\lfloor \frac{\text{budget}}{w \cdot s} \Big\rfloor\Big)\Big),

with :math:`w` the numbers one row adds to the working set and :math:`s` the bytes of one number (4 in float32,
8 in float64): :func:`chunk_rows`. One row is always processed, whatever its size. The working sets :math:`w` of
each pass are in ``docs/guarantees.md`` ("Memory budgets"). Budgets that were sized in numbers are the same
number of float64 bytes, so that no pass holds more bytes than it did in float64 (a float32 pass takes chunks
twice as long, in the same bytes).
"""

from __future__ import annotations

import warnings

import torch

from .validation import count

__all__ = [
    "DENSE_EVIDENCE_BYTES",
    "FEATURE_PASS_BYTES",
    "GIB",
    "GRAM_BLOCK_BYTES",
    "INDUCING_FEATURE_BYTES",
    "INDUCING_POOL_BYTES",
    "JACOBIAN_BYTES",
    "LAST_LAYER_CHUNK_BYTES",
    "LAYER_GGN_MIN_BYTES",
    "MIB",
    "PAIR_CONTRACTION_BYTES",
    "PREDICTION_BYTES",
    "SAMPLE_EVALUATIONS",
    "SFR_GRID_BYTES",
    "SFR_STEP_BYTES",
    "STACKED_GRAM_BYTES",
    "STRUCTURED_BLOCK_BYTES",
    "chunk_rows",
    "itemsize",
    "renamed_budget",
]

MIB = 2**20
GIB = 2**30

#: :class:`~ntkgp.ntk.NTKEngine`'s ``max_jacobian_bytes``: Jacobians up to this size are kept between chunks
#: (the contraction route's second argument).
JACOBIAN_BYTES = GIB
#: One chunk's layer-feature pass (:func:`ntkgp.ntk.feature_pass.chunk_for_budget`).
FEATURE_PASS_BYTES = GIB
#: SFR's inducing-point features held at once: all when they fit; else half kept, half a window of recomputed ones.
INDUCING_FEATURE_BYTES = 4 * GIB
#: The dense function-space evidence routes (``EvidenceOptions.dense_memory_limit``): beyond it, matrix-free.
DENSE_EVIDENCE_BYTES = 4 * GIB
#: A block of the kept layer features' products (:mod:`ntkgp.ntk.products`): ``rows · width`` numbers.
GRAM_BLOCK_BYTES = 2**24 * 8
#: A block of one structured Gram term (:mod:`ntkgp.ntk.structured`): ``rows · C · N₂ · C`` numbers.
STRUCTURED_BLOCK_BYTES = 2**22 * 4  # 16 MiB: 2²² float32 numbers (larger float32 blocks measured slower)
#: One stacked Gram of many small distinct slices (:func:`ntkgp.kernels.batching.pair_grams`), all groups.
STACKED_GRAM_BYTES = 2**22 * 8
#: :class:`~ntkgp.NTKGP`'s prediction working set ``(G + 3) · chunk · C · N · C`` numbers.
PREDICTION_BYTES = 2**25 * 8
#: SFR's accumulation and prediction step without ``batch_size``: the ``G`` cross-Grams, ``chunk · G · M · C``
#: (``· C`` with joint outputs) numbers.
SFR_STEP_BYTES = 2**24 * 8
#: The factorizations SFR's marginal predictive grid keeps from chunk to chunk (``predictive_grid(...,
#: marginal=True)``): ``2 · nb · K²`` numbers per prior precision; beyond it each is refactorized per chunk.
SFR_GRID_BYTES = 2 * GIB
#: The Gram of SFR's inducing-point pool, per row block ``rows · G · C · P`` numbers.
INDUCING_POOL_BYTES = 2**25 * 8
#: The least the dense layer-block GGN's temporaries may take (their budget is a quarter of the ``P²`` result,
#: :mod:`ntkgp.laplace.ggn.layer_ggn`): ``chunk · (rows + columns)`` numbers of a block pair.
LAYER_GGN_MIN_BYTES = 2**20 * 8
#: The last-layer curvature's weighted feature outer products, ``rows · K · d`` numbers.
LAST_LAYER_CHUNK_BYTES = 2**22 * 8
#: The sampled weight-space predictive's network evaluations, ``draws · rows`` (draw, point) pairs, at a time. The one
#: budget that is a count: an evaluation's memory is the network's activations, which no formula here knows.
SAMPLE_EVALUATIONS = 16384
#: One chunk of FSVI's pair contraction, ``chunk · N₁ · C · d_out`` numbers (1 MiB: 2¹⁸ float32 numbers were the
#: fastest against keeping the chunk in cache, for K = 32, C = 10, d_out = 256 on a 2-core CPU).
PAIR_CONTRACTION_BYTES = MIB


def itemsize(dtype: torch.dtype) -> int:
    """The bytes of one number of ``dtype`` (4 for float32, 8 for float64)."""
    return torch.empty((), dtype=dtype).element_size()


def chunk_rows(budget: int, row_numbers: int, dtype: torch.dtype | int, largest: int | None = None) -> int:
    r"""The rows per chunk whose working set fits ``budget`` bytes (module docstring):
    :math:`\max(1, \min(\text{largest}, \lfloor \text{budget} / (w s) \rfloor))`.

    Args:
        budget: bytes (``>= 0``).
        row_numbers: numbers :math:`w` one row adds to the working set (``0`` counts as 1).
        dtype: the working set's dtype, or its item size in bytes :math:`s`.
        largest: at most this many rows (``None``: no cap).

    Returns:
        An ``int >= 1``.
    """
    size = dtype if isinstance(dtype, int) else itemsize(dtype)
    rows = budget // max(1, row_numbers * size)
    if largest is not None:
        rows = min(largest, rows)
    return max(1, rows)


def renamed_budget(budget: int, numbers: object, argument: str, old: str) -> int:
    """The byte budget of an argument that was given in numbers under its old name ``old`` (deprecated, counted as
    float64: ``8·numbers`` bytes), else ``budget``.

    Raises:
        ValueError: ``numbers`` not an integer ``>= 0``, naming ``old``.

    Warns:
        FutureWarning: when ``numbers`` is given, naming ``argument``.
    """
    if numbers is None:
        return budget
    numbers = count(numbers, old)
    warnings.warn(f"{old} (numbers) is deprecated: pass {argument}={8 * numbers} (bytes)", FutureWarning, stacklevel=3)
    return 8 * numbers
