r"""The network at the variational mean as a GPyTorch mean, :math:`m(x) = f(x; \mu)`."""

from __future__ import annotations

from gpytorch.means import Mean
from torch import Tensor

from .linearized import LinearizedNetwork
from .variational import MeanFieldGaussian


class VariationalNetworkMean(Mean):
    r"""The network evaluated at the variational mean, :math:`m(x) = f(x; \mu)`, on GPyTorch's
    ``(*batch, N, D)`` inputs.

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
        """``(*batch, N, C)`` for inputs ``(*batch, N, D)``, or ``(*batch, N)`` when the network has one output
        (GPyTorch's single-task shape); all rows in one forward pass."""
        params = self.variational.means()
        rows = self.linearized.prepare(x.reshape(-1, x.shape[-1]), next(iter(params.values())))
        f = self.linearized.forward(params, rows)
        f = f.view(*x.shape[:-1], f.shape[-1])
        return f.squeeze(-1) if f.shape[-1] == 1 else f
