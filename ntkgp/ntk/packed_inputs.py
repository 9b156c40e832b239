r"""Structured inputs (a dict, tuple or list of tensors) in the GPyTorch models: packed rows of bytes, rebuilt for
the network.

GPyTorch's models hold their inputs as tensors ``(N, D)`` (``ExactGP.train_inputs`` is a tuple of them, and
``model(*model.train_inputs)`` calls the model on them); caches, chunks, inducing points, concatenation and the
model's state all act on rows of one tensor. :class:`~ntkgp.NTKGP`, :class:`~ntkgp.SFR`, FSVI and
:func:`~ntkgp.training.train_marglik` therefore keep a structured input as **one tensor of packed rows** and
rebuild the structure for the network:

* **packing** (:class:`InputPacking`): each leaf, floating-point leaves first converted to the network's dtype,
  flattened per example and read as bytes (``Tensor.view(torch.uint8)``); the leaves' bytes side by side give a
  ``uint8`` tensor ``(N, B)``, ``B`` the bytes of one example. It is exact (no rounding, no cast of token ids:
  ``unpack(pack(x))`` has the values of ``x``) and row ``n`` holds example ``n`` of every leaf, so that selecting,
  concatenating and comparing rows acts on whole examples.
* **the network** (:func:`packed_network`): a *view* of the user's network (as :func:`ntkgp.ntk.outputs.with_output`
  builds one: the same submodules, parameters, buffers and hooks; parameter names unchanged) whose ``forward``
  unpacks a packed tensor and calls the user's ``forward`` with the rebuilt dict (or tuple). Any other input (a dict
  itself) is passed on as it is. Packed rows are integers, so every pass treats them as token ids are treated:
  never cast, never perturbed, inducing and context points chosen among the data.
* **the boundary** (:meth:`InputPacking.pack`): test inputs, new data and inducing points are given as the
  training inputs were (the same keys or positions, the same shape of one example, integer and boolean leaves of
  the same dtype; floating leaves of any floating dtype), checked before anything is computed, with errors naming
  the argument and the leaf (``x['mask']``). A packed tensor ``(N, B)`` of the model (``model.train_x``,
  ``model.train_inputs``, ``sfr.inducing_points``) is accepted as it is; :meth:`InputPacking.unpack` gives the
  structure back.

Gradients with respect to structured inputs are not carried (bytes have none): a leaf that requires grad is
refused (``NotImplementedError``), never silently detached. The user's tensors are never modified (the packed rows
are new tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .inputs import Inputs, check_structure, is_structured
from .outputs import view_class

__all__ = [
    "InputPacking",
    "PackedBatches",
    "input_packing",
    "pack_inputs",
    "packed_network",
    "structure_network",
]


@dataclass(frozen=True)
class _Leaf:
    """One leaf of the structure: its shape per example, dtype and first byte in a packed row."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    stop: int


