r"""Prior means built from the trained network: :math:`f(x;\theta^*)` and the linearized network's mean."""

from __future__ import annotations

import math

import torch
from gpytorch.means import Mean

from ..caching import ValueCache
from ..kernels.network_state import network_state
from ..ntk import NTKEngine
from ..ntk.checks import check_outputs
from ..options import OptionAttribute
from ..validation import count

__all__ = ["LinearizedNetworkMean", "NetworkMean"]


class _NetworkMeanBase(Mean):
    """Shared plumbing: evaluate a function of the network on flat inputs ``(*batch, N, D)``.

    Results are cached (:class:`~ntkgp.caching.ValueCache`) by the values of the inputs and of the network's
    parameters and buffers, so that any change of the network is seen; inputs that require grad are never
    served from the cache and their outputs carry the graph to the inputs (never to the network). Freezing or
    unfreezing a parameter after construction is refused (``RuntimeError``), as by the kernel.

    ``cache_size`` (how many inputs to keep results for; 0 disables the cache) is an option attribute
    (:class:`ntkgp.options.OptionAttribute`): assigning it validates the value and starts an empty cache.
    """

    cache_size = OptionAttribute(count, on_change="_cache_size_changed")

    def __init__(self, engine: NTKEngine, cache_size: int = 4) -> None:
        if not isinstance(engine, NTKEngine):
            raise TypeError(f"engine must be an ntkgp.ntk.NTKEngine, got {type(engine).__name__}")
        count(cache_size, "cache_size")
        super().__init__()
        self.engine = engine
        self.cache_size = cache_size
        self._cache = ValueCache(cache_size)

    def _cache_size_changed(self, name: str) -> None:
        self._cache = ValueCache(self.cache_size)

    def _network_state(self) -> list[torch.Tensor]:
        return network_state(self.engine, type(self).__name__)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):  # before GPyTorch's Mean.__call__ reads x.ndimension()
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        return super().__call__(x)

    def _outputs(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C)`` for prepared network inputs ``x`` (``(N, *input_shape)``)."""
        raise NotImplementedError

    def _compute(self, points: torch.Tensor) -> torch.Tensor:
        x = self.engine.prepare(points, "x")
        chunk = self.engine.chunk_size
        with torch.enable_grad() if points.requires_grad else torch.no_grad():
            f = torch.cat([self._outputs(x[s : s + chunk]) for s in range(0, x.shape[0], chunk)])
        check_outputs(f.detach(), x.shape[0])
        return f

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """The mean at flat inputs ``(*batch, N, D)`` as ``(*batch, N, C)`` in the network's dtype."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.is_complex():  # floating point, or integer token ids
            raise TypeError(f"x must be a real tensor, got dtype {x.dtype}")
        if x.dim() < 2:
            raise ValueError(f"x must have shape (*batch, N, D), got {tuple(x.shape)}")
        batch, n = x.shape[:-2], x.shape[-2]
        if n == 0 or math.prod(batch) == 0:
            c = self.engine.num_outputs()
            return torch.zeros(*batch, n, c, dtype=self.engine.dtype, device=self.engine.device)
        points = x.reshape(-1, x.shape[-1])
        value = self._cache.get_or_compute(type(self).__name__, [points], lambda: self._compute(points), state=self._network_state())
        return value.reshape(*batch, n, value.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(*batch, N, C)``, or ``(*batch, N)`` when the network has one output (GPyTorch's single-task shape)."""
        value = self.values(x)
        return value.squeeze(-1) if value.shape[-1] == 1 else value

    def clear_cache(self) -> None:
        """Drop the cached values."""
        self._cache.clear()


class NetworkMean(_NetworkMeanBase):
    r"""The network's own output as a GP mean, :math:`m(x) = f(x; \theta^*)` (SFR-NN, laplace-torch's GLM mean)."""

    def _outputs(self, x: torch.Tensor) -> torch.Tensor:
        return self.engine.core.call({}, x)  # on ntkgp's private copy of the network


class LinearizedNetworkMean(_NetworkMeanBase):
    r"""Prior mean of the linearized network, :math:`m(x) = f(x;\theta^*) - J(x)\,\theta^*`.

    The linearized network :math:`f_{lin}(x;\theta) = f(x;\theta^*) + J(x)(\theta - \theta^*)` with prior
    :math:`\theta \sim N(0, P_0^{-1})` is the GP :math:`GP(m, K)` with the NTK kernel ``K`` (docs/math.md, "GLM
    predictive"). :math:`f(x;\theta^*)` and :math:`J(x)\theta^*` come from one forward-mode pass
    (``torch.func.jvp`` with tangent :math:`\theta^*`; reverse over reverse for a network without forward-mode
    derivatives, :meth:`NetworkCore.value_and_jvp <ntkgp.ntk.network.NetworkCore.value_and_jvp>`); the Jacobian is
    never formed. When ``x`` requires grad
    both terms are differentiable w.r.t. ``x``.
    """

    def _outputs(self, x: torch.Tensor) -> torch.Tensor:
        f, j_theta = self.engine.core.value_and_jvp(x, self.engine.params())
        return f - j_theta
