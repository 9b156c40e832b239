"""ntkgp's one cache mechanism: results keyed by the *values* of the tensors they depend on.

Everything ntkgp caches (Jacobians and Grams for given inputs, a site posterior for given hyperparameters)
depends on tensors a user can change in ways that leave no trace on the tensor object: ``p.data`` writes,
``load_state_dict``, an optimiser step, a setter. Version counters and ``data_ptr`` miss some of these,
so a key here is a detached copy of every tensor the result depends on (inputs, the trainable weights and
buffers, hyperparameters), compared by value with ``torch.equal``; frozen parameters, which can be a whole
pretrained network, enter through their :func:`fingerprint` instead. The copies cost as much memory as the
tensors themselves (``O(N·D + P + #hyperparameters)`` per entry), far less than what is cached.

Results are never cached, and never served from the cache, when an input requires grad: a cached value
carries no graph to a new input tensor, so reusing it would cut the user's gradient.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from .validation import count


def _snapshot(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().clone() for t in tensors)


def same_values(stored: Sequence[torch.Tensor], current: Sequence[torch.Tensor]) -> bool:
    """Whether ``current`` holds the same tensors as the copies ``stored``: number, shapes, dtypes, devices and
    values (``torch.equal``)."""
    if len(stored) != len(current):
        return False
    for a, b in zip(stored, current):  # a loop, not all() of a generator: a lookup compares many small tensors
        if not (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)):
            return False
    return True


_INTEGER_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NO_TENSORS = torch.zeros(0, dtype=torch.int64)  # the fingerprint of no tensors (no entry to change: one shared)


def fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Two integers per tensor, the sums of its entries' bit patterns over all entries and over the even-numbered
    ones, modulo 2⁶⁴: a key for tensors too large to copy into every cache entry (the frozen parameters of a
    pretrained network), compared by value like a copy. Integer sums do not depend on the order of the additions,
    so the key is the same whatever the number of threads or the device; any change of a single entry changes the
    first sum, and a change that leaves both as they were is, in practice, only a permutation of entries. Shape
    ``(2·k,)``, ``int64``, on the CPU; no temporary the size of a tensor (the sums accumulate in ``int64``)."""
    rows = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        bits = flat.view(_INTEGER_VIEW[flat.element_size()]) if flat.is_floating_point() else flat
        rows.append(torch.stack([bits.sum(dtype=torch.int64), bits[::2].sum(dtype=torch.int64)]))
    return torch.cat(rows).cpu() if rows else _NO_TENSORS


def network_key(
    net: torch.nn.Module, covered: Sequence[torch.Tensor], parameters: Iterable[torch.Tensor] | None = None,
    buffers: Iterable[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """What results computed from ``net`` depend on, as a cache or guard key: the parameters ``covered`` (those
    differentiated, e.g. θ*) and the buffers themselves, and a :func:`fingerprint` of every other parameter
    (frozen ones: they change the outputs and Jacobians, but a frozen backbone is not copied into every key).
    ``parameters`` and ``buffers``: ``net.parameters()`` and ``net.buffers()`` when the caller has just walked
    them (:func:`ntkgp.ntk.network.walk`: one walk of the modules less each)."""
    ids = {id(p) for p in covered}
    every = net.parameters() if parameters is None else parameters
    held = net.buffers() if buffers is None else buffers
    return [*covered, *held, fingerprint([p for p in every if id(p) not in ids])]


class ValueCache:
    """A small LRU cache whose keys are a tag and the values of a sequence of tensors.

    Args:
        size: number of entries kept (0 disables caching).

    Example:
        >>> cache = ValueCache(size=2)
        >>> x = torch.randn(3, 2)
        >>> w = torch.ones(2)
        >>> y = cache.get_or_compute("scaled", [x], lambda: x * w, state=[w])
        >>> _ = w.data.mul_(2)                  # a change the version counter would miss
        >>> torch.equal(cache.get_or_compute("scaled", [x], lambda: x * w, state=[w]), x * w)
        True
    """

    def __init__(self, size: int = 4) -> None:
        self.size = count(size, "cache size")
        self._entries: OrderedDict[int, tuple[object, tuple[torch.Tensor, ...], object]] = OrderedDict()
        self._next = 0

    def get_or_compute(
        self,
        tag: object,
        inputs: Sequence[torch.Tensor],
        compute: Callable[[], object],
        state: Sequence[torch.Tensor] = (),
    ) -> object:
        """The cached result for ``(tag, values of inputs, values of state)``, or ``compute()`` stored under it.

        ``inputs`` are the data the result is computed at (never served from the cache when one requires
        grad); ``state`` are the weights and hyperparameters it depends on (compared by value only).
        """
        inputs = list(inputs)
        if self.size == 0 or any(t.requires_grad for t in inputs):
            return compute()
        key = inputs + list(state)
        for slot, (stored_tag, stored, value) in list(self._entries.items()):  # a snapshot: threads may store
            if stored_tag == tag and same_values(stored, key):
                try:
                    self._entries.move_to_end(slot)
                except KeyError:  # evicted by another thread meanwhile
                    pass
                return value
        value = compute()
        self._entries[self._next] = (tag, _snapshot(key), value)
        self._next += 1
        while len(self._entries) > self.size:
            try:
                self._entries.popitem(last=False)
            except KeyError:  # emptied by another thread meanwhile
                break
        return value

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