class InputPacking:
    """How the structured inputs of one model are packed into rows of bytes (module docstring).

    Args:
        spec: the container's structure (``torch.utils._pytree`` spec: keys and nesting).
        leaves: shape per example and dtype of every leaf, in the spec's order.
        names: the leaves as a user indexes them (``"['ids']"``, ``"[0]"``), for error messages.
        device: where packed rows are made (the network's device).
    """

    def __init__(self, spec: pytree.TreeSpec, leaves: list[tuple[tuple[int, ...], torch.dtype]], names: list[str],
                 device: torch.device) -> None:
        self.spec, self.names, self.device = spec, list(names), torch.device(device)
        self.leaves: list[_Leaf] = []
        start = 0
        for shape, dtype in leaves:
            size = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            self.leaves.append(_Leaf(tuple(shape), dtype, start, start + size))
            start += size
        self.width = start  #: ``B``, the bytes of one example
        self.kind = type(pytree.tree_unflatten([0] * len(self.leaves), spec)).__name__  #: ``"dict"``, ``"tuple"``

    @classmethod
    def of(cls, x: Inputs, argument: str, dtype: torch.dtype, device: torch.device) -> InputPacking:
        """The packing of inputs shaped like ``x`` (checked: :func:`~ntkgp.ntk.inputs.check_structure`), floating
        leaves in ``dtype`` (the network's) and rows made on ``device``.

        Raises:
            TypeError, ValueError: as :func:`~ntkgp.ntk.inputs.check_structure`, naming ``argument``.
            NotImplementedError: a leaf requires grad.
        """
        check_structure(x, argument)
        flat, spec = pytree.tree_flatten(x)
        names = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(x)[0]]
        _refuse_graph(flat, names, argument)
        leaves = [(tuple(t.shape[1:]), dtype if t.is_floating_point() else t.dtype) for t in flat]
        return cls(spec, leaves, names, device)

    # ------------------------------------------------------------------ the boundary
    def is_packed(self, x: object) -> bool:
        """Whether ``x`` is a tensor of packed rows of this packing (``uint8``, last dimension ``B``)."""
        return isinstance(x, Tensor) and x.dtype == torch.uint8 and x.dim() >= 2 and x.shape[-1] == self.width

    def check(self, x: object, argument: str) -> int:
        """Check that ``x`` is structured as the training inputs (keys, shape of one example, dtypes of integer
        and boolean leaves) with a common leading dimension and finite floating leaves; returns ``N``.

        Raises:
            TypeError: not a container of tensors, another structure, an integer/boolean leaf of another dtype or
                a floating leaf where the training inputs had none (and conversely).
            ValueError: empty, leading dimensions that differ, another shape of one example, NaN/Inf.
            NotImplementedError: a leaf requires grad.
        """
        if not is_structured(x):
            raise TypeError(f"{argument} must be a {self.kind} of tensors like the training inputs ({self.describe()}), "
                            f"got {type(x).__name__}")
        n = check_structure(x, argument)
        flat, spec = pytree.tree_flatten(x)
        if spec != self.spec:
            got = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(x)[0]]
            raise TypeError(f"{argument} must hold the entries {self.names} like the training inputs, got {got}")
        for t, leaf, name in zip(flat, self.leaves, self.names):
            if tuple(t.shape[1:]) != leaf.shape:
                raise ValueError(f"{argument}{name} must have shape (N, {', '.join(map(str, leaf.shape))}) like the "
                                 f"training inputs, got {tuple(t.shape)}")
            if t.is_floating_point() != leaf.dtype.is_floating_point or (
                    not t.is_floating_point() and t.dtype != leaf.dtype):
                want = "a floating-point tensor" if leaf.dtype.is_floating_point else f"dtype {leaf.dtype}"
                raise TypeError(f"{argument}{name} must have {want} like the training inputs, got {t.dtype}")
        _refuse_graph(flat, self.names, argument)
        return n

    def pack(self, x: object, argument: str) -> Tensor:
        """``x`` as packed rows ``(N, B)`` (``uint8``, on the network's device; a new tensor), after :meth:`check`;
        a tensor of packed rows is returned as it is (moved to the device)."""
        if self.is_packed(x):
            return x.to(self.device)
        n = self.check(x, argument)
        parts = []
        for t, leaf in zip(pytree.tree_leaves(x), self.leaves):
            t = t.detach().to(device=self.device, dtype=leaf.dtype).reshape(n, _numel(leaf.shape)).contiguous()
            parts.append(t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8))
        return torch.cat(parts, dim=1) if parts else torch.zeros(n, 0, dtype=torch.uint8, device=self.device)

    def unpack(self, rows: Tensor) -> Inputs:
        """The structure of packed rows ``(*lead, B)``: leaves ``(*lead, *shape)`` (new tensors)."""
        lead = rows.shape[:-1]
        out = []
        for leaf in self.leaves:
            part = rows[..., leaf.start:leaf.stop]
            # a fresh buffer with standard strides (a one-row slice is "contiguous" with the packed row's stride,
            # which viewing bytes as a wider dtype refuses)
            part = torch.empty(part.shape, dtype=torch.uint8, device=rows.device).copy_(part)
            t = part.to(torch.bool) if leaf.dtype == torch.bool else part.view(leaf.dtype)
            out.append(t.reshape(*lead, *leaf.shape))
        return pytree.tree_unflatten(out, self.spec)

    def describe(self) -> str:
        """``['ids']: (16,) torch.int64, ['mask']: (16,) torch.bool`` (for error messages and reprs)."""
        return ", ".join(f"{name}: {leaf.shape} {leaf.dtype}" for name, leaf in zip(self.names, self.leaves))

    def __repr__(self) -> str:
        return f"InputPacking({self.describe()}; {self.width} bytes per example)"

    def __reduce__(self) -> tuple:
        """Pickled (and deep-copied) with the structure as a plain container of zeros (no pytree spec object)."""
        skeleton = pytree.tree_unflatten([0] * len(self.leaves), self.spec)
        return _restore, (skeleton, [(leaf.shape, leaf.dtype) for leaf in self.leaves], self.names, str(self.device))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InputPacking) and (self.spec, self.leaves) == (other.spec, other.leaves)

    __hash__ = None


