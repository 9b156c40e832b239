r"""The empirical NTK at the variational mean with the variational variances: FSVI's posterior kernel."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from .linearized import LinearizedNetwork
from .variational import MeanFieldGaussian


class MeanFieldNTKKernel(Kernel):
    r"""The covariance of the network linearized about the variational mean under the mean-field variances,

    .. math:: K(x, x') = J_\mu(x) \operatorname{diag}(s^2) J_\mu(x')^\top \in \mathbb R^{C \times C},

    an empirical NTK with one variance per weight. For inputs ``(N1, D)`` and ``(N2, D)`` it is a
    ``(N1·C, N2·C)`` matrix in GPyTorch's interleaved multi-output order (row ``n·C + c``);
    ``num_outputs_per_input`` is ``C``. Inputs ``(*batch, N, D)`` (GPyTorch's batch mode; the batch shapes of
    ``x1`` and ``x2`` broadcast) give ``(*batch, N1·C, N2·C)``: one covariance per batch element, the features of
    every row computed once (:meth:`~ntkgp.fsvi.linearized.LinearizedNetwork.batched_covariance`).

    **How it is computed** (:class:`~ntkgp.fsvi.linearized.LinearizedNetwork`): ``nn.Linear`` layers by their
    structured form (layer inputs and back-propagated output gradients, never the Jacobian), other parameters by
    per-example Jacobians. ``diag=True`` (what ``.variance`` of a GPyTorch distribution asks for) costs one
    forward and one batched backward pass per chunk of inputs and never forms the ``(N·C)²`` matrix. Everything
    is differentiable in :math:`\mu`, :math:`s` and the inputs when gradients are enabled.

    The variational distribution is held by reference (its parameters belong to the model that owns it);
    the kernel itself has no hyperparameters.

    Args:
        linearized: the network wrapper (input shape, routes, chunk size).
        variational: the distribution whose :math:`\mu` and :math:`s` are used.
    """

    has_lengthscale = False

    def __init__(self, linearized: LinearizedNetwork, variational: MeanFieldGaussian, **kwargs) -> None:
        super().__init__(**kwargs)
        object.__setattr__(self, "linearized", linearized)
        object.__setattr__(self, "variational", variational)

    @property
    def dtype(self) -> torch.dtype:
        """The variational parameters' dtype (the kernel has no parameters of its own, from which GPyTorch would
        take it; its lazy tensors, and so the base samples of ``rsample``, follow this)."""
        return self.variational.mean[0].dtype

    @property
    def device(self) -> torch.device:
        """The variational parameters' device."""
        return self.variational.mean[0].device

    def _params(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        return self.variational.means(), self.variational.variances()

    def num_outputs_per_input(self, x1: Tensor, x2: Tensor) -> int:
        means, _ = self._params()
        row = x1.reshape(-1, x1.shape[-1])[:1]
        return self.linearized.num_outputs(means, self.linearized.prepare(row, next(iter(means.values()))))

    def forward(self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params) -> Tensor:
        if last_dim_is_batch:
            raise NotImplementedError("MeanFieldNTKKernel does not support last_dim_is_batch")
        if x1.dim() < 2 or x2.dim() < 2:
            raise ValueError(
                "MeanFieldNTKKernel takes inputs of shape (*batch, N, D), got "
                f"{tuple(x1.shape)} and {tuple(x2.shape)}; flatten inputs of other shapes and pass input_shape"
            )
        means, variances = self._params()
        like = next(iter(means.values()))
        square = x1 is x2 or (x1.shape == x2.shape and torch.equal(x1, x2))
        lin = self.linearized
        if diag:
            if not square:
                return self.forward(x1, x2).diagonal(dim1=-2, dim2=-1)
            # the per-point blocks of all rows at once, whatever the batch shape
            _, blocks = lin.diag_blocks(means, variances, lin.prepare(x1.reshape(-1, x1.shape[-1]), like, "x1"))
            return blocks.diagonal(dim1=-2, dim2=-1).reshape(*x1.shape[:-2], -1)
        if x1.dim() > 2 or x2.dim() > 2:
            if max(x1.shape[-2], x2.shape[-2]) <= lin.chunk_size:
                return lin.batched_covariance(means, variances, x1, None if square else x2)
            # large slices: one element at a time, each by chunks of rows
            batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
            a = x1.expand(*batch, *x1.shape[-2:]).reshape(-1, *x1.shape[-2:])
            b = x2.expand(*batch, *x2.shape[-2:]).reshape(-1, *x2.shape[-2:])
            out = torch.stack([self.forward(a[k], a[k] if square else b[k]) for k in range(a.shape[0])])
            return out.view(*batch, *out.shape[-2:])
        a = lin.prepare(x1, like, "x1")
        if square and a.shape[0] <= lin.chunk_size:
            return lin.covariance(means, [variances], a, create_graph=torch.is_grad_enabled())[1][0]
        return lin.cross_covariance(means, variances, a, a if square else lin.prepare(x2, like, "x2"))
