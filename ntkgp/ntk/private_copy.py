r"""ntkgp's private structural copy of a user's network: every pass runs on it, never on the user's module.

``torch.func.functional_call`` swaps a module's parameters for the tensors it is given for the length of a call,
and a feature pass registers forward hooks: done on the user's module, another thread would see plain tensors in
place of its ``nn.Parameter``\ s, hooks it never registered and forwards that raise. ntkgp therefore evaluates a
**structural copy** (:func:`structural_copy`): its own module objects (each a shallow copy with its own
``_parameters``, ``_buffers``, ``_modules`` and hook dictionaries, and copies of its other list, dict and set
attributes, e.g. ``nn.RNNBase._flat_weights``, which ``RNNBase.__setattr__`` rewrites) that share the user's
parameter and buffer tensors (tied weights stay tied; an in-place update of a weight is seen at once). The user's
own hooks are carried over; ntkgp's are registered on the copy only.

:class:`PrivateCopies` keeps one copy per thread (a copy is never used by two threads at once) and rebuilds it when
the network changes in structure: :func:`signature` (the identities of every module, its class and every value of
its ``__dict__`` — parameters, buffers, submodules, hooks, training flags, plain attributes) is computed only when
a pass is about to run. Building a copy costs a few microseconds per module and no tensor is copied.

Some fused kernels have no forward-mode derivative (``aten::_transformer_encoder_layer_fwd``,
``aten::_native_multi_head_attention``, the flash ``scaled_dot_product_attention`` on a CPU, which has no double
backward either). :func:`differentiable_kernels` turns torch's attention fast path off and restricts
``scaled_dot_product_attention`` to its math backend for the length of a pass, for the networks that need it
(found once on a probe, :mod:`ntkgp.ntk.autodiff`). These are process-wide torch settings: while such a pass runs,
attention in other threads also takes the math kernels (the same values up to rounding); they are restored when
the last concurrent pass ends.

:class:`ModelLock` is the per-model re-entrant lock of the models whose cache fills are serialized
(docs/guarantees.md, "Threads"): it is picklable and deep-copyable (a copy gets a fresh lock).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["ModelLock", "PrivateCopies", "differentiable_kernels", "model_lock", "signature", "structural_copy"]


def structural_copy(net: nn.Module) -> nn.Module:
    """A copy of ``net``'s module tree sharing its parameter and buffer tensors (module docstring).

    A module reached twice (shared) is copied once, so that names and sharing are those of ``net``. Methods of a
    module bound to it as instance attributes (``module.forward = types.MethodType(f, module)``) are bound to its
    copy. The copy is built with ``object.__new__`` and a new ``__dict__`` (no ``__init__``, no ``__setattr__``,
    no ``copy.copy``, which parametrized modules refuse)."""
    memo: dict[int, nn.Module] = {}

    def copy_module(module: nn.Module) -> nn.Module:
        done = memo.get(id(module))
        if done is not None:
            return done
        new = object.__new__(type(module))
        memo[id(module)] = new
        state = {}
        for key, value in module.__dict__.items():
            if key == "_modules":
                state[key] = type(value)((k, None if m is None else copy_module(m)) for k, m in value.items())
            elif isinstance(value, dict):
                state[key] = value.copy() if type(value) is dict else type(value)(value)
            elif isinstance(value, list | set):
                state[key] = type(value)(value) if type(value) in (list, set) else list(value)
            elif isinstance(value, types.MethodType) and value.__self__ is module:
                state[key] = types.MethodType(value.__func__, new)
            else:
                state[key] = value
        new.__dict__.update(state)
        return new

    return copy_module(net)


def signature(net: nn.Module) -> list:
    """What a structural copy of ``net`` depends on: for every module (each once), its identity and its class's,
    and for each entry of its ``__dict__`` the key and the identity of the value (of each item of a dict, list or
    set: parameters, buffers, submodules, hooks). The values a copy holds are kept alive by it, so an identity
    cannot be reused while the copy exists."""
    out: list = []
    add, extend = out.append, out.extend
    for module in net.modules():
        add(id(module))
        add(id(type(module)))
        for key, value in module.__dict__.items():
            add(key)
            if isinstance(value, dict):
                extend(value.keys())
                extend(map(id, value.values()))
                add(len(value))
            elif isinstance(value, list | set):
                extend(map(id, value))
                add(len(value))
            else:
                add(id(value))
    return out


class PrivateCopies:
    """One structural copy of ``net`` per thread, rebuilt when ``net``'s :func:`signature` changes.

    ``kernels``: the copies' passes run under :func:`differentiable_kernels` (set once a probe found that the network
    needs them; :func:`use_kernels` reads it from a copy). Pickled and deep-copied without the copies (a copy is
    rebuilt on first use)."""

    def __init__(self, net: nn.Module, kernels: bool = False) -> None:
        self.net = net
        self.kernels = kernels
        self._local = threading.local()

    def get(self) -> nn.Module:
        """This thread's copy of the network as it is now."""
        sig = signature(self.net)
        entry = getattr(self._local, "entry", None)
        if entry is not None and entry[0] == sig:
            copy = entry[1]
        else:
            copy = structural_copy(self.net)
            self._local.entry = (sig, copy)
        if self.kernels and not copy.__dict__.get("_ntkgp_kernels"):
            copy.__dict__["_ntkgp_kernels"] = True
        return copy

    def __reduce__(self):
        return type(self), (self.net, self.kernels)

    def __deepcopy__(self, memo: dict) -> PrivateCopies:
        net = memo.get(id(self.net), self.net)
        return type(self)(net, self.kernels)


