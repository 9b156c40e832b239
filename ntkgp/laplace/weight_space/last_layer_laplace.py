r"""Last-layer Laplace: a full Laplace posterior over the parameters of one layer, the others fixed at
:math:`\theta^*`."""

from __future__ import annotations

from collections.abc import Mapping

from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ...options import OptionAttribute
from .dense_curvature import Data
from .full_laplace import FullLaplace
from .posterior import check_name


class LastLayerLaplace(FullLaplace):
    r"""The full Laplace posterior over the last layer's weight and bias; all other weights stay at
    :math:`\theta^*`.

    For a last ``nn.Linear`` layer :math:`f = W \phi(x) + b` the Jacobian is
    :math:`J(x) = I_C \otimes [\phi(x)^\top, 1]`, so :math:`P = C (d + 1)` is small even for a large network
    and the dense algebra of :class:`FullLaplace` (GGN or EF) applies. Sampling methods of the predictive
    perturb only this layer.

    Args:
        net: the trained network (never modified).
        x: training inputs, or an iterable of ``(x_b, y_b)`` batches with ``y=None``.
        y: training targets.
        likelihood: a supported likelihood.
        layer: the module's name in ``net.named_modules()``; default the last module that owns trainable
            parameters.
        curvature: ``"ggn"`` (default) or ``"ef"``.
        prior_precision: :math:`\delta`, a float or one per group.
        prior_structure: ``"layer"`` (default: one :math:`\delta` for the layer), ``"parameter"`` (weight and
            bias separately), ``"network"`` or a mapping name → group.
        batch_size: examples per Jacobian batch.
        progress: show a tqdm bar.
        input_shape: the shape of one input, for flat inputs.
        chunk_size: examples per Jacobian chunk at prediction time.

    ``layer`` holds the module's name (the default resolved) and is fixed after construction.

    Raises:
        ValueError: when ``layer`` names no module, or a module without trainable parameters of its own.

    Example:
        >>> posterior = LastLayerLaplace(net, x, y, SoftmaxLikelihood(10), prior_precision=1.0)
        >>> posterior.names
        ['head.weight', 'head.bias']
    """

    layer = OptionAttribute(check_name, fixed="the posterior is over this layer's parameters")

    def __init__(
        self,
        net: nn.Module,
        x: Data,
        y: Tensor | None,
        likelihood: Likelihood,
        layer: str | None = None,
        curvature: str = "ggn",
        prior_precision: float | Tensor = 1.0,
        prior_structure: str | Mapping[str, str] = "layer",
        batch_size: int = 64,
        progress: bool = False,
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 256,
    ) -> None:
        self._layer_request = layer
        super().__init__(
            net,
            x,
            y,
            likelihood,
            curvature,
            prior_precision,
            prior_structure,
            batch_size,
            progress,
            input_shape,
            chunk_size,
        )

    def _structure_name(self) -> str:
        return f"last_layer_{self.curvature.value}"

    def _parameter_names(self, net: nn.Module) -> list[str]:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        owners = [
            (
                name,
                [
                    f"{name}.{k}" if name else k
                    for k, p in module.named_parameters(recurse=False)
                    if p.requires_grad
                ],
            )
            for name, module in net.named_modules()
        ]
        owners = [(name, params) for name, params in owners if params]
        request = self._layer_request
        if request is None:
            if not owners:
                raise ValueError("net has no trainable parameters")
            self.layer = owners[-1][0]
            return owners[-1][1]
        found = dict(owners)
        if request not in found:
            raise ValueError(
                f"layer must name a module of net with trainable parameters of its own, got {request!r}; "
                f"candidates: {list(found)}"
            )
        self.layer = request
        return found[request]
