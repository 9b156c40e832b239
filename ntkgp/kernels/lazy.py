"""The lazily evaluated NTK: GPyTorch's ``LazyEvaluatedKernelTensor``, a snapshot of the kernel it was made from,
with element reads that do not re-evaluate the kernel once per entry.

**A snapshot.** GPyTorch's lazy kernel tensor reads its kernel's hyperparameters when it is evaluated. This one
evaluates at the values of the moment it was made (:class:`~ntkgp.kernels.snapshot.KernelSnapshot`: :math:`\\delta`
and the network's weights and buffers, copied then): whatever changes afterwards (a new :math:`\\delta`, an optimizer
step on the network), ``.to_dense()``, ``.diagonal()``, products and entries are those of ``kernel(x1, x2)`` at
creation. While nothing changed it evaluates through the live kernel (its caches and its graph to :math:`\\delta`).
Every kernel read goes through :attr:`NTKLazyKernelTensor.kernel`, which resolves the snapshot, so the tensors
GPyTorch derives from this one (slices, transposes, batch expansions) inherit it.

**Element reads.** Reading scattered entries of a lazy kernel tensor (``K[..., rows, cols]`` with index tensors, as
a per-point ``C×C`` block read for a Monte Carlo link does) goes through ``LinearOperator._get_indices``, which by
default re-evaluates the kernel on inputs repeated once per requested entry and interpolates. For the NTK:

* when every requested entry lies in a per-point block (row and column belong to the same input of a
  square kernel), the entries are read off the per-point ``C×C`` blocks, computed without the Gram
  (``O(N·C²)`` numbers instead of ``O(N²·C²)``);
* otherwise the kernel is evaluated once (a dense, low-rank-root or product operator) and indexed.
"""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from gpytorch.lazy import LazyEvaluatedKernelTensor
from gpytorch.lazy.lazy_evaluated_kernel_tensor import recall_grad_state
from gpytorch.utils.memoize import cached
from linear_operator import LinearOperator, to_linear_operator

from .snapshot import KernelSnapshot


class NTKLazyKernelTensor(LazyEvaluatedKernelTensor):
    """What :class:`~ntkgp.kernels.NTKKernel` returns when called in lazy mode (GPyTorch's default)."""

    @property
    def kernel(self):
        """The kernel at the values of the moment this tensor was made (the live kernel while nothing changed)."""
        return self.__dict__["_ntk_snapshot"].kernel()

    @kernel.setter
    def kernel(self, kernel) -> None:
        self.__dict__["_ntk_snapshot"] = KernelSnapshot(kernel)

    @property
    def _kwargs(self) -> dict:
        # LinearOperator rebuilds copies (clone, detach, permutations) from these: with the snapshot's kernel
        return {**LinearOperator._kwargs.fget(self), "kernel": self.kernel}

    @property
    def dtype(self) -> torch.dtype:
        return self.__dict__["_ntk_snapshot"].dtype

    def _size(self) -> torch.Size:
        """GPyTorch's size, kept on the tensor (its inputs and kernel are fixed); for unbatched inputs and kernel
        ``(N1·C, N2·C)`` directly, without GPyTorch's broadcasting, its debug check that the kernel defines no
        ``size`` (NTKKernel defines none) and its memo's pickled key: a model's every call reads it twice."""
        size = self.__dict__.get("_ntk_size")
        if size is None:
            x1, x2 = self.x1, self.x2
            kernel = self.__dict__["_ntk_snapshot"].source  # shapes only: no values read
            if x1.dim() == 2 and x2.dim() == 2 and not kernel.batch_shape:
                c = kernel.num_outputs_per_input(x1, x2)
                size = torch.Size((x1.shape[-2] * c, x2.shape[-2] * c))
            else:
                size = super()._size()
            self._ntk_size = size
        return size

    @cached(name="kernel_eval")
    @recall_grad_state
    def evaluate_kernel(self) -> LinearOperator:
        """The kernel matrix as a linear operator (GPyTorch's, with the snapshot's kernel resolved once)."""
        kernel = self.kernel
        active_dims = kernel.active_dims  # x1, x2 are already restricted to them (GPyTorch's evaluation)
        # GPyTorch's non-lazy evaluation (``Module.__call__`` -> ``forward``), without entering
        # ``settings.lazily_evaluate_kernels(False)``: a process-wide setting that two threads entering and leaving
        # it at once would leave off for every later kernel call
        kernel.active_dims = None
        try:
            res = super(Kernel, kernel).__call__(self.x1, self.x2, diag=False, last_dim_is_batch=self.last_dim_is_batch,
                                                 **self.params)
        finally:
            kernel.active_dims = active_dims
        return to_linear_operator(res)

    @cached(name="kernel_diag")
    @recall_grad_state
    def _diagonal(self) -> torch.Tensor:
        kernel = self.kernel
        res = super(Kernel, kernel).__call__(
            self.x1, self.x2, diag=True, last_dim_is_batch=self.last_dim_is_batch, **self.params
        )
        if isinstance(res, LinearOperator):
            res = res.to_dense()
        return res.view(self.shape[:-1]).contiguous()

    @recall_grad_state
    def _get_indices(
        self, row_index: torch.Tensor, col_index: torch.Tensor, *batch_indices: torch.Tensor
    ) -> torch.Tensor:
        kernel = self.kernel
        if not self.last_dim_is_batch and kernel.is_square(self.x1, self.x2):
            c = kernel.num_outputs_per_input(self.x1, self.x2)
            shape = torch.broadcast_shapes(
                *(i.shape for i in batch_indices), row_index.shape, col_index.shape
            )
            rows, cols = row_index.expand(shape), col_index.expand(shape)
            points = torch.div(rows, c, rounding_mode="floor")
            if torch.equal(points, torch.div(cols, c, rounding_mode="floor")):
                blocks = kernel.point_blocks(self.x1)  # (*batch, N, C, C)
                blocks = blocks.expand(*self.batch_shape, *blocks.shape[-3:])
                return blocks[(*(i.expand(shape) for i in batch_indices), points, rows % c, cols % c)]
        return self.evaluate_kernel()._get_indices(row_index, col_index, *batch_indices)
