"""Input and network checks shared by every entry point."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.instancenorm import _InstanceNorm

from ..validation import exact_names, positive_count
from .inputs import Inputs, check_structure, describe, detach, is_integer, is_structured, rows
from .inputs import to as to_network
from .outputs import OutputSelectionError, describe_output


def check_eval_mode(
    net: nn.Module, argument: str = "net", modules: Iterable[tuple[str, nn.Module]] | None = None
) -> None:
    """Raise when the network would treat examples differently per batch.

    BatchNorm in training mode (or without running statistics, in any mode) mixes the examples of a batch and
    dropout in training mode is random, so the per-example Jacobian, and hence the kernel, would not be a
    function of one input.
    The network is not switched to eval mode here: that is the user's decision. ``modules``:
    ``net.named_modules()`` when the caller has just walked them.
    """
    for name, module in net.named_modules() if modules is None else modules:
        if isinstance(module, _BatchNorm) and not module.track_running_stats:
            raise ValueError(
                f"{argument} contains {type(module).__name__} module '{name or type(net).__name__}' with "
                "track_running_stats=False: it normalizes with the statistics of each batch even in eval mode, "
                "so the network's output for one input depends on the others in its batch and the NTK is not "
                "defined. Use track_running_stats=True (running statistics) or another normalization."
            )
        if not module.training:
            continue
        if isinstance(module, _InstanceNorm) and module.track_running_stats:
            raise ValueError(
                f"{argument} contains {type(module).__name__} module '{name or type(net).__name__}' in training mode "
                "with track_running_stats=True: every forward pass would update its running statistics (the "
                f"network's buffers). Call {argument}.eval() before building an ntkgp object."
            )
        if isinstance(module, _BatchNorm) or (isinstance(module, _DropoutNd) and module.p > 0):
            kind = type(module).__name__
            raise ValueError(
                f"{argument} contains {kind} module '{name or type(net).__name__}' in training mode: its output "
                f"depends on the batch (or on random draws), so the NTK is not defined. Call {argument}.eval() "
                "before building an ntkgp object."
            )


def check_has_values(x: torch.Tensor, argument: str) -> None:
    """Raise ``ValueError`` naming ``argument`` for a tensor on the ``meta`` device (shapes without values)."""
    if x.is_meta:
        raise ValueError(f"{argument} is on the meta device, which holds shapes but no values to compute with")


def check_network_values(net: nn.Module, argument: str = "net") -> None:
    """Raise ``ValueError`` naming ``argument`` for a network with a parameter or buffer on the ``meta`` device."""
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        if t.is_meta:
            raise ValueError(f"{argument} has {name!r} on the meta device, which holds shapes but no values to "
                             "compute with: load the network's weights first")


def check_initialized(net: nn.Module, argument: str = "net") -> None:
    """Raise ``ValueError`` naming ``argument`` and the module for a lazy module (``nn.LazyLinear``, ...) whose
    parameters or buffers are not initialized yet: their shapes are unknown until a batch has been through it."""
    for name, module in net.named_modules():
        for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
            lazy = [k for k, t in tensors.items() if t is not None and nn.parameter.is_lazy(t)]
            if lazy:
                raise ValueError(
                    f"{argument} has the uninitialized lazy module '{name or type(net).__name__}' "
                    f"({type(module).__name__}; {kind} {lazy[0]!r} has no shape yet): run one batch through the "
                    f"network first (e.g. {argument}(x[:1])) so that its parameters are created, then build the "
                    "ntkgp object"
                )


def check_inputs(x: torch.Tensor, argument: str = "x") -> None:
    """Raise on non-tensor, meta, empty or non-finite inputs."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
    check_has_values(x, argument)
    if x.dim() < 1 or x.shape[0] == 0:
        raise ValueError(f"{argument} must have a leading batch dimension with at least one example, got shape {tuple(x.shape)}")
    if x.is_floating_point() and not torch.isfinite(x).all():
        raise ValueError(f"{argument} contains NaN or Inf values")


class OutputShapeError(ValueError):
    """The network's outputs for a batch of ``N`` inputs are not an ``(N, C)`` matrix (a ``ValueError``, so that
    callers can tell this case from other bad inputs without reading the message)."""


def check_outputs(f: torch.Tensor, n: int, argument: str = "net") -> None:
    """Raise unless the network output is a finite ``(N, C)`` matrix (:class:`OutputShapeError` for the shape)."""
    if f.dim() != 2 or f.shape[0] != n:
        raise OutputShapeError(
            f"{argument} must map a batch of {n} inputs to outputs of shape ({n}, C), got {tuple(f.shape)} "
            "(for a single output, return shape (N, 1))"
        )
    if not torch.isfinite(f).all():
        raise ValueError(f"{argument} produced NaN or Inf outputs")


def check_shape(shape: object, argument: str) -> tuple[int, ...] | None:
    """``None`` or a tuple of positive integers (e.g. ``input_shape``)."""
    if shape is None:
        return None
    if not isinstance(shape, tuple | list | torch.Size):
        raise TypeError(f"{argument} must be a tuple of positive integers, got {shape!r}")
    return tuple(positive_count(s, argument) for s in shape)


