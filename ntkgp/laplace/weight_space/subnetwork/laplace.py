r"""Subnetwork Laplace: a full Laplace posterior over a chosen subset of a network's parameters, the others fixed at
:math:`\theta^*` (laplace-torch's ``SubnetLaplace``; Daxberger et al., ICML 2021).

The subset is given by parameter names (whole tensors) or by boolean masks (individual coordinates). With
:math:`S` the selected coordinates, the posterior is :math:`N(\theta^*_S, (H_S + P_{0,S})^{-1})` with
:math:`H_S = \sum_n J_{n,S}^\top \Lambda_n J_{n,S}` (or the EF), :math:`J_{n,S}` the Jacobian columns of the selected
coordinates only: the dense algebra of :class:`~ntkgp.laplace.weight_space.FullLaplace` over :math:`|S|` coordinates,
memory :math:`O(K |S|^2)` plus one batch of Jacobians of the parameters that hold a selected coordinate. The
prior groups are those of the parameters (``prior_structure``), each counting its selected coordinates only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ....ntk import ParameterGroups
from ....ntk.network import NetworkCore
from ....option_groups import accepts_flat_keywords
from ....options import CurvatureKind, choice
from ...ggn.data_pass import Data, DataPass
from ...ggn.full_curvature import FullCurvature, dense_components
from ..full.laplace import DensePosterior
from ..last_layer.laplace import layer_evidence
from ..posterior.pass_options import PassOptions
from ..posterior.weight_posterior import check_before_pass

Subnetwork = Sequence[str] | Mapping[str, Tensor]


def check_subnetwork(net: nn.Module, subnetwork: object) -> dict[str, Tensor | None]:
    """``subnetwork`` as ``{name: mask or None}`` (``None``: the whole parameter), in the network's parameter order.

    Raises:
        TypeError: for another type than a list of names or a mapping name → boolean mask.
        ValueError: for an unknown, frozen or repeated name, a mask of the wrong shape, or no selected coordinate.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    if isinstance(subnetwork, Mapping):
        given = dict(subnetwork)
    elif isinstance(subnetwork, Sequence) and not isinstance(subnetwork, (str, bytes)):
        if len(set(subnetwork)) != len(subnetwork):
            raise ValueError(f"subnetwork must name distinct parameters, got {list(subnetwork)}")
        given = {name: None for name in subnetwork}
    else:
        raise TypeError(
            "subnetwork must be a list of parameter names or a mapping name → boolean mask, got "
            f"{type(subnetwork).__name__}"
        )
    params = dict(net.named_parameters())
    out: dict[str, Tensor | None] = {}
    for name, mask in given.items():
        if not isinstance(name, str) or name not in params:
            raise ValueError(f"subnetwork names an unknown parameter {name!r}; parameters: {list(params)}")
        if not params[name].requires_grad:
            raise ValueError(f"subnetwork names {name!r}, which has requires_grad=False")
        if mask is not None:
            if not torch.is_tensor(mask) or mask.dtype != torch.bool or mask.shape != params[name].shape:
                shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
                raise ValueError(
                    f"subnetwork[{name!r}] must be a boolean mask of shape {tuple(params[name].shape)}, got {shape}"
                    + (f" of dtype {mask.dtype}" if torch.is_tensor(mask) else "")
                )
            if not bool(mask.any()):
                continue  # selects nothing of this parameter
        out[name] = None if mask is None else mask.detach().clone()
    if not out:
        raise ValueError("subnetwork selects no coordinate")
    return {name: out[name] for name in params if name in out}


class SubnetCore(NetworkCore):
    r"""The network as a function of the selected coordinates :math:`\theta_S` only (:class:`NetworkCore` over the
    parameters that hold them): flat vectors have :math:`|S|` entries, in the order of the parameters and, within
    each, row-major; a perturbation leaves every other coordinate at :math:`\theta^*`."""

    def __init__(self, net: nn.Module, masks: dict[str, Tensor | None], input_shape, chunk_size: int) -> None:
        super().__init__(net, list(masks), input_shape, chunk_size)
        parts = [torch.ones(numel, dtype=torch.bool) if masks[n] is None else masks[n].reshape(-1).cpu()
                 for n, numel in zip(self.names, self.numels)]
        self.selected = torch.cat(parts).nonzero().reshape(-1).to(self.device)
        self.counts = [int(p.sum()) for p in parts]

    @property
    def num_params(self) -> int:
        return int(self.selected.numel())

    def theta(self) -> Tensor:
        return super().theta()[self.selected]

    def unflatten(self, v: Tensor) -> dict[str, Tensor]:
        full = v.new_zeros(*v.shape[:-1], self.offsets[-1])
        full[..., self.selected] = v
        return super().unflatten(full)

    def jacobian(self, x: Tensor, names=None) -> Tensor:
        if names is not None:
            raise ValueError("a subnetwork's Jacobian is over its selected coordinates only")
        return super().jacobian(x)[..., self.selected]

    def per_example_vjps(self, x: Tensor, cotangents: Tensor, names: Sequence[str]) -> Tensor:
        r"""Rows :math:`J_{n,S}^\top u_{nm}` over the selected coordinates, ``(n, M, |S|)``."""
        if list(names) != self.names:
            raise ValueError("a subnetwork's rows are over its selected coordinates only")
        return super().per_example_vjps(x, cotangents, names)[..., self.selected]


