r"""What :func:`~ntkgp.training.train_marglik` keeps to leave the user's objects consistent: the best-evidence
checkpoint (weights, buffers and the hyperparameters its evidence was evaluated at), the initial state, and
the parameters' ``.grad`` as the user left them.

Whatever ends training (success, divergence, an error, a ``KeyboardInterrupt``), the network and the
hyperparameters are left at one checkpoint together, and every ``.grad`` is the user's again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Checkpoints"]


def _clone_state(net: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _clone(tensors: Iterable[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


@dataclass(frozen=True)
class _Best:
    value: float
    epoch: int
    state: dict[str, Tensor]
    hypers: list[Tensor]


class Checkpoints:
    """The initial and the best-evidence checkpoint of ``net`` with ``hypers``, and the user's gradients.

    Args:
        net: the network being trained.
        hypers: the hyperparameters being learned (the prior precisions, the likelihood's).
        user_parameters: every parameter whose ``.grad`` belongs to the user (the network's, the likelihood's).
    """

    def __init__(self, net: nn.Module, hypers: list[Tensor], user_parameters: Iterable[Tensor]) -> None:
        self.net, self.hypers = net, hypers
        self.initial_state, self.initial_hypers = _clone_state(net), _clone(hypers)
        self._best: _Best | None = None  # one attribute, replaced whole: an interrupt never leaves half of it
        self._grads = [(p, p.grad) for p in dict.fromkeys(user_parameters)]  # unique, in order

    @property
    def has_best(self) -> bool:
        """Whether some round gave a finite evidence."""
        return self._best is not None

    @property
    def best_value(self) -> float:
        """The best evidence / N (``-inf`` before any finite one)."""
        return -float("inf") if self._best is None else self._best.value

    @property
    def best_epoch(self) -> int:
        """The epoch of the best checkpoint (``-1`` before any)."""
        return -1 if self._best is None else self._best.epoch

    def set_hypers(self, values: list[Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.hypers, values):
                p.copy_(v)

    def offer(self, value: float, epoch: int, hypers_at: list[Tensor]) -> None:
        """Keep the current weights with ``hypers_at`` (copies, not the live parameters) if ``value`` (a finite
        evidence / N) beats the best."""
        if math.isfinite(value) and value > self.best_value:
            self._best = _Best(value, epoch, _clone_state(self.net), list(hypers_at))

    def load_best(self) -> None:
        """The best checkpoint into the network and the hyperparameters (there must be one)."""
        self.net.load_state_dict(self._best.state)
        self.set_hypers(self._best.hypers)

    def load_initial(self) -> None:
        """The initial weights, buffers and hyperparameters."""
        self.net.load_state_dict(self.initial_state)
        self.set_hypers(self.initial_hypers)

    def load_best_or_initial(self) -> None:
        (self.load_best if self.has_best else self.load_initial)()

    def take_grads(self) -> None:
        """Put the user's ``.grad`` aside (training writes its own gradients, never into the user's tensors)."""
        for p, _ in self._grads:
            p.grad = None

    def restore_grads(self) -> None:
        """Give every parameter its ``.grad`` back: the same object (or ``None``) the user left there."""
        for p, grad in self._grads:
            p.grad = grad
