r"""The network at the variational mean as a GPyTorch mean, :math:`m(x) = f(x; \mu)`."""

from __future__ import annotations

from gpytorch.means import Mean
from torch import Tensor

from .linearized import LinearizedNetwork
from .variational import MeanFieldGaussian


class VariationalNetworkMean(Mean):
    r"""The network evaluated at the variational mean, :math:`m(x) = f(x; \mu)`, on GPyTorch's ``(N, D)`` inputs.

    Differentiable in :math:`\mu` and in ``x``. The variational distribution is held by reference (its
    parameters belong to the model that owns it, e.g. :class:`~ntkgp.fsvi.FSVI`).

    Args:
        linearized: the network wrapper (input shape, routes).
        variational: the distribution whose means :math:`\mu` are used.
    """

    def __init__(self, linearized: LinearizedNetwork, variational: MeanFieldGaussian) -> None:
        super().__init__()
        object.__setattr__(self, "linearized", linearized)
        object.__setattr__(self, "variational", variational)

    def forward(self, x: Tensor) -> Tensor:
        """``(N, C)``, or ``(N,)`` when the network has one output (GPyTorch's single-task shape)."""
        params = self.variational.means()
        x = self.linearized.prepare(x, next(iter(params.values())))
        f = self.linearized.forward(params, x)
        return f.squeeze(-1) if f.shape[-1] == 1 else f
