r"""Checking what SFR is given, and streaming the data into :class:`~ntkgp.models.sfr.statistics.DualStatistics`.

Every public entry of :class:`~ntkgp.models.sfr.SFR` validates its arguments here before any side effect:
tensors must be floating point, finite in every row and shaped like the network's input; integer
arguments must be positive integers (``2.7`` is rejected, not truncated). Errors name the argument.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor
from tqdm.auto import tqdm

from ...caching import same_values
from ...likelihoods import is_gaussian, validate_targets
from ...ntk import NTKEngine
from ...options import OutputCoupling, PriorMean
from .statistics import DualStatistics, system_grams_and_diagonal

__all__ = [
    "InputLayout",
    "StateGuard",
    "check_inputs",
    "data_names",
    "positive_int",
    "stream_statistics",
    "training_batches",
]


def positive_int(value: object, argument: str) -> int:
    """``value`` as an ``int`` if it is a positive integer (``bool`` and non-integral numbers are rejected).

    Raises:
        ValueError: naming ``argument``.
    """
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"{argument} must be a positive integer, got {value!r}")
    return number


def check_inputs(x: object, argument: str) -> Tensor:
    """Raise unless ``x`` is a floating-point tensor ``(N, ...)`` with ``N >= 1`` and finite in every row.

    Raises:
        TypeError: if ``x`` is not a tensor or not floating point.
        ValueError: for fewer than two dimensions, no rows, or NaN/Inf values (the first bad row is named).
    """
    if not torch.is_tensor(x):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{argument} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < 2 or x.shape[0] == 0:
        raise ValueError(
            f"{argument} must have shape (N, ...) with one row per example (N >= 1), got {tuple(x.shape)}; "
            "a single input feature needs shape (N, 1)"
        )
    finite = torch.isfinite(x.detach()).reshape(x.shape[0], -1).all(-1)
    if not bool(finite.all()):
        row = int(torch.nonzero(~finite)[0, 0])
        raise ValueError(f"{argument} contains NaN or Inf values (first in row {row})")
    return x


@dataclass(frozen=True)
class InputLayout:
    """The shape of one example as the network takes it, and how test inputs may arrive.

    Attributes:
        example_shape: shape of one example after :meth:`NTKEngine.prepare` (e.g. ``(D,)`` or ``(1, 28, 28)``).
        flat_ok: whether examples may also arrive flattened to ``prod(example_shape)`` features (``input_shape``).
    """

    example_shape: tuple[int, ...]
    flat_ok: bool

    def split(self, x: Tensor, argument: str) -> tuple[torch.Size, int]:
        """The batch shape and number of points of ``x`` ``(*batch, n, *example)`` (or flat examples).

        Raises:
            ValueError: naming ``argument`` when the trailing dimensions do not match the examples.
        """
        k = len(self.example_shape)
        if x.dim() >= k + 1 and tuple(x.shape[x.dim() - k :]) == self.example_shape:
            return x.shape[: x.dim() - k - 1], x.shape[x.dim() - k - 1]
        if self.flat_ok and x.dim() >= 2 and x.shape[-1] == math.prod(self.example_shape):
            return x.shape[:-2], x.shape[-2]
        shape = ", ".join(map(str, self.example_shape))
        raise ValueError(
            f"{argument} must have shape (..., n, {shape}) like the training inputs, got {tuple(x.shape)}"
        )

    def check(self, x: object, argument: str, batched: bool = False) -> tuple[Tensor, torch.Size]:
        """Validate ``x`` (:func:`check_inputs`, shape) and return it as ``(B·n, *example)`` with its batch shape."""
        if not torch.is_tensor(x):
            raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
        batch, n = self.split(x, argument)
        if batch and not batched:
            raise ValueError(f"{argument} must have shape (N, ...) without batch dimensions, got {tuple(x.shape)}")
        flat = x.reshape(-1, *self.example_shape)
        check_inputs(flat, argument)
        if n == 0:
            raise ValueError(f"{argument} must hold at least one example, got shape {tuple(x.shape)}")
        return flat, batch


@dataclass(frozen=True)
class StateGuard:
    """What the statistics were computed at: the network's weights :math:`\theta^*` and the inducing inputs.

    Attributes:
        weights: :meth:`~ntkgp.ntk.NTKEngine.network_state`: copies of the trainable parameters and the buffers
            (e.g. BatchNorm's running statistics), and a fingerprint of the frozen parameters (they change ``J``
            too).
        inducing_points: a copy of ``Z``.
    """

    weights: tuple[Tensor, ...]
    inducing_points: Tensor

    @classmethod
    def of(cls, engine: NTKEngine, inducing_points: Tensor) -> StateGuard:
        return cls(tuple(p.detach().clone() for p in engine.network_state()), inducing_points.detach().clone())

    def check(self, engine: NTKEngine, inducing_points: Tensor) -> None:
        """Raise ``RuntimeError`` if either changed (compared by value: ``.data`` writes, optimizers and
        ``load_state_dict`` are all seen)."""
        if not same_values(self.weights, engine.network_state()):
            raise RuntimeError(
                "the network's weights changed after this SFR model was built (trainable or frozen parameters, or "
                "buffers such as BatchNorm's running statistics); its dual statistics were "
                "accumulated at the old weights, so it no longer describes the network: build a new SFR"
            )
        current_z = inducing_points.detach().to(dtype=self.inducing_points.dtype, device=self.inducing_points.device)
        if current_z.shape != self.inducing_points.shape or not torch.equal(current_z, self.inducing_points):
            raise RuntimeError(
                "sfr.inducing_points was modified in place; the statistics belong to the old inducing inputs: "
                "build a new SFR with inducing_points=..."
            )


def data_names(argument: str) -> tuple[str, str]:
    """The public names of the inputs and targets: ``train_x``, ``train_y`` or ``x_new``, ``y_new`` (``"new"``)."""
    return ("x_new", "y_new") if argument == "new" else (f"{argument}_x", f"{argument}_y")


def training_batches(x: object, y: object, argument: str) -> Iterator[tuple[Tensor, Tensor]]:
    """``(x, y)`` batches from tensors or an iterable of pairs, each checked (:func:`check_inputs`, row counts).

    ``argument`` names the data in errors (``"train"`` → ``train_x``, ``train_y``; ``"new"`` → ``x_new``, ``y_new``).
    """
    name_x, name_y = data_names(argument)
    if torch.is_tensor(x):
        if not torch.is_tensor(y):
            raise TypeError(f"{name_y} must be a tensor when {name_x} is, got {type(y).__name__}")
        check_inputs(x, name_x)
        if y.dim() == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"{name_x} and {name_y} must have the same number of rows, got {tuple(x.shape)} and "
                f"{tuple(y.shape)}"
            )
        yield x, y
        return
    if y is not None:
        raise ValueError(f"{name_y} must be None when {name_x} is a DataLoader or iterable of (x, y) batches")
    if not isinstance(x, Iterable):
        raise TypeError(f"{name_x} must be a tensor or an iterable of (x, y) batches, got {type(x).__name__}")
    for batch in x:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(f"each batch of {name_x} must be a pair (x, y), got {type(batch).__name__}")
        bx, by = batch
        if not (torch.is_tensor(bx) and torch.is_tensor(by)) or by.dim() == 0 or bx.dim() == 0 or bx.shape[0] != by.shape[0]:
            raise ValueError(f"each (x, y) batch of {name_x} must hold tensors with the same number of rows")
        check_inputs(bx, name_x)
        yield bx, by


def prior_mean(engine: NTKEngine, x: Tensor, f: Tensor, kind: PriorMean) -> Tensor:
    r"""The prior mean at prepared inputs ``x`` with network outputs ``f`` ``(N, C)`` (no gradients):
    zero, or :math:`f(x) - J(x)\theta^*` (one forward-mode product, the Jacobian is never formed)."""
    if kind is PriorMean.ZERO:
        return torch.zeros_like(f)
    return f - engine.jvp(x, engine.params()).reshape(f.shape)


def stream_statistics(
    engine: NTKEngine,
    likelihood: Likelihood,
    z: Tensor,
    coupling: OutputCoupling,
    mean: PriorMean,
    batches: Iterable[tuple[Tensor, Tensor]],
    layout: InputLayout,
    rows: int,
    argument: str,
    progress: bool = False,
    prior_precision: Tensor | None = None,
) -> DualStatistics:
    r"""Fresh :class:`DualStatistics` of ``batches`` at inducing inputs ``z`` (nothing else is changed).

    Args:
        engine: the NTK engine of the network.
        likelihood: the model's likelihood.
        z: inducing inputs ``(M, *example)``.
        coupling: output coupling.
        mean: prior mean.
        batches: checked ``(x, y)`` pairs (:func:`training_batches`).
        layout: the examples' layout (every batch is checked against it).
        rows: points per accumulation step.
        argument: prefix for error messages (``"train"``, ``"new"``).
        progress: show a progress bar.
        prior_precision: ``None`` (statistics per group), or the :math:`\delta` at which the groups are combined
            (``statistics="combined"``, :class:`DualStatistics`).

    Returns:
        The statistics (raises before returning anything if any batch is bad).
    """
    name_x, name_y = data_names(argument)
    c = engine.num_outputs(z)
    stats = DualStatistics(
        engine.num_groups, z.shape[0], c, coupling, is_gaussian(likelihood), z.dtype, z.device, prior_precision
    )
    bar = tqdm(desc="SFR dual statistics", unit="pt", disable=not progress, leave=False)
    with torch.no_grad():
        for x, y in batches:
            x = engine.prepare(layout.check(x, name_x)[0], name_x)
            validate_targets(likelihood, y, c, num_data=x.shape[0], name=name_y)
            for s in range(0, x.shape[0], rows):
                xb, yb = x[s : s + rows], y[s : s + rows]
                f = engine.outputs(xb)
                cross, diag = system_grams_and_diagonal(engine, z, xb, coupling)
                stats.accumulate(likelihood, cross, diag, f, prior_mean(engine, xb, f, mean), yb)
                bar.update(xb.shape[0])
    bar.close()
    if int(stats.num_data) == 0:
        raise ValueError(f"{name_x} holds no data")
    return stats

