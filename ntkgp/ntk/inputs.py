r"""Network inputs: one tensor, or a dict (or tuple, or list) of tensors sharing the leading batch dimension.

The network core (:class:`~ntkgp.ntk.network.NetworkCore`: input checks, chunks, every pass of the engine and
of the weight-space posteriors) reads its inputs through this module, so that token ids and structured inputs
are treated alike everywhere (docs/ntk.md, "Inputs and outputs"; ``NTKKernel`` and ``laplace_posterior`` take
dict inputs as they are, the GPyTorch models as packed rows of bytes, :mod:`ntkgp.ntk.packed_inputs`):

* **dtype.** Floating-point leaves are brought to the network's dtype; integer and boolean leaves (token ids,
  attention masks) are passed to the network as they are, only moved to its device. NaN/Inf checks apply to the
  floating-point leaves only.
* **structure.** An input may be a tensor ``(N, ...)`` or a dict, tuple or list of such tensors (nested
  containers too), all with the same leading dimension ``N``: example ``n`` is row ``n`` of every leaf. The
  network is called as ``net(x)`` with the container itself, one argument (a tuple is *not* unpacked into
  several arguments: a network whose ``forward(ids, mask)`` takes two is wrapped by the user in a module whose
  ``forward(x)`` returns ``net(*x)``).
* **rows.** Chunking, indexing (``x[:1]``, ``x[s:e]``, an index tensor), concatenation, the number of examples,
  detaching and device moves act on every leaf (:func:`rows`, :func:`take`, :func:`cat`, :func:`num_rows`, ...).

A plain tensor goes through each function as the tensor operation it names, so that the float path is
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = [
    "Inputs",
    "cat",
    "check_structure",
    "check_tensor",
    "describe",
    "detach",
    "is_integer",
    "is_structured",
    "leaves",
    "map_leaves",
    "num_rows",
    "requires_grad",
    "rows",
    "signature",
    "split",
    "take",
    "to",
]

#: A network input: a tensor ``(N, ...)`` or a dict/tuple/list of them with a common leading dimension ``N``.
Inputs = Union[Tensor, dict, tuple, list]


def is_structured(x: object) -> bool:
    """Whether ``x`` is a container of tensors rather than one tensor."""
    return isinstance(x, dict | tuple | list)


def leaves(x: Inputs) -> list[Tensor]:
    """The tensors of ``x`` (``[x]`` for a tensor), in the container's order."""
    return [x] if isinstance(x, Tensor) else pytree.tree_leaves(x)


def map_leaves(fn: Callable[[Tensor], Tensor], x: Inputs) -> Inputs:
    """``x`` with ``fn`` applied to every tensor (``fn(x)`` for a tensor)."""
    return fn(x) if isinstance(x, Tensor) else pytree.tree_map(fn, x)


def _named(x: Inputs, argument: str) -> list[tuple[str, object]]:
    """``(name, leaf)`` of every leaf, named as the user would index it (``train_x['ids']``, ``x[0]``)."""
    if isinstance(x, Tensor):
        return [(argument, x)]
    return [(argument + pytree.keystr(path), leaf) for path, leaf in pytree.tree_flatten_with_path(x)[0]]


def is_integer(x: Inputs) -> bool:
    """Whether some leaf of ``x`` is not floating point (token ids, masks): such inputs are never averaged or
    perturbed (inducing points and context points are chosen among the data)."""
    return any(not t.is_floating_point() for t in leaves(x))


def check_structure(x: object, argument: str, min_dim: int = 1) -> int:
    """Check that ``x`` is a real tensor, or a non-empty dict/tuple/list of them, each with at least ``min_dim``
    dimensions and the same leading dimension ``N >= 1``, with values (not ``meta``) and finite floating-point
    leaves. Returns ``N``.

    Raises:
        TypeError: not a tensor or a container of tensors (the first other leaf is named, e.g. ``x['mask']``),
            or a complex leaf.
        ValueError: a meta or empty leaf, leading dimensions that differ (each leaf's is named), too few
            dimensions, NaN/Inf in a floating-point leaf.
    """
    if not isinstance(x, Tensor) and not is_structured(x):
        raise TypeError(f"{argument} must be a torch.Tensor or a dict/tuple of tensors, got {type(x).__name__}")
    named = _named(x, argument)
    if not named:
        raise ValueError(f"{argument} is an empty {type(x).__name__}: it holds no tensor")
    for name, leaf in named:
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(leaf).__name__} (every entry of "
                            f"{argument} is a tensor with one row per example)")
        if leaf.is_meta:
            raise ValueError(f"{name} is on the meta device, which holds shapes but no values to compute with")
        if leaf.is_complex():
            raise TypeError(f"{name} must be a real tensor, got dtype {leaf.dtype}")
        if leaf.dim() < min_dim or leaf.shape[0] == 0:
            what = "a leading batch dimension with at least one example" + (
                " and a feature dimension (a single feature needs shape (N, 1))" if min_dim > 1 else "")
            raise ValueError(f"{name} must have {what}, got shape {tuple(leaf.shape)}")
    sizes = {name: leaf.shape[0] for name, leaf in named}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name}: {n}" for name, n in sizes.items())
        raise ValueError(f"the entries of {argument} must share the leading (batch) dimension, got {listed}")
    for name, leaf in named:
        if leaf.is_floating_point() and not bool(torch.isfinite(leaf.detach()).all()):
            raise ValueError(f"{name} contains NaN or Inf values")
    return named[0][1].shape[0]


