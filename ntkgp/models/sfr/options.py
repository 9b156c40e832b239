r"""The option groups of :class:`~ntkgp.models.sfr.SFR`: how its inducing inputs are chosen and how its passes use
memory (:mod:`ntkgp.option_groups`).

Each is a frozen dataclass; its fields are checked, naming them, by the constructor before anything is computed,
and remain the model's attributes (``sfr.batch_size``, ``sfr.seed``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SFRInducingOptions", "SFRMemoryOptions"]


@dataclass(frozen=True)
class SFRInducingOptions:
    """How :class:`~ntkgp.models.sfr.SFR` chooses ``num_inducing`` inducing inputs from the training inputs.

    Attributes:
        inducing_method: ``"random"`` (a seeded uniform subset) or ``"greedy_variance"``
            (:mod:`~ntkgp.models.sfr.inducing_points`).
        pool_size: candidates for ``"greedy_variance"``.
        seed: seed of the random choices (inducing subset, candidate pool).

    Example:
        >>> SFRInducingOptions(inducing_method="greedy_variance", pool_size=512).seed
        0
    """

    inducing_method: str = "random"
    pool_size: int = 4096
    seed: int = 0


@dataclass(frozen=True)
class SFRMemoryOptions:
    r"""How :class:`~ntkgp.models.sfr.SFR`'s passes over the data and test points use memory.

    Attributes:
        batch_size: points per accumulation step, and per prediction chunk (``sfr(x, chunk_size=...)``
            overrides it); default: as many as keep the ``G`` cross-Grams within
            :data:`ntkgp.memory.SFR_STEP_BYTES`, or, when inducing inputs are recomputed in windows, within a
            quarter of a window's features (:func:`~ntkgp.models.sfr.system_grams.rows_per_step`; docs/scaling.md).
        chunk_size: examples per Jacobian / feature chunk of the NTK engine; default: as many as keep one chunk's
            feature pass within :data:`ntkgp.memory.FEATURE_PASS_BYTES`, at most 1,024
            (:func:`~ntkgp.models.sfr.system_grams.auto_chunk_size`).
        statistics: ``"per_group"`` (default: per pair of prior groups, so that :math:`\delta` can change, and
            be learned by the evidence, without the data) or ``"combined"`` (for the combined kernel at the
            initial :math:`\delta`, ``G²`` times less memory; :math:`\delta` fixed, see
            :class:`~ntkgp.models.sfr.SFR`).
        inducing_feature_bytes: the bytes of the inducing inputs' float64 layer features held at any moment
            (about ``(C·P_c + Σ d_in + C·Σ d_out)·8`` per inducing input, ``P_c`` the convolution and other
            contracted parameters). When all ``M`` fit, all are kept for the model's life; otherwise those within
            half of it are kept and the others are recomputed in windows of the other half, each window once per
            step of data or chunk of test points, which are passed through the network again for it
            (:func:`~ntkgp.models.sfr.system_grams.feature_split`, docs/sfr.md). Default
            :data:`ntkgp.memory.INDUCING_FEATURE_BYTES` (4 GiB); raise it where memory allows keeping all ``M``
            (fixed after construction).

    Example:
        >>> SFRMemoryOptions(batch_size=256).statistics
        'per_group'
    """

    batch_size: int | None = None
    chunk_size: int | None = None
    statistics: str = "per_group"
    inducing_feature_bytes: int | None = None
