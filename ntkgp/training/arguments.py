"""Checking the arguments of :func:`~ntkgp.training.train_marglik` before anything is touched, and building the
user's optimizer and learning-rate scheduler from the factories given.

Every error names the argument. Nothing here reads the network or the data.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from ..distributed import check_distributed
from ..ntk import GroupSpec
from ..ntk.data_arguments import check_data
from ..ntk.inputs import is_structured
from ..options import Structure, choose
from ..progress import check_progress
from ..validation import check_int, flag, positive_float

__all__ = ["MarglikOptions", "Schedule", "check_options", "make_optimizer", "make_scheduler", "needs_closure"]


@dataclass(frozen=True)
class Schedule:
    """Algorithm 1's schedule: ``epochs``, burn-in B, frequency F and K steps per hyperparameter round."""

    epochs: int
    burn_in: int
    frequency: int
    hyper_steps: int

    def round_due(self, epoch: int) -> bool:
        """Whether a hyperparameter round follows ``epoch`` (1-based): every F epochs after B, and after the last."""
        return (epoch > self.burn_in and (epoch - self.burn_in) % self.frequency == 0) or epoch == self.epochs


@dataclass(frozen=True)
class MarglikOptions:
    """The checked options of one :func:`~ntkgp.training.train_marglik` call (see its arguments)."""

    structure: Structure
    prior_structure: GroupSpec
    schedule: Schedule
    batch_size: int | None
    lr: float
    hyper_lr: float
    optimizer: Callable[..., torch.optim.Optimizer]
    scheduler: Callable | None
    learn_likelihood: bool
    curvature_batch_size: int
    seed: int
    progress: bool | None
    distributed: bool


def check_options(
    train_x: object,
    train_y: object,
    *,
    structure: object,
    prior_structure: GroupSpec,
    epochs: object,
    batch_size: object,
    lr: object,
    optimizer: object,
    scheduler: object,
    burn_in: object,
    frequency: object,
    hyper_steps: object,
    hyper_lr: object,
    learn_likelihood: object,
    curvature_batch_size: object,
    seed: object,
    progress: object,
    distributed: object,
) -> MarglikOptions:
    """Check every option (and the kind of ``train_x``: a tensor, or a re-iterable loader with ``train_y=None``).

    Raises:
        TypeError, ValueError: naming the argument.
    """
    structure = choose(Structure, structure, "structure")
    schedule = Schedule(epochs=check_int(epochs, "epochs", 1), burn_in=check_int(burn_in, "burn_in", 0),
                        frequency=check_int(frequency, "frequency", 1), hyper_steps=check_int(hyper_steps, "hyper_steps", 0))
    curvature_batch_size = check_int(curvature_batch_size, "curvature_batch_size", 1)
    seed = check_int(seed, "seed", 0)
    if batch_size is not None:
        batch_size = check_int(batch_size, "batch_size", 1)
    lr = positive_float(lr, "lr")
    hyper_lr = positive_float(hyper_lr, "hyper_lr")
    if not callable(optimizer):
        raise TypeError(f"optimizer must be an optimizer class (callable), got {optimizer!r}")
    if scheduler is not None and not callable(scheduler):
        raise TypeError(
            "scheduler must be None or a callable that takes the MAP optimizer and returns a learning-rate "
            f"scheduler (e.g. functools.partial(torch.optim.lr_scheduler.MultiStepLR, milestones=[...])), got "
            f"{scheduler!r}"
        )
    flag(learn_likelihood, "learn_likelihood")
    check_progress(progress)
    distributed = check_distributed(distributed)
    if not torch.is_tensor(train_x) and train_y is not None and is_structured(train_x):
        check_data(train_x, "train_x")  # a dict/tuple of input tensors (ntkgp.ntk.packed_inputs); numbers refused
    elif not torch.is_tensor(train_x):
        _check_loader(train_x, train_y, batch_size)
    return MarglikOptions(structure=structure, prior_structure=prior_structure, schedule=schedule,
                          batch_size=batch_size, lr=lr, hyper_lr=hyper_lr, optimizer=optimizer, scheduler=scheduler,
                          learn_likelihood=learn_likelihood, curvature_batch_size=curvature_batch_size, seed=seed,
                          progress=progress, distributed=distributed)


def _check_loader(train_x: object, train_y: object, batch_size: int | None) -> None:
    check_data(train_x, "train_x")  # an array is not a loader of batches
    if train_y is not None:
        raise TypeError(
            f"train_x must be a torch.Tensor when train_y is given (or a loader of (x, y) batches with train_y=None), "
            f"got {type(train_x).__name__}"
        )
    if isinstance(train_x, (str, bytes)) or not isinstance(train_x, Iterable):
        raise TypeError(
            f"train_x must be a tensor or a re-iterable of (x, y) batches (a DataLoader), got {type(train_x).__name__}"
        )
    if isinstance(train_x, Iterator):  # checked without iterating: that would draw from a loader's generator
        raise ValueError(
            "train_x must be re-iterable (a DataLoader, a list of (x, y) batches): it is read once to check every "
            f"batch and once per epoch, got the one-shot {type(train_x).__name__}"
        )
    if batch_size is not None:
        raise ValueError("batch_size must be None when train_x is a loader: the loader's batches are the mini-batches")


def _name(factory: Callable) -> str:
    """A factory's name for messages (a ``functools.partial`` is named by its function)."""
    inner = getattr(factory, "func", factory)
    return getattr(inner, "__name__", type(inner).__name__)


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` needs a closure that re-evaluates the loss (``torch.optim.LBFGS``, or any
    optimizer whose ``step`` takes a ``closure`` argument without a default)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return True
    try:
        parameter = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without an inspectable signature: the plain protocol
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def make_optimizer(factory: Callable, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """``factory(params, lr=lr)``, checked to be a :class:`torch.optim.Optimizer` (it touches no weight).

    Raises:
        TypeError, ValueError: naming ``optimizer``, when the call fails or gives something else.
    """
    name = _name(factory)
    try:
        optimizer = factory(params, lr=lr)
    except Exception as error:  # the factory's own refusal (an unknown keyword, an invalid lr): named here
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"optimizer: {name}(params, lr={lr:g}) raised {type(error).__name__}: {error}") from error
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must give a torch.optim.Optimizer when called as optimizer(params, lr=lr), "
                        f"got {type(optimizer).__name__}")
    return optimizer


def make_scheduler(factory: Callable | None, optimizer: torch.optim.Optimizer) -> object | None:
    """``factory(optimizer)``, checked to have a ``step`` method (a learning-rate scheduler); ``None`` for none.

    Raises:
        TypeError, ValueError: naming ``scheduler``.
    """
    if factory is None:
        return None
    name = _name(factory)
    try:
        scheduler = factory(optimizer)
    except Exception as error:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"scheduler: {name}(optimizer) raised {type(error).__name__}: {error}") from error
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"scheduler must give a learning-rate scheduler (with a step method), got "
                        f"{type(scheduler).__name__}")
    return scheduler