def use_kernels(module: nn.Module) -> bool:
    """Whether passes through ``module`` (a private copy) run under :func:`differentiable_kernels`."""
    return bool(module.__dict__.get("_ntkgp_kernels"))


_KERNEL_LOCK = threading.Lock()
_kernel_depth = 0
_kernel_saved: tuple | None = None


@contextmanager
def differentiable_kernels(on: bool = True) -> Iterator[None]:
    """Torch's attention fast path off and ``scaled_dot_product_attention`` on its math backend while the block runs
    (``on``; module docstring). Re-entrant and thread-safe: the settings are restored when the last block ends."""
    global _kernel_depth, _kernel_saved
    if not on:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with _KERNEL_LOCK:
        if _kernel_depth == 0:
            context = sdpa_kernel([SDPBackend.MATH])
            context.__enter__()
            _kernel_saved = (context, torch.backends.mha.get_fastpath_enabled())
            torch.backends.mha.set_fastpath_enabled(False)
        _kernel_depth += 1
    try:
        yield
    finally:
        with _KERNEL_LOCK:
            _kernel_depth -= 1
            if _kernel_depth == 0:
                context, fast = _kernel_saved
                _kernel_saved = None
                torch.backends.mha.set_fastpath_enabled(fast)
                context.__exit__(None, None, None)


class ModelLock:
    """A re-entrant lock held by a model around its prediction and cache fills (a context manager). Pickled and
    deep-copied as a fresh lock: a copy of a model is another model."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> ModelLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def __reduce__(self):
        return type(self), ()

    def __deepcopy__(self, memo: dict) -> ModelLock:
        return type(self)()


def model_lock(model: object) -> ModelLock:
    """The :class:`ModelLock` of ``model`` (a model or kernel), made on first use and kept in its ``__dict__`` (no
    ``__init__`` change; a model unpickled from an older version gets one too)."""
    lock = model.__dict__.get("_ntkgp_lock")
    if lock is None:
        with _KERNEL_LOCK:  # two threads asking at once get the same lock
            lock = model.__dict__.setdefault("_ntkgp_lock", ModelLock())
    return lock
