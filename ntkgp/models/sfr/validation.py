r"""Checking what SFR is given: tensors, their layout, integer and boolean options.

Every public entry of :class:`~ntkgp.models.sfr.SFR` validates its arguments here before any side effect:
tensors must be real (floating point, or integer token ids), finite in every row and shaped like the network's input; integer
arguments must be positive integers (``2.7`` is rejected, not truncated; :func:`integer`, :func:`positive_int` and
:func:`optional_positive_int` are :mod:`ntkgp.validation`'s, re-exported); ``progress`` must be ``True``, ``False`` or
``None``. Errors name the argument. The same validators check an option assigned after construction
(:class:`~ntkgp.options.OptionAttribute`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ...ntk.checks import check_has_values
from ...ntk.data_arguments import check_data
from ...ntk.inputs import is_structured
from ...ntk.packed_inputs import (
    PackedBatches,
    input_packing,
    pack_inputs,
    structure_batches,
    structure_network,
)
from ...progress import check_progress
from ...validation import integer, optional_positive_int, positive_int

__all__ = [
    "InputLayout",
    "check_inputs",
    "check_training_data",
    "data_names",
    "first_batch",
    "integer",
    "optional_positive_int",
    "pack_data",
    "pack_inputs",
    "positive_int",
    "progress_flag",
    "refuse_graph",
    "training_batches",
]


def optional_bytes(value: object, argument: str) -> int | None:
    """``None`` or a number of bytes (an integer ``>= 0``): a memory budget such as ``inducing_feature_bytes``."""
    return integer(value, argument, minimum=0, allow_none=True)


def progress_flag(value: object, argument: str) -> bool | None:
    """``value`` if it is ``True``, ``False`` or ``None`` (auto; :func:`ntkgp.progress.check_progress`).

    Raises:
        TypeError: naming ``argument``.
    """
    return check_progress(value, argument)


def check_inputs(x: object, argument: str) -> Tensor:
    """Raise unless ``x`` is a real tensor ``(N, ...)`` with ``N >= 1`` and finite in every row (floating point,
    or integer token ids).

    Raises:
        TypeError: if ``x`` is not a tensor, or complex.
        ValueError: for a meta tensor, fewer than two dimensions, no rows, or NaN/Inf values (the first bad row is named).
    """
    if not torch.is_tensor(x):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
    check_has_values(x, argument)
    if x.is_complex():  # floating point, or integer token ids (passed to the network as they are)
        raise TypeError(f"{argument} must be a real tensor (floating point or integer), got dtype {x.dtype}")
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


def data_names(argument: str) -> tuple[str, str]:
    """The public names of the inputs and targets: ``train_x``, ``train_y`` or ``x_new``, ``y_new`` (``"new"``)."""
    return ("x_new", "y_new") if argument == "new" else (f"{argument}_x", f"{argument}_y")


def training_batches(x: object, y: object, argument: str) -> Iterator[tuple[Tensor, Tensor]]:
    """``(x, y)`` batches from tensors or an iterable of pairs, each checked (:func:`check_inputs`, row counts).

    ``argument`` names the data in errors (``"train"`` → ``train_x``, ``train_y``; ``"new"`` → ``x_new``, ``y_new``).
    """
    name_x, name_y = data_names(argument)
    check_data(x, name_x)  # an array is not an iterable of batches: refused as such, by its name
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


def refuse_graph(tensor: object, argument: str) -> None:
    """Raise ``NotImplementedError`` if ``tensor`` requires grad: SFR's update sums its statistics without a graph,
    so a gradient with respect to the new data would be silently zero."""
    if torch.is_tensor(tensor) and tensor.requires_grad:
        raise NotImplementedError(
            f"{argument} requires grad, but SFR.update sums its statistics without a graph: a gradient with respect "
            f"to {argument} would be silently zero. Pass {argument}.detach(), or use NTKGP or FSVI, whose "
            "conditioning is differentiable in the new inputs"
        )


def check_training_data(train_x: object, train_y: object, inducing_points: object, net=None) -> tuple:
    """The checks of the constructor's data before anything is computed: tensors (and targets with them), a
    re-iterable loader when ``Z`` is chosen from it, ``inducing_points`` like inputs.

    Structured inputs (a dict or tuple of tensors, or a loader of such batches; :mod:`ntkgp.ntk.packed_inputs`)
    are packed into rows of bytes and ``net`` replaced by the view of it that rebuilds them: returns
    ``(net, train_x, inducing_points)`` as the rest of the construction takes them.

    Raises:
        ValueError, TypeError: naming the argument.
        NotImplementedError: a structured input that requires grad.
    """
    if train_y is not None and is_structured(train_x):  # inputs with their targets: a dict/tuple of tensors
        check_data(train_x, "train_x")  # a list of numbers is refused as such
        net, train_x = structure_network(net, train_x, "train_x")
    elif train_y is None and not torch.is_tensor(train_x) and not isinstance(train_x, dict):
        check_data(train_x, "train_x")  # an array is refused before it is read as a loader
        net, train_x = structure_batches(net, train_x, "train_x")
    if inducing_points is not None and (input_packing(net) is not None or is_structured(inducing_points)):
        inducing_points = pack_inputs(net, inducing_points, "inducing_points")
    check_data(train_x, "train_x")
    if torch.is_tensor(train_x):
        if train_y is None:
            raise ValueError("train_y is required when train_x is a tensor")
        check_inputs(train_x, "train_x")
    if inducing_points is not None:
        check_inputs(inducing_points, "inducing_points")
    elif not torch.is_tensor(train_x) and iter(train_x) is train_x:
        raise ValueError(
            "choosing inducing inputs from the data needs two passes over train_x, but it is a one-shot "
            "iterator: pass a DataLoader (or tensors), or give inducing_points"
        )
    return net, train_x, inducing_points


def pack_data(net, x: object, y: object, argument: str) -> object:
    """New data for a model built on structured inputs (``x_new``, a loader of such batches): packed rows (or the
    loader's batches packed); data of a model built on tensors as they are (a structured ``x`` refused)."""
    packing = input_packing(net)
    if y is not None or torch.is_tensor(x) or isinstance(x, dict):  # inputs (with y_new); else a loader
        return pack_inputs(net, x, argument) if torch.is_tensor(x) or is_structured(x) else x
    if packing is None or isinstance(x, str | bytes) or not isinstance(x, Iterable):
        return x
    batches = PackedBatches(x, packing, argument)
    return iter(batches) if isinstance(x, Iterator) else batches


def first_batch(engine, train_x: object, train_y: object, likelihood_name: str, expected_outputs: int):
    """The training pairs, their first batch, the examples' layout and ``C`` (checked against the likelihood's).

    Returns:
        ``(pairs, first, layout, num_outputs)``: the rest of the pairs after ``first``.

    Raises:
        ValueError: for no data, inputs that do not fit the network, or a number of outputs that is not the
            likelihood's.
    """
    pairs = training_batches(train_x, train_y, "train")
    first = next(pairs, None)
    if first is None:
        raise ValueError("train_x holds no data")
    probe = engine.prepare(first[0][:1], "train_x")
    layout = InputLayout(tuple(probe.shape[1:]), engine.input_shape is not None)
    try:
        num_outputs = engine.num_outputs(probe)
    except RuntimeError as error:
        shape = tuple(probe.shape[1:])
        raise ValueError(f"train_x (examples of shape {shape}) does not fit the network: {error}") from error
    if num_outputs != expected_outputs:
        raise ValueError(f"the network has {num_outputs} outputs but {likelihood_name} expects {expected_outputs}")
    return pairs, first, layout, num_outputs
