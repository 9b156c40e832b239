r"""Results that depend on a network's architecture only, kept across the :class:`~ntkgp.ntk.network.NetworkCore`
objects built on one network: its layer plan (:mod:`~ntkgp.ntk.layer_plan`, a forward and a backward pass on a
probe) and whether inputs of a shape fit it (a forward pass of one example).

Every curvature, posterior and model builds its own core, and each core used to repeat these checks for the
same network: on a small MLP they were a quarter of a KFAC build. Here they run once per *architecture* of a
network object: :func:`cached` serves a result only while the network's :class:`Signature` is the one it was
computed under, and computes it again as soon as anything it could depend on other than the weights' values
has changed: a module or parameter replaced, added or removed (held as weak references, compared by identity,
so a freed object whose address is reused never matches), a module's class or its ``forward`` (a class or an
instance one), a plain attribute (``stride``, ``padding``, ``groups``, ``training``, a user's flag), a
parameter's shape, dtype, device or ``requires_grad``, or a hook registered or removed (on a module or global).
The weights' values are not part of it: a plan does not depend on them, as within one core.

The cache holds the network weakly: an entry goes with its network. A core that takes its network as unchanged
for its life (one pass over the data) passes ``held`` to :func:`cached`: its later look-ups serve what its
first one found without another walk of the modules.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import torch
from torch import nn
from torch.nn.modules import module as _module

_SCALARS = {bool, int, float, str, type(None), torch.dtype, torch.device, torch.Size}
_SCALAR_TYPES = tuple(_SCALARS)
#: The global module hooks (``torch.nn.modules.module``'s dictionaries), looked up again at each signature.
_GLOBAL_HOOKS = tuple(k for k, v in vars(_module).items() if k.startswith("_global") and isinstance(v, dict))


def _plain(value: object) -> bool:
    """Whether ``value`` is compared by value in a signature: numbers, strings, dtypes, devices, and tuples or
    lists of them."""
    if isinstance(value, _SCALAR_TYPES):
        return True
    return isinstance(value, tuple | list) and all(_plain(v) for v in value)


def _attributes(module: nn.Module) -> list[tuple[str, object]]:
    """The module's plain attributes and the keys of its hook dictionaries (each a handle's unique id)."""
    out = []
    for k, v in vars(module).items():
        if type(v) in _SCALARS:
            out.append((k, v))
        elif isinstance(v, dict):
            if "hook" in k:
                out.append((k, tuple(v)))
        elif k != "forward" and _plain(v):
            out.append((k, v))
    return out


def _reference(obj: object) -> Callable[[], object]:
    try:
        return weakref.ref(obj)
    except TypeError:  # an object without weak references (a builtin callable set as forward): held
        return lambda: obj


class Signature:
    """What a network's layer plan and fit checks depend on besides the inputs (module docstring): the objects
    (compared by identity, held weakly) and the values (compared by ``==``) of one walk of its modules."""

    def __init__(self, net: nn.Module) -> None:
        objects: list[object] = []
        values: list[object] = [tuple((k, tuple(getattr(_module, k))) for k in _GLOBAL_HOOKS)]
        for name, module in net.named_modules(remove_duplicate=False):
            cls = type(module)
            forward = vars(module).get("forward")
            objects += [module, cls, cls.forward] if forward is None else [module, cls, cls.forward, forward]
            values += [name, forward is None, _attributes(module)]
            for key, p in module._parameters.items():
                if p is None:
                    values.append((key, None))
                else:
                    values.append((key, p.shape, p.dtype, p.device, p.requires_grad))
                    objects.append(p)
        self.objects = objects
        self.values = values

    def frozen(self) -> tuple[list[Callable[[], object]], list[object]]:
        """The signature as it is stored: weak references to the objects, and the values."""
        return [_reference(o) for o in self.objects], self.values

    def matches(self, stored: tuple[list[Callable[[], object]], list[object]]) -> bool:
        """Whether the stored signature is this one (every object the same, every value equal)."""
        references, values = stored
        return (len(references) == len(self.objects) and values == self.values
                and all(r() is o for r, o in zip(references, self.objects)))


_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, dict]] = weakref.WeakKeyDictionary()


def cached(net: nn.Module, key: Hashable, compute: Callable[[], object], held: list | None = None) -> object:
    """``compute()`` for ``net`` and ``key``, computed once per architecture of ``net`` (module docstring).

    ``compute`` must depend on the network through its architecture only and return no reference to the network
    or its modules (the entry would keep the network alive). A ``compute`` that raises stores nothing.

    ``held``: a list kept by one :class:`~ntkgp.ntk.network.NetworkCore`, which takes its network's architecture
    as fixed for its life (it keeps its own plans and fit checks). It holds the entry of the core's first call:
    a later call of the same core finds a result already in that entry (still the network's) without another
    walk of the modules; anything to compute is computed, and stored, under a new signature as without it.
    """
    stored = _CACHE.get(net)
    if held and stored is not None and held[0] is stored and key in stored[1]:
        return stored[1][key]
    signature = Signature(net)
    if stored is None or not signature.matches(stored[0]):
        stored = (signature.frozen(), {})
        _CACHE[net] = stored
    if held is not None:
        held[:] = [stored]
    entries = stored[1]
    if key not in entries:
        entries[key] = compute()
    return entries[key]
