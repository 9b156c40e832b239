"""The audit's machinery: the case registry, the five outcomes, snapshots of user objects, refusal checks.

A case is a function that does what a user would do and returns ``HELD`` or ``CLEAR-ERROR`` (with a short
detail), or raises:

* :class:`SilentWrong` — the library returned a value that disagrees with an independent computation (a
  float64 reference, a freshly built model, brute force) and said nothing;
* :class:`ModifiedUserObject` — a network, likelihood or tensor of the user's changed (parameters, buffers,
  ``.grad`` (values and identity), ``requires_grad`` flags, training flags, hooks, tensor values);
* anything else that escapes the case is a ``RAW-ERROR``: an exception the library did not turn into a clear
  error (a torch/GPyTorch message, or a documented error type whose message does not name the argument).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

HELD, CLEAR, SILENT = "HELD", "CLEAR-ERROR", "SILENT-WRONG"
MODIFIED, RAW = "MODIFIED-USER-OBJECT", "RAW-ERROR"
OUTCOMES = (HELD, CLEAR, SILENT, MODIFIED, RAW)


class SilentWrong(AssertionError):
    """A wrong value returned without an error."""


class ModifiedUserObject(AssertionError):
    """A user's object changed."""


class UnclearError(Exception):
    """A documented error type whose message does not name the argument (counted as RAW-ERROR)."""


@dataclass(frozen=True)
class Case:
    id: str
    area: str
    what: str
    fn: Callable[[], object]


REGISTRY: list[Case] = []


def case(case_id: str, area: str, what: str):
    """Register ``fn`` as audit case ``case_id`` of ``area``; ``what`` says what a user tried."""

    def register(fn):
        if any(c.id == case_id for c in REGISTRY):
            raise ValueError(f"duplicate audit case id {case_id}")
        REGISTRY.append(Case(case_id, area, what, fn))
        return fn

    return register


# ---------------------------------------------------------------------- outcomes of a single call
@dataclass
class Refused:
    """The library refused a call with a documented error that names the argument."""

    error: BaseException

    def __str__(self) -> str:
        first = str(self.error).splitlines()[0] if str(self.error) else ""
        return f"{type(self.error).__name__}: {first[:160]}"


def attempt(fn: Callable[[], object], errors: tuple[type[BaseException], ...] = (ValueError, TypeError),
            names: Sequence[str] = ()) -> object:
    """``fn()``, or :class:`Refused` if it raised one of ``errors`` whose message contains one of ``names``.

    A documented error type whose message names none of ``names`` raises :class:`UnclearError` (RAW-ERROR);
    any other exception propagates (RAW-ERROR).
    """
    try:
        return fn()
    except errors as error:
        message = str(error)
        if names and not any(name in message for name in names):
            named = " / ".join(names)
            raise UnclearError(f"{type(error).__name__} not naming {named}: {message[:200]}") from error
        return Refused(error)


def refusal(fn: Callable[[], object], errors: tuple[type[BaseException], ...] = (ValueError, TypeError),
            names: Sequence[str] = (), accepted_is_wrong: str = "") -> tuple[str, str]:
    """A call that must be refused: ``(CLEAR, message)``; accepting it raises :class:`SilentWrong`."""
    outcome = attempt(fn, errors, names)
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    raise SilentWrong(accepted_is_wrong or f"accepted without an error (returned {type(outcome).__name__})")


