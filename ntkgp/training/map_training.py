r"""The MAP part of Algorithm 1: the objective :math:`(\tfrac12\sum_g \delta_g\|\theta_g\|^2 - \sum_n \log
p(y_n\mid f(x_n;\theta)))/N` at the current prior precisions and likelihood, and one epoch of optimizer steps.

The gradients are computed for the network's trainable parameters only (``torch.autograd.grad``) and written
into their ``.grad`` for the optimizer; nothing else (the likelihood's parameters, the prior precisions) gets
a gradient. An optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``) is given one that re-evaluates
the loss and its gradients on the same batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ..distributed import all_reduce_sum
from ..kernels import NTKKernel
from ..likelihoods import log_likelihood
from .arguments import needs_closure

__all__ = ["MapTraining", "step_scheduler"]


class MapTraining:
    """The MAP objective of ``net`` and the steps of ``optimizer`` on it.

    Args:
        net: the network (trained in place).
        likelihood: the likelihood, at its current hyperparameters.
        kernel: the kernel holding the current prior precisions δ (and the parameter groups).
        trainable: the trainable parameters, in the order of the kernel's groups (:meth:`trainable_parameters`).
        optimizer: the MAP optimizer over ``trainable``.
        num_data: N, the number of examples (of all ranks).
        distributed: sum the data term's gradients over the ranks (as ``DistributedDataParallel``).
    """

    def __init__(self, net: nn.Module, likelihood: Likelihood, kernel: NTKKernel, trainable: list[Tensor],
                 optimizer: torch.optim.Optimizer, num_data: int, distributed: bool = False) -> None:
        self.net, self.likelihood, self.kernel, self.optimizer = net, likelihood, kernel, optimizer
        self.trainable = trainable
        self.n, self.distributed = num_data, distributed
        self.closure = needs_closure(optimizer)
        self.group_of = kernel.engine.groups.group_of
        self.half_delta: list[float] = []  # ½ δ_g per trainable tensor: read once per round, not per step
        self.refresh_prior()

    @staticmethod
    def trainable_parameters(net: nn.Module, kernel: NTKKernel) -> list[Tensor]:
        """The trainable parameters of ``net``, in the order of the kernel's groups."""
        params = dict(net.named_parameters())
        return [params[name] for name in kernel.engine.groups.names]

    def refresh_prior(self) -> None:
        """Read the current prior precisions (after a hyperparameter round)."""
        delta = self.kernel.prior_precision.detach().tolist()
        self.half_delta[:] = [0.5 * delta[g] for g in self.group_of]

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """The MAP objective per example, the data term of the batch ``(x, y)`` scaled to N."""
        fit = log_likelihood(self.likelihood, self.net(x), y).sum() * (self.n / x.shape[0])
        prior = sum(w * p.square().sum() for p, w in zip(self.trainable, self.half_delta))
        return (prior - fit) / self.n

    def epoch(self, batches: Iterable[tuple[Tensor, Tensor] | None]) -> float:
        """One epoch of steps, one per batch; returns the epoch's MAP objective per example (each step's loss
        weighted by its batch's share B / N of the data)."""
        total = 0.0
        step = self._distributed_step if self.distributed else self._step
        for batch in batches:
            total += step(batch)
        return total

    def finite(self, total: float) -> bool:
        """Whether the epoch's loss and every trainable weight are finite (else the MAP training diverged)."""
        return math.isfinite(total) and all(bool(torch.isfinite(p).all()) for p in self.trainable)

    def release_grads(self) -> None:
        """Drop the MAP gradients (before a hyperparameter round: memory)."""
        for p in self.trainable:
            p.grad = None

    def _assign(self, grads: Sequence[Tensor | None]) -> None:
        for p, g in zip(self.trainable, grads):
            p.grad = g

    def _step(self, batch: tuple[Tensor, Tensor]) -> float:
        x, y = batch

        def closure() -> Tensor:
            with torch.enable_grad():
                loss = self.loss(x, y)
                self._assign(torch.autograd.grad(loss, self.trainable, allow_unused=True))
            return loss.detach()

        if self.closure:
            loss = self.optimizer.step(closure)
        else:
            loss = closure()
            self.optimizer.step()
        return float(loss) * x.shape[0] / self.n

    def _distributed_step(self, batch: tuple[Tensor, Tensor] | None) -> float:
        """One MAP step on every rank's batch: the data term's gradients summed over the ranks (as DDP)."""
        trainable, ref = self.trainable, self.trainable[0]

        def closure() -> float:
            with torch.enable_grad():
                fit = torch.zeros((), dtype=ref.dtype, device=ref.device)
                grads: list[Tensor | None] = [None] * len(trainable)
                if batch is not None:
                    fit = log_likelihood(self.likelihood, self.net(batch[0]), batch[1]).sum()
                    grads = list(torch.autograd.grad(-fit, trainable, allow_unused=True))
                grads = [torch.zeros_like(p) if g is None else g for p, g in zip(trainable, grads)]
                count = float(0 if batch is None else batch[0].shape[0])
                sums = torch.stack([fit.detach(), torch.tensor(count, dtype=ref.dtype, device=ref.device)])
                all_reduce_sum(grads + [sums])
                fit_sum, count = sums.tolist()
                delta = self.kernel.prior_precision.detach()
                prior = sum(0.5 * delta[g] * p.pow(2).sum() for p, g in zip(trainable, self.group_of)) / self.n
                prior_grads = torch.autograd.grad(prior, trainable)
            self._assign([g / count + pg for g, pg in zip(grads, prior_grads)])  # ∇ of -fit · (n / B) / n + prior
            return (prior.item() - fit_sum / count) * count / self.n

        if self.closure:
            return float(self.optimizer.step(closure))
        loss = closure()
        self.optimizer.step()
        return loss


def step_scheduler(scheduler: object | None, train_loss: float) -> None:
    """One learning-rate scheduler step at the end of an epoch (``ReduceLROnPlateau`` is given the epoch's
    MAP loss)."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(train_loss)
    else:
        scheduler.step()
