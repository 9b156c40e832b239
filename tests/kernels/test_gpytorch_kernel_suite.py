"""GPyTorch's own kernel test case (``gpytorch.test.base_kernel_test_case``) run on NTKKernel.

No case is overridden: the ARD cases return early because ``create_kernel_ard`` raises
``NotImplementedError`` (the NTK has no lengthscales, hence no ARD variant), which is how GPyTorch's suite
is meant to treat kernels without ARD.
"""

import unittest

import torch
from gpytorch.test.base_kernel_test_case import BaseKernelTestCase
from torch import nn

from ntkgp import NTKKernel


class SummaryFeatures(nn.Module):
    """Maps ``(N, D)`` to ``(N, 3)`` for any ``D`` (the suite feeds one kernel 2, 4, 6 and 10 dimensions)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x.mean(-1), x.square().mean(-1), torch.sin(x).mean(-1)], dim=-1)


def any_width_network(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(SummaryFeatures(), nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))  # default dtype


class TestNTKKernelWithGPyTorchSuite(BaseKernelTestCase, unittest.TestCase):
    seed = 0

    def create_kernel_no_ard(self, **kwargs):
        return NTKKernel(any_width_network(), prior_precision=torch.tensor([0.5, 2.0]), **kwargs)