def num_rows(x: Inputs) -> int:
    """``N``, the number of examples (the leading dimension of every leaf)."""
    return leaves(x)[0].shape[0]


def rows(x: Inputs, start: int, stop: int | None = None) -> Inputs:
    """Examples ``start:stop`` of every leaf (``x[start:stop]`` for a tensor)."""
    return x[start:stop] if isinstance(x, Tensor) else pytree.tree_map(lambda t: t[start:stop], x)


def take(x: Inputs, index: Tensor | Sequence[int]) -> Inputs:
    """The examples ``index`` (an index tensor or list) of every leaf."""
    return x[index] if isinstance(x, Tensor) else pytree.tree_map(lambda t: t[index], x)


def split(x: Inputs, size: int) -> list[Inputs]:
    """Chunks of ``size`` examples (``x.split(size)`` for a tensor)."""
    if isinstance(x, Tensor):
        return list(x.split(size))
    n = num_rows(x)
    return [rows(x, s, s + size) for s in range(0, n, size)]


def cat(xs: Sequence[Inputs]) -> Inputs:
    """The examples of every element of ``xs`` in order (``torch.cat`` for tensors, leaf by leaf otherwise;
    the elements must have the same structure)."""
    if isinstance(xs[0], Tensor):
        return torch.cat(list(xs))
    flat = [pytree.tree_flatten(x) for x in xs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise ValueError("inputs to concatenate must have the same structure (the same keys), got "
                         f"{[str(s) for _, s in flat]}")
    return pytree.tree_unflatten([torch.cat(parts) for parts in zip(*(f for f, _ in flat))], spec)


def to(x: Inputs, dtype: torch.dtype, device: torch.device) -> Inputs:
    """Floating-point leaves in ``dtype`` on ``device``; integer and boolean leaves only moved to ``device``
    (never cast: an ``nn.Embedding`` needs its ids as integers). A leaf already there is returned as it is."""
    return map_leaves(lambda t: t.to(dtype=dtype, device=device) if t.is_floating_point() else t.to(device=device), x)


def detach(x: Inputs) -> Inputs:
    """``x`` without autograd graph (every leaf detached)."""
    return map_leaves(Tensor.detach, x)


def requires_grad(x: Inputs) -> bool:
    """Whether some leaf requires grad."""
    return any(t.requires_grad for t in leaves(x))


def describe(x: Any) -> str:
    """``shape (N, ...) and dtype ...`` of a tensor, or each leaf's (for error messages)."""
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)} and dtype {x.dtype}"
    parts = [f"{pytree.keystr(path)}: {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor)
             else f"{pytree.keystr(path)}: {type(t).__name__}" for path, t in pytree.tree_flatten_with_path(x)[0]]
    return f"{type(x).__name__} of {', '.join(parts)}"


def check_tensor(x: object, argument: str) -> Tensor:
    """A real tensor with values: floating point (features) or integer/boolean (token ids, masks).

    Raises:
        TypeError: not a tensor, or complex, naming ``argument``.
        ValueError: on the ``meta`` device.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_meta:
        raise ValueError(f"{argument} is on the meta device, which holds shapes but no values to compute with")
    if x.is_complex():
        raise TypeError(f"{argument} must be a real tensor (floating point, or integer token ids), got dtype {x.dtype}")
    return x


def signature(x: Inputs) -> tuple:
    """What a check that inputs fit the network depends on: the structure, each leaf's shape of one example and
    dtype, and the device (``(shape[1:], dtype, device)`` for a tensor)."""
    if isinstance(x, Tensor):
        return tuple(x.shape[1:]), x.dtype, x.device
    flat, spec = pytree.tree_flatten(x)
    return str(spec), *((tuple(t.shape[1:]), t.dtype) for t in flat), flat[0].device
