"""The option groups of :func:`~ntkgp.training.train_marglik`: Algorithm 1's hyperparameter schedule and the MAP
optimisation of the weights (:mod:`ntkgp.option_groups`).

Each is a frozen dataclass; its fields are checked, naming them, when ``train_marglik`` is called, before anything
is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["HyperparameterSchedule", "MAPOptimization"]


@dataclass(frozen=True)
class HyperparameterSchedule:
    r"""When and how :func:`~ntkgp.training.train_marglik` learns the hyperparameters (Algorithm 1 of Immer et
    al. 2021): after ``burn_in`` epochs, every ``frequency`` epochs (and after the last), the curvature is built
    once and ``hyper_steps`` Adam steps of size ``hyper_lr`` are taken on :math:`-\log q(D)`.

    Attributes:
        burn_in: Algorithm 1's B (epochs before the first round).
        frequency: Algorithm 1's F (epochs between rounds).
        hyper_steps: Algorithm 1's K (Adam steps per round).
        hyper_lr: Algorithm 1's γ (Adam step size on the hyperparameters).
        learn_likelihood: also learn the likelihood's hyperparameters (noise, one or per output; a learnable
            temperature).
        curvature_batch_size: examples per batch of the curvature pass (tensor data).

    Example:
        >>> HyperparameterSchedule(burn_in=5, frequency=5, hyper_steps=20).hyper_lr
        0.1
    """

    burn_in: int = 50
    frequency: int = 10
    hyper_steps: int = 100
    hyper_lr: float = 0.1
    learn_likelihood: bool = True
    curvature_batch_size: int = 256


@dataclass(frozen=True)
class MAPOptimization:
    """How :func:`~ntkgp.training.train_marglik` takes its MAP steps on the weights (besides ``lr``).

    Attributes:
        optimizer: the MAP optimizer's class or factory (default ``torch.optim.Adam``), called as
            ``optimizer(params, lr=lr)`` (it must give a ``torch.optim.Optimizer``). An optimizer whose ``step``
            needs a closure (``torch.optim.LBFGS``) is stepped as ``step(closure)``, the closure re-evaluating the
            loss and gradients on the same batch.
        scheduler: ``None``, or a callable taking the MAP optimizer and returning a learning-rate scheduler
            (e.g. ``functools.partial(torch.optim.lr_scheduler.MultiStepLR, milestones=[100, 150],
            gamma=0.1)``), stepped once per epoch (``ReduceLROnPlateau`` with the epoch's MAP loss).
        seed: seed of the per-epoch shuffle of tensor data (a loader shuffles by its own sampler).
        train_normalization: BatchNorm modules in training mode for the MAP steps (batch statistics; running
            statistics updated) and in eval mode for every round and at the end
            (:mod:`ntkgp.training.normalization`); ``False`` keeps them as given (frozen statistics, e.g. to
            fine-tune).

    Example:
        >>> MAPOptimization(optimizer=torch.optim.SGD).seed
        0
    """

    # a factory, not a class attribute: the API reference would document torch.optim.Adam as a member
    optimizer: Callable[..., torch.optim.Optimizer] = field(default_factory=lambda: torch.optim.Adam)
    scheduler: Callable[[torch.optim.Optimizer], object] | None = None
    seed: int = 0
    train_normalization: bool = True
