r"""BatchNorm during :func:`~ntkgp.training.train_marglik`: batch statistics for the MAP steps, running statistics for
the curvature.

A network with BatchNorm is trained as it would be without ntkgp: during the MAP steps of an epoch its BatchNorm
modules are in training mode — each batch is normalized by its own statistics, and the running statistics are updated
with the module's ``momentum`` — and for every hyperparameter round (the curvature and the evidence) and at the end
they are in eval mode, so that the network is a function of one input and its Jacobians, the GGN and the NTK are
defined (the Laplace approximation is of the network as it predicts). The running statistics are buffers: the best
checkpoint keeps them with the weights. Other modules keep the mode the user gave (dropout stays off: a MAP step with
dropout on would optimize another objective than the one whose curvature is taken).

With ``distributed=True`` each rank's BatchNorm sees its own batches (as in ``DistributedDataParallel`` without
``SyncBatchNorm``); the running statistics of rank 0 are broadcast to every rank after each epoch, as DDP does at
every forward pass, so the ranks' networks stay replicated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..distributed import broadcast_

__all__ = ["batch_statistics", "normalization_modules"]


def normalization_modules(net: nn.Module) -> list[nn.Module]:
    """The BatchNorm modules of ``net`` that track running statistics (each once)."""
    return [m for m in dict.fromkeys(net.modules()) if isinstance(m, _BatchNorm) and m.track_running_stats]


@contextmanager
def batch_statistics(net: nn.Module, enabled: bool = True, distributed: bool = False) -> Iterator[None]:
    """The BatchNorm modules of ``net`` in training mode while the block runs (``enabled``), then back in the mode
    they had; with ``distributed``, rank 0's running statistics broadcast to every rank at the end."""
    modules = normalization_modules(net) if enabled else []
    modes = [m.training for m in modules]
    for m in modules:
        m.train()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
        if modules and distributed:
            broadcast_([b for m in modules for b in m.buffers()], enabled=True)
