"""Prior means built from the trained network."""

from __future__ import annotations

import torch
from gpytorch.means import Mean

from ..kernels.ntk_kernel import _InputCache
from ..ntk import NTKEngine


class _NetworkMeanBase(Mean):
    """Shared plumbing: evaluate a function of the network on flat ``(N, D)`` inputs, cached by input value."""

    def __init__(self, engine: NTKEngine, cache_size: int = 4) -> None:
        super().__init__()
        self.engine = engine
        self._cache = _InputCache(cache_size)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns ``(N, C)``, or ``(N,)`` when the network has one output (GPyTorch's single-task shape)."""
        value = self._cache.get_or_compute((type(self).__name__, self.engine.params_version()), (x,), lambda: self._compute(x))
        return value.squeeze(-1) if value.shape[-1] == 1 else value


class NetworkMean(_NetworkMeanBase):
    r"""The network's own output as a GP mean, :math:`m(x) = f(x; \theta^*)` (SFR-NN, laplace-torch's GLM mean)."""

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.engine.outputs(x)


class LinearisedNetworkMean(_NetworkMeanBase):
    r"""Prior mean of the linearised network, :math:`m(x) = f(x;\theta^*) - J(x)\,\theta^*`.

    The linearised network :math:`f_{lin}(x;\theta) = f(x;\theta^*) + J(x)(\theta - \theta^*)` with prior
    :math:`\theta \sim N(0, P_0^{-1})` is the GP :math:`GP(m, K)` with the NTK kernel ``K`` (MATH.md).
    ``J(x) θ*`` is one forward-mode product (``jvp``); the Jacobian is never formed.
    """

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        f = self.engine.outputs(x)
        jtheta = self.engine.jvp(x, self.engine.params()).reshape(f.shape)
        return f - jtheta
