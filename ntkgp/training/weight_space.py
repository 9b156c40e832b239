r"""Deprecated location of the weight-space full GGN / EF: it lives in :mod:`ntkgp.laplace.weight_space.full_curvature`.

``WeightSpaceCurvature`` is :class:`ntkgp.laplace.weight_space.full_curvature.FullCurvature` and ``weight_space_curvature`` is
:func:`ntkgp.laplace.weight_space.full_curvature.full_curvature` (same arguments); both names are kept so that existing imports
keep working. The full GGN in weight space is a sum over the data, so each rank of a ``torch.distributed``
group sums its shard and one ``all_reduce`` gives every rank the curvature of all the data: the route
:func:`~ntkgp.training.train_marglik` takes for ``structure="full_ggn"`` / ``"full_ef"`` with
``distributed=True``.
"""

from __future__ import annotations

from ..laplace.weight_space.full_curvature import FullCurvature as WeightSpaceCurvature
from ..laplace.weight_space.full_curvature import full_curvature as weight_space_curvature

__all__ = ["WeightSpaceCurvature", "weight_space_curvature"]
