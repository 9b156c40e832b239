r"""The full GGN (or empirical Fisher) in weight space as a sum over the data, for data-parallel training.

The exact Laplace-GGN evidence of :class:`~ntkgp.NTKGP` (docs/math.md, "Laplace-GGN evidence") needs, in
weight space, :math:`\log|H + P_0|` with :math:`H = \sum_n J_n^\top \Lambda_n J_n` (or
:math:`\sum_n J_n^\top g_n g_n^\top J_n`): a sum over the data, so each rank of a ``torch.distributed`` group
sums its shard and one ``all_reduce`` gives every rank :math:`H` of all the data. (The function-space form
factorizes the :math:`NC \times NC` Gram, which couples every pair of points and does not split into
shards.) This is the route :func:`~ntkgp.training.train_marglik` takes for ``structure="full_ggn"`` /
``"full_ef"`` with ``distributed=True``; the value equals NTKGP's, :math:`\log|I + W^\top W| = \log|H + P_0| -
\log|P_0|`.

Like the diagonal curvatures (:mod:`ntkgp.curvature.diagonal`) :math:`H` is stored as components
:math:`D_k` computed with the unit factors of :mod:`ntkgp.curvature.scaling` and re-weighted by the output
scale :math:`s`, so it follows the noise or temperature without another pass. Memory :math:`K P^2`
(``K`` = 1, ``C`` or ``C²``): for networks with up to some ten thousand parameters; use ``"kfac"`` or a
diagonal beyond.
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ..curvature.base import Curvature
from ..curvature.data_pass import Data, DataPass
from ..ntk import ParameterGroups
from ..ntk.groups import GroupSpec
from ..options import Curvature as CurvatureKind
from ..options import choose

__all__ = ["WeightSpaceCurvature", "weight_space_curvature"]


class WeightSpaceCurvature(Curvature):
    r"""The dense :math:`H = \sum_k w_k(s) D_k` (``(P, P)``), exact: :math:`\log|H + P_0|` by a Cholesky factor.

    Args:
        groups, theta_sq_norms, f, y, scale_size: as :class:`~ntkgp.curvature.Curvature`.
        components: :math:`D_k`, ``(K, P, P)``, columns in the order of ``groups.names``.
        fisher: ``True`` for the empirical Fisher (weights :math:`s_c s_{c'}`), ``False`` for the GGN (:math:`s`).
    """

    def __init__(
        self,
        groups: ParameterGroups,
        theta_sq_norms: Tensor,
        f: Tensor,
        y: Tensor,
        scale_size: int,
        components: Tensor,
        fisher: bool,
    ) -> None:
        super().__init__(groups, theta_sq_norms, f, y, scale_size)
        self.components = components
        self.fisher = fisher
        self.structure = "full_ef" if fisher else "full_ggn"

    def dense(self, likelihood: Likelihood) -> Tensor:
        s = self.scale(likelihood)
        weights = (s[:, None] * s[None, :]).reshape(-1) if self.fisher else s
        return torch.einsum("k,kpq->pq", weights, self.components)

    def log_det(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\log|H + P_0|` by a Cholesky factorization, :math:`O(P^3)`."""
        delta = self.prior_precision_vector(prior_precision)
        matrix = self.dense(likelihood) + torch.diag(delta[self.column_groups])
        return 2 * torch.linalg.cholesky(matrix).diagonal().log().sum()


def weight_space_curvature(
    net: nn.Module,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    curvature: str = "ggn",
    prior_structure: GroupSpec = "layer",
    batch_size: int = 64,
    progress: bool = False,
    input_shape: tuple[int, ...] | None = None,
    distributed: bool = False,
) -> WeightSpaceCurvature:
    r"""One pass over (this rank's shard of) the data: per-example rows :math:`J_n^\top u_{nm}`, summed as
    :math:`D_k`; with ``distributed``, summed over the ranks too.

    Args:
        curvature: ``"ggn"`` (:math:`u_n` the columns of :math:`\tilde L_n`) or ``"ef"`` (:math:`u_n = \tilde g_n`,
            one column per output for Gaussian likelihoods).
        Others: as :func:`~ntkgp.curvature.compute_curvature`.
    """
    fisher = choose(CurvatureKind, curvature, "curvature") is CurvatureKind.EF
    data = DataPass.start(net, likelihood, prior_structure, input_shape, distributed)
    names = list(data.engine.groups.names)
    per_output = data.scale0.shape[0] > 1
    total = 0
    for xb, fb, yb in data.batches(x, y, batch_size, progress, "weight-space GGN"):
        if fisher:
            g = data.unit_gradient(fb, yb)
            cot = torch.diag_embed(g) if per_output else g.unsqueeze(-1)
        else:
            cot = data.unit_hessian_sqrt(fb, yb)
        rows = data.per_example_vjps(xb, cot, names)  # (n, M, P)
        if fisher and per_output:
            part = torch.einsum("nap,nbq->abpq", rows, rows).flatten(0, 1)  # (C², P, P)
        elif per_output:
            part = torch.einsum("ncp,ncq->cpq", rows, rows)  # (C, P, P)
        else:
            part = torch.einsum("nmp,nmq->pq", rows, rows)[None]  # (1, P, P)
        total = total + part
    data.reduce([total])
    f_all, y_all = data.collected()
    return WeightSpaceCurvature(data.engine.groups, data.theta_sq_norms(), f_all, y_all, data.scale0.shape[0],
                                total, fisher)