# ---------------------------------------------------------------------- comparisons
def _f64(value) -> torch.Tensor:
    """``value`` as a float64 CPU tensor (a Python float directly, never through float32)."""
    if torch.is_tensor(value):
        return value.detach().cpu().double()
    return torch.as_tensor(value, dtype=torch.float64)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _f64(a), _f64(b)
    if a.shape != b.shape:
        raise SilentWrong(f"shape {tuple(a.shape)} against the reference's {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    if not torch.isfinite(a).all():
        raise SilentWrong("non-finite values where the reference is finite")
    return (a - b).abs().max().item()


def close(a, b, atol: float, rtol: float = 0.0, what: str = "value") -> float:
    """The largest absolute difference; :class:`SilentWrong` when above ``atol + rtol·|b|``."""
    a_, b_ = _f64(a), _f64(b)
    err = max_abs(a_, b_)
    bound = atol + rtol * (b_.abs().max().item() if b_.numel() else 0.0)
    if not err <= bound:
        raise SilentWrong(f"{what} off by {err:.3g} (allowed {bound:.3g})")
    return err


def same(a, b, what: str = "value") -> None:
    """Bitwise equal (NaN payloads included)."""
    if not _bitwise_equal(torch.as_tensor(a), torch.as_tensor(b)):
        raise SilentWrong(f"{what} differs from the reference (max |Δ| = {max_abs(a, b):.3g})")


# ---------------------------------------------------------------------- snapshots of user objects
def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "meta":
        return torch.empty(0)
    t = t.cpu().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(_bits(a), _bits(b))


class _Record:
    """What is compared for one object."""

    def __init__(self, label: str, obj: object, state: bool = True) -> None:
        self.label, self.obj, self.compare_state = label, obj, state
        if isinstance(obj, nn.Module):
            self.state = {k: v.detach().clone() for k, v in obj.state_dict(keep_vars=True).items()}
            self.params = list(obj.named_parameters())
            self.grads = [(p.grad, None if p.grad is None else p.grad.detach().clone())
                          for _, p in self.params]
            self.flags = [p.requires_grad for _, p in self.params]
            self.dtypes = [p.dtype for _, p in self.params]
            self.modes = [m.training for m in obj.modules()]
            self.hooks = [_hook_count(m) for m in obj.modules()]
        elif isinstance(obj, torch.Tensor):
            self.value = obj.detach().clone()
            self.stride, self.flag = obj.stride(), obj.requires_grad
            self.grad = (obj.grad, None if obj.grad is None else obj.grad.detach().clone())
        else:
            raise TypeError(f"cannot snapshot {type(obj).__name__}")

    def changes(self) -> list[str]:
        obj, out = self.obj, []
        if isinstance(obj, nn.Module):
            now = obj.state_dict(keep_vars=True)
            if list(now) != list(self.state):
                out.append("its state_dict keys")
            for key, before in self.state.items() if self.compare_state else ():
                if key in now and not _bitwise_equal(now[key].detach(), before):
                    out.append(f"{key}")
            for (name, p), (obj_before, value_before), flag, dtype in zip(self.params, self.grads, self.flags,
                                                                           self.dtypes):
                if p.grad is not obj_before:
                    now = _describe(p.grad)
                    out.append(f"{name}.grad (another object: {_describe(obj_before)} -> {now})")
                elif value_before is not None and not _bitwise_equal(p.grad.detach(), value_before):
                    out.append(f"{name}.grad values")
                if p.requires_grad != flag:
                    out.append(f"{name}.requires_grad {flag} -> {p.requires_grad}")
                if p.dtype != dtype:
                    out.append(f"{name}.dtype {dtype} -> {p.dtype}")
            if [m.training for m in obj.modules()] != self.modes:
                out.append("a module's train/eval mode")
            if [_hook_count(m) for m in obj.modules()] != self.hooks:
                out.append("its hooks (left registered)")
        else:
            if not _bitwise_equal(obj.detach(), self.value):
                out.append("its values")
            if obj.requires_grad != self.flag:
                out.append("requires_grad")
            grad_before, value_before = self.grad
            if obj.grad is not grad_before or (value_before is not None
                                               and not _bitwise_equal(obj.grad.detach(), value_before)):
                out.append(".grad")
        return [f"{self.label}: {c}" for c in out]


def _describe(grad) -> str:
    return "None" if grad is None else "a tensor"


def _hook_count(m: nn.Module) -> int:
    return sum(len(getattr(m, name, {})) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
        "_state_dict_hooks", "_load_state_dict_pre_hooks"))


class Snapshot:
    """Copies of user objects (``label=object`` pairs) taken now; :meth:`check` compares them. With
    ``state=False`` the values of modules' parameters and buffers are not compared (``train_marglik`` trains
    the network in place), everything else is."""

    def __init__(self, state: bool = True, **objects: object) -> None:
        self.records = [_Record(label, obj, state) for label, obj in objects.items() if obj is not None]

    def changes(self) -> list[str]:
        return [c for r in self.records for c in r.changes()]

    def check(self) -> None:
        changes = self.changes()
        if changes:
            raise ModifiedUserObject("; ".join(changes[:6]) + (" ..." if len(changes) > 6 else ""))


@contextlib.contextmanager
def untouched(state: bool = True, **objects: object):
    """Inside: the user's objects must not change, whatever happens (also when the block raises); ``state``:
    see :class:`Snapshot`."""
    snapshot = Snapshot(state, **objects)
    try:
        yield snapshot
    except BaseException as error:
        changes = snapshot.changes()
        if changes:
            raise ModifiedUserObject("; ".join(changes[:6]) + f" (then {type(error).__name__})") from error
        raise
    snapshot.check()


# ---------------------------------------------------------------------- interrupts
class Interrupter:
    """A forward hook that raises ``error`` at the ``at``-th call (counting from 1) of ``module``."""

    def __init__(self, module: nn.Module, at: int, error: BaseException | None = None) -> None:
        self.calls, self.at, self.error = 0, at, error or KeyboardInterrupt()
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.calls += 1
        if self.calls == self.at:
            raise self.error

    def remove(self) -> None:
        self.handle.remove()


def expect_interrupt(fn: Callable[[], object],
                     kind: type[BaseException] = KeyboardInterrupt) -> BaseException:
    """Run ``fn``; it must raise ``kind`` (returned); returning normally means the interrupt was lost."""
    try:
        fn()
    except kind as error:
        return error
    raise SilentWrong(f"the {kind.__name__} did not propagate")


def quiet() -> contextlib.AbstractContextManager:
    """Warnings off (cases that check a warning record them themselves)."""
    manager = warnings.catch_warnings()

    class _Quiet(contextlib.AbstractContextManager):
        def __enter__(self):
            manager.__enter__()
            warnings.simplefilter("ignore")

        def __exit__(self, *exc):
            return manager.__exit__(*exc)

    return _Quiet()


def finite(*values: torch.Tensor) -> bool:
    return all(torch.isfinite(torch.as_tensor(v)).all() for v in values)


def fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.2g}"


def iter_cases(areas: Iterable[str] | None = None, ids: Iterable[str] | None = None) -> list[Case]:
    areas = set(areas) if areas else None
    ids = set(ids) if ids else None
    return [c for c in REGISTRY if (areas is None or c.area in areas) and (ids is None or c.id in ids)]