def _restore(skeleton: object, leaves: list, names: list[str], device: str) -> InputPacking:
    return InputPacking(pytree.tree_flatten(skeleton)[1], leaves, names, torch.device(device))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _refuse_graph(flat: list[Tensor], names: list[str], argument: str) -> None:
    for t, name in zip(flat, names):
        if t.requires_grad:
            raise NotImplementedError(
                f"{argument}{name} requires grad, but structured inputs are held as packed rows of bytes, which "
                f"carry no gradient: pass detached tensors (gradients with respect to the inputs need a tensor input)")


# ---------------------------------------------------------------------- the network view
_VIEW_CLASSES: dict[type, type] = {}


def _unpacking_forward(self: nn.Module, x: Any = None, *args, **kwargs) -> Any:
    packing: InputPacking = self.__dict__["_ntkgp_packing"]
    if packing.is_packed(x):
        x = packing.unpack(x)
    inner = self.__dict__.get("_ntkgp_input_forward")  # a forward the user set on the instance
    if inner is not None:
        return inner(x, *args, **kwargs)
    return self.__dict__["_ntkgp_input_class"].forward(self, x, *args, **kwargs)


def _reduce_view(self: nn.Module, protocol: int) -> tuple:
    """Pickled (and deep-copied) as ``packed_network(net, packing)`` of the user's network."""
    return packed_network, (self.__dict__["_ntkgp_input_source"], self.__dict__["_ntkgp_packing"])


def _view_class(cls: type) -> type:
    return view_class(cls, _unpacking_forward, _reduce_view, _VIEW_CLASSES)


def packed_network(net: nn.Module, packing: InputPacking) -> nn.Module:
    """A view of ``net`` that takes packed rows of ``packing`` (and, as ``net``, the structure itself): it shares
    the network's submodules, parameters, buffers and hooks (:func:`ntkgp.ntk.outputs.with_output`'s kind of view;
    the user's module is not modified). A view of an output view (``output=``) is built below it, so that the
    output is selected after the inputs are rebuilt."""
    source_output = net.__dict__.get("_ntkgp_output")
    if source_output is not None:  # an output view: inputs rebuilt first, then the output selected
        from .outputs import with_output

        return with_output(packed_network(net.__dict__["_ntkgp_source"], packing), source_output)
    if isinstance(net.__dict__.get("_ntkgp_packing"), InputPacking):  # already a view: a new one of its source
        net = net.__dict__["_ntkgp_input_source"]
    view = object.__new__(_view_class(type(net)))
    view.__dict__.update(net.__dict__)  # the same _modules, _parameters, _buffers and hook dictionaries
    inner = view.__dict__.pop("forward", None)
    object.__setattr__(view, "_ntkgp_input_forward", inner)
    object.__setattr__(view, "_ntkgp_input_class", type(net))
    object.__setattr__(view, "_ntkgp_packing", packing)
    object.__setattr__(view, "_ntkgp_input_source", net)
    return view


def input_packing(net: object) -> InputPacking | None:
    """The packing of a network view made by :func:`packed_network` (through an output view too), else ``None``."""
    packing = getattr(net, "__dict__", {}).get("_ntkgp_packing")
    return packing if isinstance(packing, InputPacking) else None


