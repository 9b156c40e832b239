r"""SFR on a subset of its inducing inputs, from the kept statistics alone: no pass over the data.

Every quantity SFR keeps about :math:`Z` is a sum over the data of products of its rows, or a Gram of its rows
(:mod:`~ntkgp.models.sfr.statistics`, :mod:`~ntkgp.models.sfr.system_grams`):

.. math::
    A_{gh} = \sum_n K_{g, Z x_n} \Lambda_n K_{h, x_n Z}, \qquad b_g = \sum_n K_{g, Z x_n} r_n, \qquad
    K_{g, ZZ},

so for a subset :math:`S` of the inducing inputs, :math:`A_{gh}[S, S]`, :math:`b_g[S]` and
:math:`K_{g,ZZ}[S, S]` are exactly the statistics and Gram of :math:`Z_S` (rows ``m·C + c`` of the joint system
for each ``m`` in :math:`S`, rows ``m`` of each output's independent system); the terms that do not involve
:math:`Z` (:math:`\sum_n \operatorname{tr}(\Lambda_n K_{nn})`, the data fit, :math:`N`) are the same. The new model
is the SFR built on the same data with ``inducing_points=Z[S]``, up to rounding (docs/sfr.md, "Fewer inducing
points without the data").

Not a sub-block, hence refused: statistics that hold sites placed by an iterated update
(``update(..., iterate=True)`` with a classification likelihood): the new sites sit at the mode of the sparse
model on all of :math:`Z`, which moves with :math:`Z`.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import Tensor

from ...distributed import check_replicated
from ...options import OutputCoupling
from .factorization import PosteriorCache
from .guard import StateGuard, state_key
from .statistics import DualStatistics

__all__ = ["InducingSelection", "inducing_index", "select_statistics", "system_rows"]

_ITERATED = (
    "select_inducing: this SFR's statistics hold sites placed by an iterated update (update(..., iterate=True) "
    "with a classification likelihood): those sites sit at the mode of the sparse model on all its inducing "
    "inputs, so a sub-block of the statistics is not the SFR on fewer inducing inputs. Select before such "
    "updates (or update with iterate=False, whose sites do not depend on Z), or build a new SFR with "
    "inducing_points=sfr.inducing_points[index]"
)
_UNKNOWN = (
    "select_inducing: this SFR's statistics were loaded from a state dict saved without the kind of its sites "
    "(before SFR kept it), so whether an iterated update placed them is unknown; build a new SFR with "
    "inducing_points=sfr.inducing_points[index]"
)


def inducing_index(index: object, size: int) -> Tensor:
    """``index`` checked against ``size`` inducing inputs, as a 1-D ``long`` CPU tensor of distinct positions.

    Args:
        index: an int ``m`` (the first ``m``), a 1-D integer tensor or sequence of positions, or a 1-D boolean mask
            of length ``size``.
        size: ``M``.

    Raises:
        TypeError: for another type or dtype; ValueError: for an empty selection, a position out of
            ``[0, size)``, a repeated position or a mask of the wrong shape.
    """
    if isinstance(index, bool) or (torch.is_tensor(index) and index.dim() == 0):
        raise TypeError(f"index must be an int, a 1-D integer tensor or a 1-D boolean mask, got {index!r}")
    if not torch.is_tensor(index):
        try:
            m = operator.index(index)
        except TypeError:
            m = None
        if m is not None:
            if not 1 <= m <= size:
                raise ValueError(f"index must be between 1 and the model's {size} inducing inputs, got {m}")
            return torch.arange(m)
        if not isinstance(index, (list, tuple, range)) or any(isinstance(i, bool) for i in index):
            raise TypeError(f"index must be an int, a 1-D integer tensor or a 1-D boolean mask, got "
                            f"{type(index).__name__}")
        try:
            index = torch.as_tensor(list(index), dtype=torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError("index must be an int, a 1-D integer tensor or a 1-D boolean mask; the sequence "
                            "holds something other than ints") from None
    if index.dim() != 1:
        raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
    index = index.detach().cpu()
    if index.dtype == torch.bool:
        if index.shape[0] != size:
            raise ValueError(f"index, a boolean mask, must have the model's {size} entries, got {index.shape[0]}")
        index = index.nonzero().squeeze(-1)
    elif index.is_floating_point() or index.is_complex():
        raise TypeError(f"index must hold integers or booleans, got dtype {index.dtype}")
    index = index.long()
    if index.numel() == 0:
        raise ValueError("index selects no inducing inputs")
    if bool((index < 0).any()) or bool((index >= size).any()):
        bad = index[(index < 0) | (index >= size)][0].item()
        raise ValueError(f"index holds {bad}, outside the model's inducing inputs 0 … {size - 1}")
    if torch.unique(index).numel() != index.numel():
        raise ValueError("index holds a position twice: the inducing inputs of an SFR are distinct rows of its "
                         "statistics")
    return index


def system_rows(index: Tensor, num_outputs: int, coupling: OutputCoupling) -> Tensor:
    """The rows of one system that belong to the inducing inputs ``index``: ``m·C + c`` (joint, interleaved) or
    ``m`` (independent)."""
    if coupling is OutputCoupling.JOINT:
        return (index[:, None] * num_outputs + torch.arange(num_outputs)).reshape(-1)
    return index


def select_statistics(stats: DualStatistics, index: Tensor) -> DualStatistics:
    """New :class:`DualStatistics` of the inducing inputs ``index``: the sub-blocks of ``stats`` (module doc); the
    terms that do not involve :math:`Z` copied. ``stats`` is not changed."""
    new = DualStatistics(
        stats.kernel_groups, index.numel(), stats.num_outputs, stats.coupling, stats.gaussian,
        stats.precision.dtype, stats.precision.device, stats.prior_precision,
    )
    rows = system_rows(index, stats.num_outputs, stats.coupling).to(stats.precision.device)
    groups = torch.arange(stats.num_groups, device=rows.device)
    stacked = (groups[:, None] * stats.size + rows[None, :]).reshape(-1)  # the rows in every group block
    with torch.no_grad():
        for slot in range(stats.precision.shape[0]):  # one slot's block at a time beside the new statistics
            new.precision[slot] = stats.precision[slot][stacked[:, None], stacked[None, :]]
        new.residual.copy_(stats.residual[..., rows])
        for name in ("trace", "fit", "log_lik", "num_data"):
            getattr(new, name).copy_(getattr(stats, name))
    new.train(stats.training)
    return new


class InducingSelection:
    r"""The :meth:`select_inducing` method of :class:`~ntkgp.models.SFR`."""

    def select_inducing(self, index: int | Tensor):
        r"""A new SFR on a subset :math:`S` of the inducing inputs, from sub-blocks of the kept statistics: no
        pass over the data.

        :math:`B_u`'s per-group terms :math:`\sum_n K_{g,Zx_n}\Lambda_n K_{h,x_nZ}`, :math:`\tilde y_u`'s
        :math:`\sum_n K_{g,Zx_n} r_n` and :math:`K_{g,ZZ}` restricted to the rows and columns of :math:`S` are
        exactly those of :math:`Z_S` (:mod:`~ntkgp.models.sfr.subset`): the result equals the SFR built on the
        same data with ``inducing_points=sfr.inducing_points[index]`` (to rounding), at this model's prior
        precisions, likelihood and options. Cost ``O(S_n·(G·|S|C')²)`` copies (``C' = C`` joint, 1 independent;
        ``S_n`` slots), the new statistics' memory; the features of :math:`Z_S` are computed (one Jacobian pass
        over the ``|S|`` inducing inputs) at the first prediction or update. Everything of the new model is its
        own (statistics, kernel hyperparameters, likelihood) except the network, held by reference as always:
        it predicts, updates, tunes :math:`\delta` and saves independently of this one, which is not changed.
        ``inducing_method``, ``seed`` and ``pool_size`` keep saying how this model's inducing inputs were chosen.

        Args:
            index: an int ``m``, the first ``m`` inducing inputs (nested sets: ``Z[:m]``); a 1-D integer tensor
                (or list) of distinct positions, in the order the new ``Z`` takes; or a 1-D boolean mask of length
                ``M``.

        Returns:
            The new :class:`~ntkgp.models.SFR`, in this model's ``train()``/``eval()`` mode.

        Raises:
            TypeError, ValueError: for an invalid ``index`` (naming it), before anything is computed;
            RuntimeError: if the network's weights or ``Z`` changed since the statistics were computed, or the
            statistics hold sites of an iterated update (``update(..., iterate=True)``, classification), which
            depend on all of ``Z`` (module doc).

        Example:
            >>> sfr = ntkgp.SFR(net, x, y, SoftmaxLikelihood(10), num_inducing=16, output_coupling="independent")
            >>> small = sfr.select_inducing(8)  # the SFR on sfr.inducing_points[:8], without the data
            >>> small.num_inducing
            8
        """
        index = inducing_index(index, self.num_inducing)
        self._guard.check(self.engine, self.inducing_points)  # the statistics still describe the network
        stats = self.dual_statistics
        if stats.iterated_sites is None:
            raise RuntimeError(_UNKNOWN)
        if stats.iterated_sites:
            raise RuntimeError(_ITERATED)
        check_replicated([index], "index", self.distributed)
        device = self.inducing_points.device
        z = self.inducing_points[index.to(device)].clone()
        rows = system_rows(index, self.num_outputs, self.output_coupling).to(self._zz_grams.device)
        zz = self._zz_grams[..., rows[:, None], rows[None, :]]  # advanced indexing: a new tensor
        # every Z-dependent piece is replaced; the rest (the kernel, likelihood, options) is copied, the network
        # shared (NTKEngine.__deepcopy__)
        replaced = [
            (self.inducing_points, z),
            (stats, select_statistics(stats, index)),
            (self._zz_grams, zz),
            (self._state_key, state_key(self.engine, z).to(self._state_key.device)),
            (self._guard, StateGuard.of(self.engine, z)),
            (self._cache, PosteriorCache()),
        ]
        return copy.deepcopy(self, {id(old): new for old, new in replaced})
