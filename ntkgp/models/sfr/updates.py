r"""The statistics of new data for :meth:`SFR.update <ntkgp.models.sfr.SFR.update>`, summed aside.

The new points' Gaussian sites sit at the network's outputs (one step: the update then equals building on the
union with the same ``Z``) or at the mode of the sparse model given the old sites (:mod:`~ntkgp.models.sfr.iterated`).
Every batch is checked before its terms are added, and the sums are formed aside: the caller adds them to the
model only on success, so a bad batch leaves it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ...distributed import together
from .factorization import group_weights, inducing_feature_set, kzz_factors
from .iterated import iterated_update
from .statistics import DualStatistics
from .streaming import counted, stream_statistics
from .validation import pack_data, training_batches

__all__ = ["new_statistics"]


def new_statistics(sfr, x_new: Tensor | Iterable[tuple[Tensor, Tensor]], y_new: Tensor | None, iterate: bool | None):
    """The statistics of ``(x_new, y_new)`` for ``sfr`` (all-reduced over the ranks with ``distributed=True``),
    not yet added; see :meth:`SFR.update <ntkgp.models.sfr.SFR.update>` for the arguments and errors."""
    if iterate is None:
        iterate = not sfr.distributed
    if not isinstance(iterate, bool):
        raise TypeError(f"iterate must be True, False or None, got {iterate!r}")
    stats: DualStatistics = sfr.dual_statistics
    if iterate and sfr.distributed and not stats.gaussian:
        raise ValueError("iterate=True is not data-parallel: a model built with distributed=True takes iterate=False")
    with together("SFR.update", sfr.distributed):  # this rank's shard of the new data
        sfr._check_state()
        x_new = pack_data(sfr.engine.net, x_new, y_new, "x_new")  # structured inputs: packed rows (ntk.packed_inputs)
        if torch.is_tensor(x_new) and y_new is None:
            raise ValueError("y_new is required when x_new is a tensor")
        batches = counted(x_new, training_batches(x_new, y_new, "new"))
        rows = sfr._rows_per_step()
        args = (sfr.engine, sfr.likelihood, sfr.inducing_points, sfr.output_coupling, sfr.prior_mean, batches)
        if iterate and not stats.gaussian:
            with torch.no_grad():
                weights = group_weights(sfr).detach()
                slots = stats.slot_weights(sfr.likelihood).detach()
                inducing = kzz_factors(sfr, weights)
            new = iterated_update(*args, sfr._layout, sfr.num_outputs, stats, inducing, weights, slots, rows,
                                  inducing_feature_set(sfr), sfr.progress)
            new.iterated_sites = True  # at the mode on all of Z: SFR.select_inducing refuses such statistics
        else:
            new = stream_statistics(
                *args, sfr._layout, rows, "new", sfr.progress, prior_precision=stats.prior_precision,
                z_features=inducing_feature_set(sfr),
            )
    return new.all_reduce_(sfr.distributed)
