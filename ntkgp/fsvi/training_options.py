"""The option groups of :func:`~ntkgp.fsvi.train_fsvi`: the FSVI model it builds and its optimisation
(:mod:`ntkgp.option_groups`).

Each is a frozen dataclass; its fields are checked, naming them, when ``train_fsvi`` is called (the model's by
:class:`~ntkgp.fsvi.FSVI` itself), before anything is read or trained.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["FSVIOptimization", "FSVIOptions"]


@dataclass(frozen=True)
class FSVIOptions:
    """The options of the :class:`~ntkgp.fsvi.FSVI` model that :func:`~ntkgp.fsvi.train_fsvi` builds, besides its
    prior precisions (its constructor's keywords).

    Attributes:
        prior_mean: ``"zero"``, ``"initial"`` or a mapping, see :class:`~ntkgp.fsvi.GaussianParameterPrior`.
        prior_linearization: ``"variational_mean"`` (default) or ``"prior_mean"``.
        init_std: the initial :math:`s` of every weight (below the prior's).
        context_jitter: relative shared noise on the context outputs, see :class:`~ntkgp.fsvi.FSVI`.
        kl_covariance: ``"full"`` (default), ``"block"`` or ``"diagonal"``: the covariance over the context
            outputs that the KL keeps, see :class:`~ntkgp.fsvi.FSVI`.
        input_shape: one input's shape as the network expects it (default: the inputs' own shape).
        strategy: ``"auto"`` or ``"contraction"``, see :class:`~ntkgp.fsvi.linearized.LinearizedNetwork`.
        output: for a network returning a dict or a tuple, the key or index of the output to use
            (:mod:`ntkgp.ntk.outputs`).

    Example:
        >>> FSVIOptions(kl_covariance="diagonal").init_std
        0.001
    """

    prior_mean: str | Mapping[str, Tensor] = "zero"
    prior_linearization: str = "variational_mean"
    init_std: float = 1e-3
    context_jitter: float = 1e-2
    kl_covariance: str = "full"
    input_shape: Sequence[int] | None = None
    strategy: str = "auto"
    output: str | int | None = None


@dataclass(frozen=True)
class FSVIOptimization:
    """How :func:`~ntkgp.fsvi.train_fsvi` optimizes the objective (besides ``lr`` and ``epochs``).

    Attributes:
        optimizer: a ``torch.optim`` class (default ``torch.optim.Adam``), called as ``optimizer(params, lr=lr)``.
        num_samples: ``S``, weight draws per step for the expected log-likelihood.
        context_batch_fraction: the fraction of the context points taken from the current mini-batch
            (:class:`~ntkgp.fsvi.BatchMixedContext`; the paper uses 0.5 with monochrome images).
        learn_likelihood: also optimize the likelihood's parameters (Gaussian noise) on the objective.
        seed: seeds shuffling, context points and weight draws (the global random state is not used).

    Example:
        >>> FSVIOptimization(num_samples=4).optimizer is torch.optim.Adam
        True
    """

    # a factory, not a class attribute: the API reference would document torch.optim.Adam as a member
    optimizer: Callable[..., torch.optim.Optimizer] = field(default_factory=lambda: torch.optim.Adam)
    num_samples: int = 1
    context_batch_fraction: float = 0.0
    learn_likelihood: bool = False
    seed: int = 0
