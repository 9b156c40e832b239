"""Option groups: the settings of a long signature gathered by concept into frozen dataclasses, and the one rule
that keeps the old flat keywords working for one release.

A function with many settings keeps flat the arguments a user sets every time (the network, the data, the
likelihood, the main sizes) and takes the rest as groups, e.g. ``train_marglik(...,
schedule=HyperparameterSchedule(burn_in=10))``. :func:`accepts_flat_keywords` lets a caller still pass a group's
field as a flat keyword (``train_marglik(..., burn_in=10)``): the value goes into the group and a
``FutureWarning`` names the group to use. Giving the same field both ways is an error. This module imports nothing
of ntkgp, so that every package can use it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import TypeVar

__all__ = ["accepts_flat_keywords", "check_group"]

F = TypeVar("F", bound=Callable)
G = TypeVar("G")


def check_group(value: object, group: type[G], argument: str) -> G:
    """``value`` if it is a ``group`` instance, ``group()`` (its defaults) for ``None``.

    Raises:
        TypeError: naming ``argument`` and the group.
    """
    if value is None:
        return group()
    if not isinstance(value, group):
        raise TypeError(f"{argument} must be a {group.__name__} or None, got {type(value).__name__}")
    return value


def _same(a: object, b: object) -> bool:
    """Whether a group's field ``a`` is still its default ``b`` (identity, or equality of plain values)."""
    plain = (bool, int, float, str, tuple, type(None))
    return a is b or (isinstance(a, plain) and isinstance(b, plain) and a == b)


def accepts_flat_keywords(**groups: type) -> Callable[[F], F]:
    """Decorate a function (or ``__init__``) whose keyword ``name`` takes the dataclass ``groups[name]``, so that
    each field of that dataclass is still accepted as a flat keyword, for one release.

    A flat keyword replaces the field in the group passed (or in the group's defaults) before the function runs, with
    a ``FutureWarning`` naming the group; the function then checks it as it checks the group's fields, so a bad value
    is refused naming the field either way. A group's fields must not be parameters of the function.

    Args:
        **groups: parameter name → the frozen dataclass it takes.

    Raises:
        TypeError: (at a call) a field given both flat and, with a value other than its default, in the group passed;
            a group argument of another type.
    """

    def decorate(function: F) -> F:
        parameters = inspect.signature(function).parameters
        owner = {f.name: name for name, group in groups.items() for f in dataclasses.fields(group)}
        overlap = sorted(set(owner) & set(parameters))
        if overlap:
            raise AssertionError(f"{function.__qualname__}: group fields {overlap} are also parameters")
        label = function.__qualname__.removesuffix(".__init__")

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            moved: dict[str, dict[str, object]] = {}
            for key in [k for k in kwargs if k in owner]:
                moved.setdefault(owner[key], {})[key] = kwargs.pop(key)
            for name, values in moved.items():
                group, given = groups[name], kwargs.get(name)
                if given is not None:
                    check_group(given, group, name)
                    default = group()
                    twice = sorted(k for k in values if not _same(getattr(given, k), getattr(default, k)))
                    if twice:
                        raise TypeError(f"{label}() got {', '.join(twice)} both as a keyword and in {name}=")
                fields = ", ".join(f"{k}=..." for k in values)
                warnings.warn(
                    f"{label}({fields}) is deprecated: pass {name}={group.__name__}({fields}) "
                    "(the flat keywords will be removed in the next release)",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs[name] = dataclasses.replace(given if given is not None else group(), **values)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
