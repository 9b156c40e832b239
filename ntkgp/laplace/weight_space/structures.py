"""The one place that maps a curvature structure's name to what computes it: :func:`compute_curvature`'s
builder and :func:`~ntkgp.laplace.weight_space.laplace_posterior`'s posterior class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ...ntk.groups import GroupSpec
from ...options import Structure, choose
from ...progress import check_progress
from ..ggn.curvature import Curvature
from ..ggn.data_pass import Data
from .diagonal.laplace import DiagLaplace
from .diagonal.curvature import diagonal_ef, diagonal_ggn
from ..ggn.full_curvature import full_ef, full_ggn
from .full.laplace import FullLaplace
from .kfac.curvature import check_kfac_approximation, kfac_ggn
from .kfac.laplace import KFACLaplace
from .last_layer.laplace import LastLayerLaplace
from .last_layer.structured import LastLayerDiagLaplace, LastLayerKFACLaplace
from .posterior.weight_posterior import WeightPosterior
from ..ggn.sampled_ggn import check_generator


@dataclass(frozen=True)
class StructureClasses:
    """What computes one structure.

    Attributes:
        curvature: the builder of its :class:`~ntkgp.laplace.weight_space.Curvature` (one pass over the data).
        posterior: its :class:`~ntkgp.laplace.weight_space.WeightPosterior` class.
        kind: the curvature it approximates, ``"ggn"`` or ``"ef"`` (empirical Fisher).
        exact: whether it is the dense :math:`P \times P` curvature itself, which may equally be built in function
            space (:func:`~ntkgp.laplace.weight_space.exact_curvature`, whichever side is smaller).
        posterior_arguments: the fixed keyword arguments of the posterior class (``curvature="ggn"`` / ``"ef"``).
    """

    curvature: Callable[..., Curvature]
    posterior: type[WeightPosterior]
    kind: str = "ggn"
    exact: bool = False
    posterior_arguments: dict = field(default_factory=dict)


#: The structures by name (:class:`ntkgp.options.Structure`).
STRUCTURE_CLASSES: dict[Structure, StructureClasses] = {
    Structure.FULL_GGN: StructureClasses(full_ggn, FullLaplace, "ggn", True, {"curvature": "ggn"}),
    Structure.FULL_EF: StructureClasses(full_ef, FullLaplace, "ef", True, {"curvature": "ef"}),
    Structure.KFAC: StructureClasses(kfac_ggn, KFACLaplace, "ggn"),
    Structure.DIAG_GGN: StructureClasses(diagonal_ggn, DiagLaplace, "ggn", False, {"curvature": "ggn"}),
    Structure.DIAG_EF: StructureClasses(diagonal_ef, DiagLaplace, "ef", False, {"curvature": "ef"}),
}

#: The last-layer posterior of each structure (``subset="last_layer"``) and its fixed keyword arguments.
LAST_LAYER_CLASSES: dict[Structure, tuple[type[WeightPosterior], dict]] = {
    Structure.FULL_GGN: (LastLayerLaplace, {"curvature": "ggn"}),
    Structure.FULL_EF: (LastLayerLaplace, {"curvature": "ef"}),
    Structure.KFAC: (LastLayerKFACLaplace, {}),
    Structure.DIAG_GGN: (LastLayerDiagLaplace, {"curvature": "ggn"}),
    Structure.DIAG_EF: (LastLayerDiagLaplace, {"curvature": "ef"}),
}


def compute_curvature(
    net: nn.Module,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    structure: str = "kfac",
    prior_structure: GroupSpec = "layer",
    batch_size: int = 64,
    progress: bool | None = None,
    input_shape: tuple[int, ...] | None = None,
    distributed: bool = False,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    kfac_approximation: str = "expand",
) -> Curvature:
    r"""Compute the curvature ``structure`` of ``net`` at its current weights :math:`\theta^*`, once.

    The result evaluates :meth:`~ntkgp.laplace.weight_space.Curvature.log_det` and
    :meth:`~ntkgp.laplace.weight_space.Curvature.log_marginal_likelihood` for any prior precisions and likelihood
    hyperparameters without another pass over the data (the K hyperparameter steps of Algorithm 1).

    Args:
        net: the trained network, ``(N, *input_shape) -> (N, C)``, BatchNorm/dropout in eval mode. It is not
            modified (weights, flags, mode, hooks).
        x: training inputs ``(N, ...)``, or an iterable of ``(x_b, y_b)`` batches (e.g. a ``DataLoader``) with
            ``y=None``. Tensor inputs are validated in full (every row) before the pass.
        y: training targets (any form :func:`~ntkgp.likelihoods.validate_targets` accepts).
        likelihood: a supported likelihood; its current noise/temperature is used for the pass, and later
            evaluations follow any new value.
        structure: ``"diag_ggn"`` (:class:`~ntkgp.laplace.weight_space.DiagonalGGN`), ``"diag_ef"``
            (:class:`~ntkgp.laplace.weight_space.DiagonalEF`), ``"kfac"``
            (:class:`~ntkgp.laplace.weight_space.KroneckerGGN`) or ``"full_ggn"`` / ``"full_ef"`` (the dense
            weight-space :class:`~ntkgp.laplace.weight_space.FullCurvature`, :math:`P \times P`), members of
            :class:`ntkgp.options.Structure`.
        prior_structure: prior-precision groups, see :func:`ntkgp.ntk.resolve_groups`; ``"kfac"`` needs the
            weight and bias of each ``Linear``/``Conv2d`` layer in one group (``"layer"`` or ``"network"``).
        batch_size: examples per batch when ``x`` is a tensor.
        progress: ``None`` (auto: a bar on a terminal, else one line with the pass's estimated time when it is
            long), ``True`` (a bar) or ``False`` (silent): :mod:`ntkgp.progress`.
        input_shape: shape of one input; flat ``(N, D)`` inputs are reshaped to it.
        distributed: each rank of an initialized ``torch.distributed`` process group passes its shard of the
            data (the network replicated on every rank, as in DDP); the sums over the data are all-reduced, so
            every rank gets the curvature of all the data (docs/scaling.md, "Several processes and GPUs").
        mc_samples: ``None`` (the exact GGN) or :math:`S`: a Monte-Carlo GGN from :math:`S` sampled roots of a
            softmax likelihood's Hessian per example — :math:`S` backward passes per batch instead of
            :math:`C - 1`, unbiased for the GGN and its diagonal
            (:mod:`~ntkgp.laplace.ggn.sampled_ggn`); ``"kfac"``, ``"diag_ggn"`` and ``"full_ggn"``.
        generator: the samples' ``torch.Generator`` (``None``: torch's global one).
        kfac_approximation: for ``"kfac"``, on layers with several locations per example (convolutions,
            ``nn.Linear`` on sequences): ``"expand"`` (each location a term of the factors' sums) or ``"reduce"`` (each example's
            locations reduced first); Eschenhagen et al. (2023), :func:`~ntkgp.laplace.weight_space.kfac_ggn`.

    Returns:
        The :class:`~ntkgp.laplace.weight_space.Curvature`.

    Raises:
        ValueError: an unknown ``structure``, or invalid data, naming the argument.

    Example:
        >>> import torch
        >>> from ntkgp.likelihoods import SoftmaxLikelihood
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(20, 2), torch.randint(0, 3, (20,))
        >>> likelihood = SoftmaxLikelihood(num_classes=3)
        >>> curvature = compute_curvature(net, x, y, likelihood, structure="kfac")
        >>> curvature.log_marginal_likelihood(1.0, likelihood).shape
        torch.Size([])
    """
    chosen = choose(Structure, structure, "structure")
    check_progress(progress)
    sampled = {}
    if mc_samples is not None or generator is not None:
        if chosen not in (Structure.KFAC, Structure.DIAG_GGN, Structure.FULL_GGN):
            raise ValueError(
                f"mc_samples samples the GGN's Hessian roots (structure 'kfac', 'diag_ggn' or 'full_ggn'); "
                f"{chosen.value!r} is an empirical Fisher: pass mc_samples=None"
            )
        sampled = {"mc_samples": mc_samples, "generator": check_generator(generator)}
    check_kfac_approximation(kfac_approximation)
    approximation = {} if kfac_approximation == "expand" else {"kfac_approximation": kfac_approximation}
    if approximation and chosen is not Structure.KFAC:
        raise ValueError(f"kfac_approximation applies to structure 'kfac', not {chosen.value!r}")
    return STRUCTURE_CLASSES[chosen].curvature(
        net, x, y, likelihood, prior_structure=prior_structure, batch_size=batch_size, progress=progress,
        input_shape=input_shape, distributed=distributed, **sampled, **approximation,
    )