def pack_inputs(net: object, x: object, argument: str) -> object:
    """``x`` packed for ``net`` (:meth:`InputPacking.pack`) when ``net`` is a view of :func:`packed_network`;
    otherwise ``x`` as it is (the caller's own checks follow: a structured input to a model of tensor inputs is
    refused there)."""
    packing = input_packing(net)
    if packing is None:
        if is_structured(x) and any(isinstance(t, Tensor) for t in pytree.tree_leaves(x)):
            raise TypeError(f"{argument} is a {type(x).__name__} of tensors, but this model was built on tensor "
                            "inputs: build it on structured training inputs to predict at structured inputs")
        return x
    if isinstance(x, Tensor) and not packing.is_packed(x):
        raise TypeError(f"{argument} must be a {packing.kind} of tensors like the training inputs ({packing.describe()}) "
                        f"or their packed rows "
                        f"(uint8, {packing.width} bytes per example), got a tensor of {tuple(x.shape)} {x.dtype}")
    return packing.pack(x, argument)


def _network_dtype(net: nn.Module) -> tuple[torch.dtype, torch.device]:
    for t in [*net.parameters(), *net.buffers()]:
        if t.is_floating_point():
            return t.dtype, t.device
    return torch.get_default_dtype(), torch.device("cpu")


def structure_network(net: nn.Module, x: object, argument: str) -> tuple[nn.Module, object]:
    """For structured training inputs ``x``: the view of ``net`` that takes packed rows, and ``x`` packed;
    otherwise ``(net, x)`` unchanged (a view already built passes packed rows on)."""
    if not is_structured(x) or not isinstance(net, nn.Module) or input_packing(net) is not None:
        return net, x
    dtype, device = _network_dtype(net)
    packing = InputPacking.of(x, argument, dtype, device)
    return packed_network(net, packing), packing.pack(x, argument)


class PackedBatches:
    """The ``(x, y)`` batches of a loader with each structured ``x`` packed (:meth:`InputPacking.pack`); re-iterable
    when the loader is, one-shot when it is (then the batch already read is given first)."""

    def __init__(self, batches: Iterable, packing: InputPacking, argument: str, first: object = None) -> None:
        self.batches, self.packing, self.argument, self._first = batches, packing, argument, first

    def _pairs(self, source: Iterator) -> Iterator:
        for pair in source:
            if isinstance(pair, tuple | list) and len(pair) == 2 and not isinstance(pair[0], Tensor):
                yield self.packing.pack(pair[0], self.argument), pair[1]
            else:
                yield pair

    def __iter__(self) -> Iterator:
        if self._first is not None:  # a one-shot source: its first batch was read to learn the structure
            first, self._first = self._first, None
            return self._pairs(_chain([first], self.batches))
        return self._pairs(iter(self.batches))

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def dataset(self) -> object:
        return getattr(self.batches, "dataset", None)


def _chain(first: list, rest: Iterable) -> Iterator:
    yield from first
    yield from rest


def _peek(batches: Iterable) -> object:
    """The first batch of ``batches``, read without moving torch's global random state or the loader's own
    generators (a shuffling ``DataLoader`` draws its order from them): the epochs that follow are those of a loader
    never read."""
    generators = [g for g in (getattr(batches, "generator", None), getattr(getattr(batches, "sampler", None),
                                                                          "generator", None))
                  if isinstance(g, torch.Generator)]
    states = [g.get_state() for g in generators]
    with torch.random.fork_rng(devices=[]):
        first = next(iter(batches), None)
    for g, state in zip(generators, states):
        g.set_state(state)
    return first


def structure_batches(net: nn.Module, batches: object, argument: str) -> tuple[nn.Module, object]:
    """For a loader of ``(x, y)`` batches whose first ``x`` is structured: the view of ``net`` and the batches
    packed (:class:`PackedBatches`); otherwise ``(net, batches)`` unchanged. The first batch is read once to learn
    the structure (a one-shot iterator gives it again first)."""
    if isinstance(batches, Tensor | dict) or not isinstance(batches, Iterable) \
            or isinstance(batches, str | bytes) or not isinstance(net, nn.Module) or input_packing(net) is not None:
        return net, batches
    one_shot = isinstance(batches, Iterator)  # not iter(batches) is batches: a DataLoader's iter draws a seed
    first = _peek(batches)
    if not (isinstance(first, tuple | list) and len(first) == 2 and is_structured(first[0])):
        if one_shot and first is not None:
            return net, _chain([first], batches)
        return net, batches
    dtype, device = _network_dtype(net)
    packing = InputPacking.of(first[0], argument, dtype, device)
    if one_shot:
        return packed_network(net, packing), iter(PackedBatches(batches, packing, argument, first))
    return packed_network(net, packing), PackedBatches(batches, packing, argument)
