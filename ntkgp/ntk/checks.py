"""Input and network checks shared by every entry point."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd


def check_eval_mode(net: nn.Module, argument: str = "net") -> None:
    """Raise when the network would treat examples differently per batch.

    BatchNorm in training mode mixes the examples of a batch and dropout in training mode is random,
    so the per-example Jacobian, and hence the kernel, would not be a function of one input.
    The network is not switched to eval mode here: that is the user's decision.
    """
    for name, module in net.named_modules():
        if not module.training:
            continue
        if isinstance(module, _BatchNorm) or (isinstance(module, _DropoutNd) and module.p > 0):
            kind = type(module).__name__
            raise ValueError(
                f"{argument} contains {kind} module '{name or type(net).__name__}' in training mode: its output "
                f"depends on the batch (or on random draws), so the NTK is not defined. Call {argument}.eval() "
                "before building an ntkgp object."
            )


def check_inputs(x: torch.Tensor, argument: str = "x") -> None:
    """Raise on non-tensor, empty or non-finite inputs."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[0] == 0:
        raise ValueError(f"{argument} must have a leading batch dimension with at least one example, got shape {tuple(x.shape)}")
    if x.is_floating_point() and not torch.isfinite(x).all():
        raise ValueError(f"{argument} contains NaN or Inf values")


def check_outputs(f: torch.Tensor, n: int, argument: str = "net") -> None:
    """Raise unless the network output is a finite ``(N, C)`` matrix."""
    if f.dim() != 2 or f.shape[0] != n:
        raise ValueError(
            f"{argument} must map a batch of {n} inputs to outputs of shape ({n}, C), got {tuple(f.shape)} "
            "(for a single output, return shape (N, 1))"
        )
    if not torch.isfinite(f).all():
        raise ValueError(f"{argument} produced NaN or Inf outputs")
