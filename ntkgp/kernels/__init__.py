"""GPyTorch kernels built from a trained network."""

from .ntk_kernel import NTKKernel

__all__ = ["NTKKernel"]
