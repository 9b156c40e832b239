r"""Networks whose ``forward`` returns a dict or a tuple: the output the library uses, chosen by ``output=``.

A network may return ``{"logits": f, ...}`` (Hugging Face models) or ``(f, aux)``. Every entry point
(``NTKKernel``, ``NTKGP``, ``SFR``, FSVI, ``laplace_posterior``, ``train_marglik``) takes ``output=`` — a key of
the dict or an index of the tuple — and uses :func:`with_output`: a *view* of the network whose ``forward`` is
the user's, followed by :func:`select_output`. The view is a shallow copy of the network's root module (an
instance of a subclass of its class): it shares the user's submodules, parameters, buffers and hooks (the same
dictionaries), so every pass — the direct call, ``torch.func.functional_call``, the layer hooks, training —
sees the chosen output, parameter names are unchanged, and the user's module itself is not modified. This is
the one place where an output is selected.

Without ``output=``, a network returning a dict or a tuple is refused when the first input is checked
(:func:`~ntkgp.ntk.checks.check_fits`), with a ``ValueError`` naming the output's type and ``output``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["OutputSelectionError", "check_output_choice", "describe_output", "select_output", "with_output"]


class OutputSelectionError(ValueError):
    """The network's output cannot be selected as ``output=`` asks (a ``ValueError``)."""


def check_output_choice(output: object, argument: str = "output") -> str | int | None:
    """``None``, a key (``str``) or an index (``int``); ``TypeError`` naming ``argument`` otherwise."""
    if output is None or isinstance(output, str) or (isinstance(output, int) and not isinstance(output, bool)):
        return output
    raise TypeError(f"{argument} must be None, a key (str) of the network's output dict or an index (int) of its "
                    f"output tuple, got {output!r}")


def describe_output(out: object) -> str:
    """``"a dict with keys ['logits']"``, ``"a tuple of 2 elements"``, or the type's name."""
    if isinstance(out, Mapping):
        return f"a {type(out).__name__} with keys {list(out.keys())}"
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of {len(out)} elements"
    return f"a {type(out).__name__}"


def select_output(out: Any, output: str | int) -> Tensor:
    """``out[output]`` for a dict or a tuple/list returned by the network.

    Raises:
        OutputSelectionError: ``out`` is a tensor (nothing to select: leave ``output=None``), the key or index is
            missing, or the selected value is not a tensor.
    """
    if isinstance(out, Tensor) or not isinstance(out, Mapping | tuple | list):
        raise OutputSelectionError(f"output={output!r} was given, but the network returns {describe_output(out)}, "
                                   "not a dict or a tuple: leave output=None")
    try:
        chosen = out[output]
    except (KeyError, IndexError, TypeError):
        raise OutputSelectionError(
            f"output={output!r} is not in the network's output, {describe_output(out)}") from None
    if not isinstance(chosen, Tensor):
        raise OutputSelectionError(f"output={output!r} selects {describe_output(chosen)} from the network's output, "
                                   "not a tensor")
    return chosen


_VIEW_CLASSES: dict[type, type] = {}


def _selecting_forward(self: nn.Module, *args, **kwargs) -> Tensor:
    inner = self.__dict__.get("_ntkgp_forward")  # a forward the user set on the instance
    base = type(self).__mro__[1]  # the user's class
    out = inner(*args, **kwargs) if inner is not None else base.forward(self, *args, **kwargs)
    return select_output(out, self.__dict__["_ntkgp_output"])


def _reduce_view(self: nn.Module, protocol: int) -> tuple:
    """Pickled (and deep-copied) as ``with_output(net, output)`` of the user's network."""
    return with_output, (self.__dict__["_ntkgp_source"], self.__dict__["_ntkgp_output"])


def view_class(cls: type, forward, reduce, cache: dict[type, type]) -> type:
    """The subclass of the user's module class ``cls`` with this ``forward`` and pickling ``reduce`` (one per class,
    kept in ``cache``), named and placed as ``cls`` so that a view reads as the user's network."""
    view = cache.get(cls)
    if view is None:
        view = type(cls.__name__, (cls,), {"forward": forward, "__reduce_ex__": reduce,
                                            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        cache[cls] = view
    return view


def _view_class(cls: type) -> type:
    return view_class(cls, _selecting_forward, _reduce_view, _VIEW_CLASSES)


def with_output(net: nn.Module, output: str | int | None) -> nn.Module:
    """``net`` itself for ``output=None``; else a view of ``net`` returning ``select_output(net(x), output)``,
    sharing the network's submodules, parameters, buffers and hooks (module docstring).

    Raises:
        TypeError: ``output`` is not ``None``, a ``str`` or an ``int``.
    """
    output = check_output_choice(output)
    if output is None or not isinstance(net, nn.Module):
        return net
    view = object.__new__(_view_class(type(net)))
    view.__dict__.update(net.__dict__)  # the same _modules, _parameters, _buffers and hook dictionaries
    inner = view.__dict__.pop("forward", None)
    object.__setattr__(view, "_ntkgp_forward", inner)
    object.__setattr__(view, "_ntkgp_output", output)
    object.__setattr__(view, "_ntkgp_source", net)  # for pickling and deep copies (_reduce_view)
    return view
