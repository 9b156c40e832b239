"""The front door: compute a scalable Laplace curvature structure by name."""

from __future__ import annotations

from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ..ntk.groups import GroupSpec
from .base import Curvature
from .data_pass import Data
from .diagonal import diagonal_ef, diagonal_ggn
from .kfac import kfac_ggn

STRUCTURES = {"diag_ggn": diagonal_ggn, "diag_ef": diagonal_ef, "kfac": kfac_ggn}


def compute_curvature(
    net: nn.Module,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    structure: str = "kfac",
    groups: GroupSpec = "layer",
    batch_size: int = 64,
    progress: bool = False,
    input_shape: tuple[int, ...] | None = None,
) -> Curvature:
    r"""Compute the curvature ``structure`` of ``net`` at its current weights :math:`\theta^*`, once.

    The result evaluates :meth:`~ntkgp.curvature.Curvature.log_det` and
    :meth:`~ntkgp.curvature.Curvature.log_evidence` for any prior precisions and likelihood hyperparameters
    without another pass over the data (the K hyperparameter steps of Algorithm 1).

    :param net: the trained network, ``(N, *input_shape) -> (N, C)``, BatchNorm/dropout in eval mode. It is
        not modified (weights, flags, mode, hooks).
    :param x: training inputs ``(N, ...)``, or an iterable of ``(x_b, y_b)`` batches (e.g. a ``DataLoader``)
        with ``y=None``.
    :param y: training targets (any form :func:`~ntkgp.likelihoods.validate_targets` accepts).
    :param likelihood: a supported likelihood; its current noise/temperature is used for the pass, and
        later evaluations follow any new value.
    :param structure: ``"diag_ggn"`` (:class:`~ntkgp.curvature.DiagonalGGN`), ``"diag_ef"``
        (:class:`~ntkgp.curvature.DiagonalEF`) or ``"kfac"`` (:class:`~ntkgp.curvature.KroneckerGGN`).
    :param groups: prior-precision groups, see :func:`ntkgp.ntk.resolve_groups`; ``"kfac"`` needs the weight
        and bias of each ``Linear``/``Conv2d`` layer in one group (``"layer"`` or ``"network"``).
    :param batch_size: examples per batch when ``x`` is a tensor.
    :param progress: show a tqdm progress bar over the batches.
    :param input_shape: shape of one input; flat ``(N, D)`` inputs are reshaped to it.
    """
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {sorted(STRUCTURES)}, got {structure!r}")
    return STRUCTURES[structure](
        net, x, y, likelihood, groups=groups, batch_size=batch_size, progress=progress, input_shape=input_shape
    )