class SubnetLaplace(DensePosterior):
    r"""The full Laplace posterior over a subnetwork (module docstring).

    Args:
        net: the trained network (never modified).
        x: training inputs, or an iterable of ``(x_b, y_b)`` batches with ``y=None``.
        y: training targets.
        likelihood: a supported likelihood.
        subnetwork: a list of parameter names (as in ``net.named_parameters()``), or a mapping name → boolean mask
            of the parameter's shape (``True``: the coordinate is in the posterior).
        curvature: ``"ggn"`` (default) or ``"ef"``.
        prior_precision: :math:`\delta`, a float or one per group.
        prior_structure: ``"layer"`` (default), ``"network"``, ``"parameter"`` or a mapping name → group over the
            parameters that hold a selected coordinate.
        options: how the passes run, a :class:`~ntkgp.laplace.weight_space.PassOptions` (``batch_size`` of the
            curvature pass, ``chunk_size`` at prediction time, ``progress``; ``None``: its defaults). Its fields as
            flat keywords (``batch_size=128``) still work, with a ``FutureWarning``, for one release.
        input_shape: the shape of one input, for flat inputs.

    :attr:`names` are the parameters that hold a selected coordinate; flat vectors (:meth:`mean`, samples) have
    :attr:`num_params` :math:`= |S|` entries; :attr:`subnetwork` holds the masks (``None``: a whole parameter);
    :attr:`evidence_curvature` the :class:`~ntkgp.laplace.weight_space.FullCurvature` over :math:`S` (its evidence).

    Raises:
        TypeError, ValueError: for an invalid ``subnetwork`` (before any pass over the data).

    Example:
        >>> mask = torch.zeros_like(net.head.weight, dtype=torch.bool); mask[:, :5] = True
        >>> posterior = SubnetLaplace(net, x, y, SoftmaxLikelihood(10), {"head.weight": mask, "head.bias": None})
    """

    @accepts_flat_keywords(options=PassOptions)
    def __init__(
        self,
        net: nn.Module,
        x: Data,
        y: Tensor | None,
        likelihood: Likelihood,
        subnetwork: Subnetwork,
        curvature: str = "ggn",
        prior_precision: float | Tensor = 1.0,
        prior_structure: str | Mapping[str, str] = "layer",
        options: PassOptions | None = None,
        input_shape: tuple[int, ...] | None = None,
    ) -> None:
        batch_size, chunk_size, progress = self._pass_settings(options)
        kind = choice(CurvatureKind)(curvature, "curvature")
        masks = check_subnetwork(net, subnetwork)
        _, groups = check_before_pass(net, likelihood, prior_precision, prior_structure, input_shape, chunk_size,
                                      list(masks))
        fn = SubnetCore(net, masks, input_shape, chunk_size)
        groups = ParameterGroups(names=groups.names, shapes=tuple(torch.Size([n]) for n in fn.counts),
                                 group_of=groups.group_of, group_names=groups.group_names)
        fisher = kind is CurvatureKind.EF
        data = DataPass.on(fn, likelihood)  # the layer blocks are over whole tensors: the rows of S instead
        components = dense_components(data, x, y, fisher, batch_size, progress, f"subnetwork {kind.value.upper()}",
                                      layer_blocks=False)
        f_all, y_all = data.collected()
        theta_sq = fn.theta().square()
        sq_norms = theta_sq.new_zeros(groups.num_groups).index_add_(0, groups.column_groups(theta_sq.device), theta_sq)
        self.evidence_curvature = FullCurvature(groups, sq_norms, f_all, y_all, data.scale0.shape[0], components,
                                                fisher)
        DensePosterior.__init__(self, fn, likelihood, groups, prior_precision, components, kind)
        self.subnetwork = masks

    def _structure_name(self) -> str:
        return f"subnetwork_{self.curvature.value}"

    def _log_marginal_likelihood(self, prior_precision: Tensor) -> Tensor:
        return layer_evidence(self, prior_precision)
