"""The lazily evaluated NTK: GPyTorch's ``LazyEvaluatedKernelTensor``, with element reads that do not
re-evaluate the kernel once per entry.

Reading scattered entries of a lazy kernel tensor (``K[..., rows, cols]`` with index tensors, as a per-point
``C×C`` block read for a Monte Carlo link does) goes through ``LinearOperator._get_indices``, which by
default re-evaluates the kernel on inputs repeated once per requested entry and interpolates. For the NTK:

* when every requested entry lies in a per-point block (row and column belong to the same input of a
  square kernel), the entries are read off the per-point ``C×C`` blocks, computed without the Gram
  (``O(N·C²)`` numbers instead of ``O(N²·C²)``);
* otherwise the kernel is evaluated once (a dense, low-rank-root or product operator) and indexed.
"""

from __future__ import annotations

import torch
from gpytorch.lazy import LazyEvaluatedKernelTensor
from gpytorch.lazy.lazy_evaluated_kernel_tensor import recall_grad_state


class NTKLazyKernelTensor(LazyEvaluatedKernelTensor):
    """What :class:`~ntkgp.kernels.NTKKernel` returns when called in lazy mode (GPyTorch's default)."""

    def _size(self) -> torch.Size:
        """GPyTorch's size, kept on the tensor (its inputs and kernel are fixed); for unbatched inputs and kernel
        ``(N1·C, N2·C)`` directly, without GPyTorch's broadcasting, its debug check that the kernel defines no
        ``size`` (NTKKernel defines none) and its memo's pickled key: a model's every call reads it twice."""
        size = self.__dict__.get("_ntk_size")
        if size is None:
            x1, x2 = self.x1, self.x2
            if x1.dim() == 2 and x2.dim() == 2 and not self.kernel.batch_shape:
                c = self.kernel.num_outputs_per_input(x1, x2)
                size = torch.Size((x1.shape[-2] * c, x2.shape[-2] * c))
            else:
                size = super()._size()
            self._ntk_size = size
        return size

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
