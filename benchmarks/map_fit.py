"""The MAP fit the benchmarks share: full-batch Adam on a negative log joint, then L-BFGS to its mode."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def fit_map(net: nn.Module, objective: Callable[[], torch.Tensor], adam_steps: int, lbfgs_iterations: int,
            lr: float = 1e-2) -> nn.Module:
    """Minimize ``objective()`` (a function of ``net``'s parameters) with ``adam_steps`` Adam steps, then L-BFGS
    (strong Wolfe line search, at most ``lbfgs_iterations``); clears the gradients and returns ``net.eval()``."""
    adam = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(adam_steps):
        adam.zero_grad()
        objective().backward()
        adam.step()
    lbfgs = torch.optim.LBFGS(net.parameters(), max_iter=lbfgs_iterations, line_search_fn="strong_wolfe")

    def closure():
        lbfgs.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    lbfgs.step(closure)
    for p in net.parameters():
        p.grad = None
    return net.eval()