def check_rows(v: torch.Tensor, rows: int, argument: str, max_dim: int = 2) -> None:
    """Raise unless ``v`` is a finite floating tensor of shape ``(rows,)`` or ``(rows, k)``."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(v).__name__}")
    check_has_values(v, argument)
    if not v.is_floating_point():
        raise TypeError(f"{argument} must be a floating-point tensor, got dtype {v.dtype}")
    if not 1 <= v.dim() <= max_dim or v.shape[0] != rows:
        shapes = f"({rows},)" + (f" or ({rows}, k)" if max_dim == 2 else "")
        raise ValueError(f"{argument} must have shape {shapes}, got {tuple(v.shape)}")
    if not torch.isfinite(v).all():
        raise ValueError(f"{argument} contains NaN or Inf values")


def check_tangents(u: object, shapes: dict[str, torch.Size], argument: str = "u") -> None:
    """Raise unless ``u`` maps every trainable parameter name to a finite floating tensor of its shape,
    all with or all without one trailing column dimension ``k`` (the same ``k``)."""
    if not isinstance(u, dict):
        raise TypeError(f"{argument} must be a dict from parameter names to tensors, got {type(u).__name__}")
    exact_names(u, shapes, argument)
    trailing = set()
    for name, shape in shapes.items():
        t = u[name]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{argument}[{name!r}] must be a floating-point tensor")
        check_has_values(t, f"{argument}[{name!r}]")
        if tuple(t.shape) == tuple(shape):
            trailing.add(None)
        elif t.dim() == len(shape) + 1 and tuple(t.shape[:-1]) == tuple(shape):
            trailing.add(t.shape[-1])
        else:
            raise ValueError(f"{argument}[{name!r}] must have shape {tuple(shape)} or {tuple(shape) + ('k',)}, got {tuple(t.shape)}")
        if not torch.isfinite(t).all():
            raise ValueError(f"{argument}[{name!r}] contains NaN or Inf values")
    if len(trailing) > 1:
        raise ValueError(f"{argument} mixes tensors with and without (or with different) trailing columns k")


def prepare_inputs(
    x: Inputs, argument: str, dtype: torch.dtype, device: torch.device, input_shape: tuple[int, ...] | None
) -> Inputs:
    """Check ``x`` (:func:`check_inputs`, real) and bring it to ``dtype`` (floating inputs; integer token ids are
    never cast), ``device`` and ``(N, *input_shape)`` (flat ``(N, D)`` inputs are reshaped); a copy only where
    needed. A dict/tuple of tensors (:mod:`ntkgp.ntk.inputs`) is checked leaf by leaf (common leading dimension,
    finite floating-point leaves) and moved the same way; ``input_shape`` applies to tensor inputs only."""
    if is_structured(x):
        check_structure(x, argument)
        if input_shape is not None:
            raise ValueError(f"input_shape={input_shape} applies to tensor inputs, but {argument} is a "
                             f"{type(x).__name__} of tensors: leave input_shape=None")
        return to_network(x, dtype, device)
    check_inputs(x, argument)
    if x.is_complex():
        raise TypeError(f"{argument} must be a real tensor, got dtype {x.dtype}")
    x = to_network(x, dtype, device)
    if input_shape is not None and tuple(x.shape[1:]) != input_shape:
        if x.dim() == 2 and x.shape[1] == math.prod(input_shape):
            return x.reshape(x.shape[0], *input_shape)
        raise ValueError(
            f"{argument} must have shape (N, {', '.join(map(str, input_shape))}) or (N, {math.prod(input_shape)}), "
            f"got {tuple(x.shape)}"
        )
    return x


def check_fits(
    net: nn.Module, params: dict[str, torch.Tensor], x: Inputs, argument: str, num_outputs: int | None
) -> int:
    """One forward pass of ``x[:1]``: raise a ``ValueError`` naming ``argument`` when ``x`` does not fit the
    network (the network's own error is chained), when the network returns a dict or a tuple (choose one with
    ``output=``, :mod:`ntkgp.ntk.outputs`), or when the outputs are not ``(1, C)`` with the ``C`` seen before.
    Returns ``C``."""
    from .functional import forward

    try:
        with torch.no_grad():
            f = forward(net, params, detach(rows(x, 0, 1)))
    except OutputSelectionError:
        raise
    except Exception as error:  # the network's own error, re-raised with the argument's name
        hint = (" (integer inputs are passed to the network as they are, as token ids for an nn.Embedding; "
                "convert real-valued features with .to(torch.float64))" if is_integer(x) else "")
        raise ValueError(
            f"{argument} of {describe(x)} does not fit the network: {type(error).__name__}: {error}{hint}"
        ) from error
    if not isinstance(f, torch.Tensor):
        raise ValueError(
            f"net returns {describe_output(f)} instead of a tensor of outputs: choose the output to use with "
            "output= (a key of the dict, e.g. output='logits', or an index of the tuple, e.g. output=0)"
        )
    check_outputs(f, 1)
    if num_outputs is not None and f.shape[1] != num_outputs:
        raise ValueError(f"{argument} gives {f.shape[1]} network outputs, earlier inputs {num_outputs}")
    return f.shape[1]


def check_not_array(x: object, argument: str) -> None:
    """Raise ``TypeError`` naming ``argument`` for an array that is not a tensor (a NumPy array, or anything
    with ``__array__``): it would otherwise be read as an iterable of batches."""
    if not isinstance(x, torch.Tensor) and hasattr(x, "__array__"):
        raise TypeError(f"{argument} must be a torch.Tensor (or an iterable of (x, y) batches), got "
                        f"{type(x).__name__}: convert it with torch.as_tensor({argument})")
