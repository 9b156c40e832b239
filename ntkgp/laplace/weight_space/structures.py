"""The front door: compute a scalable Laplace curvature structure by name."""

from __future__ import annotations

from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ...ntk.groups import GroupSpec
from ...options import Structure, choose, renamed_argument
from .curvature import Curvature, unexpected
from .data_pass import Data
from .diagonal import diagonal_ef, diagonal_ggn
from .kfac import kfac_ggn

# the structures computed here (the full GGN/EF are the function-space evidence of ntkgp's models)
_STRUCTURES = {Structure.DIAG_GGN: diagonal_ggn, Structure.DIAG_EF: diagonal_ef, Structure.KFAC: kfac_ggn}


def compute_curvature(
    net: nn.Module,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    structure: str = "kfac",
    prior_structure: GroupSpec = "layer",
    batch_size: int = 64,
    progress: bool = False,
    input_shape: tuple[int, ...] | None = None,
    distributed: bool = False,
    **kwargs,
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
            (:class:`~ntkgp.laplace.weight_space.DiagonalEF`) or ``"kfac"`` (:class:`~ntkgp.laplace.weight_space.KroneckerGGN`), members
            of :class:`ntkgp.options.Structure`.
        prior_structure: prior-precision groups, see :func:`ntkgp.ntk.resolve_groups`; ``"kfac"`` needs the
            weight and bias of each ``Linear``/``Conv2d`` layer in one group (``"layer"`` or ``"network"``).
        batch_size: examples per batch when ``x`` is a tensor.
        progress: show a tqdm progress bar over the batches.
        input_shape: shape of one input; flat ``(N, D)`` inputs are reshaped to it.
        distributed: each rank of an initialized ``torch.distributed`` process group passes its shard of the
            data (the network replicated on every rank, as in DDP); the sums over the data are all-reduced, so
            every rank gets the curvature of all the data (docs/scaling.md, "Several processes and GPUs").
        **kwargs: ``groups=``, the deprecated name of ``prior_structure``.

    Returns:
        The :class:`~ntkgp.laplace.weight_space.Curvature`.

    Raises:
        ValueError: an unknown or unsupported ``structure`` (``"full_ggn"``/``"full_ef"`` are the exact
            function-space evidence of :class:`ntkgp.NTKGP`), or invalid data, naming the argument.

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
    prior_structure = renamed_argument(kwargs, "groups", "prior_structure", prior_structure, "layer")
    unexpected(kwargs, "compute_curvature")
    chosen = choose(Structure, structure, "structure")
    if chosen not in _STRUCTURES:
        raise ValueError(
            f"structure={chosen.value!r} is not computed by compute_curvature (it is the exact function-space "
            f"evidence of ntkgp's models); use one of {', '.join(repr(s.value) for s in _STRUCTURES)}"
        )
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    return _STRUCTURES[chosen](
        net, x, y, likelihood, prior_structure=prior_structure, batch_size=batch_size, progress=progress,
        input_shape=input_shape, distributed=distributed,
    )
