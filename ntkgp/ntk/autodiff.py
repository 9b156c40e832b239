r"""How a network is differentiated, found once on a probe example: the routes that work for its operations.

ntkgp differentiates a network three ways: per-example Jacobians and vector-Jacobian products by ``torch.func.vmap``
over the examples, Jacobian-vector products by forward-mode AD, and ordinary reverse passes (the layer features).
Not every operation supports all of them:

* fused kernels without forward-mode derivatives: ``nn.TransformerEncoderLayer``'s fast path
  (``aten::_transformer_encoder_layer_fwd``), ``nn.MultiheadAttention``'s (``aten::_native_multi_head_attention``)
  and the flash ``scaled_dot_product_attention`` of a CPU (no double backward either): the passes run under
  :func:`~ntkgp.ntk.private_copy.differentiable_kernels` (the fast path off, the math attention backend; the same
  function, differentiable every way);
* operations without a forward-mode derivative (``torch.nn.utils.parametrizations.weight_norm``'s
  ``_weight_norm_interface``): Jacobian-vector products by reverse over reverse
  (:func:`~ntkgp.ntk.functional.jvp_columns`, one double-backward pass per tangent instead of a forward-mode one);
* forwards that cannot be vmapped over examples (``nn.GRU``, ``nn.LSTM``: their initial state is made inside the
  forward): per-example Jacobians and products one example at a time.

:func:`probe` tries each route on two copies of one example (per-example vector-Jacobian products of one column and
Jacobian-vector products of two tangents: memory about ``2·P`` numbers besides the activations), from the cheapest
setting on, and returns the
:class:`Autodiff` that works; when none does it raises a ``ValueError`` at construction that names the module whose
forward failed (found by re-running the failing pass with hooks on ntkgp's private copy) and the error. It runs once
per architecture of a network and input shape (:func:`ntkgp.ntk.architecture.cached`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .functional import forward, jvp_columns, per_example_vjps
from .private_copy import differentiable_kernels

__all__ = ["Autodiff", "probe"]

#: Words of torch's error when a random operation (e.g. functional dropout) runs under ``vmap``.
RANDOM_OPERATION = "random operation"


@dataclass(frozen=True)
class Autodiff:
    """The routes a network is differentiated by (module docstring).

    Attributes:
        kernels: run every pass under :func:`~ntkgp.ntk.private_copy.differentiable_kernels`.
        forward_mode: Jacobian-vector products by forward-mode AD (else reverse over reverse).
        vectorized: per-example passes by ``vmap`` over the examples (else one example at a time).
    """

    kernels: bool = False
    forward_mode: bool = True
    vectorized: bool = True

    def describe(self) -> str:
        """A short description of the routes that differ from the default ones (empty for the default)."""
        parts = []
        if self.kernels:
            parts.append("differentiable attention kernels")
        if not self.forward_mode:
            parts.append("Jacobian-vector products by reverse over reverse")
        if not self.vectorized:
            parts.append("per-example passes one example at a time")
        return ", ".join(parts)


def _works(fn: Callable[[], object]) -> Exception | None:
    try:
        fn()
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError) as error:
        return error
    return None


def _first_working(what: str, route: Callable[[bool], Callable[[], object]],
                   errors: list[tuple[str, Callable[[], object], Exception]], give_up: str | None = None
                   ) -> bool | None:
    """The first option of ``True``, ``False`` for which ``route(option)`` runs (``None``: neither does, or a
    failure's message holds ``give_up``, after which no other option is tried); each failure is appended to
    ``errors`` as ``(what, route(option), error)``."""
    for option in (True, False):
        error = _works(route(option))
        if error is None:
            return option
        errors.append((what, route(option), error))
        if give_up is not None and give_up in str(error):
            return None
    return None


def culprit(net: nn.Module, fn: Callable[[], object]) -> str | None:
    """The name of the innermost module of ``net`` (a private copy) whose forward was running when ``fn`` raised
    (``None``: it did not raise, or outside any submodule). Hooks are registered on ``net`` for the call only."""
    stack: list[str] = []
    failed: list[str] = []
    handles = []
    for name, module in net.named_modules():
        def pre(module, args, name=name):
            stack.append(name)

        def post(module, args, output, name=name):
            if stack and stack[-1] == name:
                stack.pop()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        fn()
    except Exception:  # noqa: BLE001 - only where it failed is wanted
        failed.append(stack[-1] if stack else "")
    finally:
        for handle in handles:
            handle.remove()
    return failed[0] if failed and failed[0] else None


def check_private(net: nn.Module, params: dict[str, Tensor], names: list[str], originals: dict[str, Tensor],
                  x) -> None:
    """Raise ``ValueError`` when the forward of ``net`` (a private copy) reaches one of the user's parameters
    ``originals`` that require grad: a forward that reads modules outside its own module tree (a closure over the
    network set as ``forward``, a module kept in a plain attribute) would be differentiated with respect to the
    copy's parameters while it uses the user's, and its Jacobian would be silently zero. One forward and one
    backward pass of the probe ``x``."""
    watched = [n for n in names if originals[n].requires_grad]
    if not watched:
        return
    with torch.enable_grad():
        local = {n: params[n].detach().requires_grad_(True) for n in names}
        out = forward(net, {**params, **local}, x)
        if not out.requires_grad:
            return
        reached = torch.autograd.grad(out.sum(), [originals[n] for n in watched], allow_unused=True)
    escaped = [n for n, g in zip(watched, reached) if g is not None]
    if escaped:
        raise ValueError(
            f"net's forward uses the parameter {escaped[0]!r} through a reference outside its own module tree (a "
            "closure over the network set as its forward, or a module held in a plain attribute): ntkgp evaluates "
            "a private copy of the network so that the user's module is never touched, and such a forward would "
            "bypass it. Reach every submodule through self (define forward as a method, or bind it with "
            "types.MethodType(function, net))"
        )


def probe(net: nn.Module, params: dict[str, Tensor], names: list[str], x,
          originals: dict[str, Tensor] | None = None) -> Autodiff:
    """The :class:`Autodiff` of ``net`` (a private copy) at ``params`` for inputs shaped like ``x`` (prepared; its
    first example is the probe). With ``originals`` (the user's parameters by name), also :func:`check_private`.

    Raises:
        ValueError: no route differentiates the network, naming the module whose forward failed and the error; or
            the forward escapes the copy (:func:`check_private`).
    """
    with warnings.catch_warnings():  # torch's notices of vmap's slow fallbacks, for routes that may not be taken
        warnings.filterwarnings("ignore", message="There is a performance drop", category=UserWarning)
        return _probe(net, params, names, x, originals)


def _check_batch_independent(net: nn.Module, params: dict[str, Tensor], x, two) -> None:
    """Raise ``ValueError`` when the outputs of one example and of a batch of two copies of it differ in shape: a
    network whose output for an example depends on its batch has no per-example Jacobian."""
    with torch.no_grad():
        one = forward(net, params, pytree.tree_map(lambda t: t[:1].detach(), x))
        pair = forward(net, params, two)
    if tuple(pair.shape) != (2, *one.shape[1:]):
        raise ValueError(
            f"net gives outputs of shape {tuple(one.shape)} for one example but {tuple(pair.shape)} for a batch of two "
            "copies of it: the network's outputs for an example must not depend on the other examples of its batch "
            "(each example (N, ...) -> (N, C))"
        )


def _probe(net: nn.Module, params: dict[str, Tensor], names: list[str], x, originals: dict[str, Tensor] | None
           ) -> Autodiff:
    two = pytree.tree_map(lambda t: torch.cat([t[:1].detach()] * 2), x)
    _check_batch_independent(net, params, x, two)

    def cotangent() -> Tensor:  # one column (2, C, 1), from the outputs' shape
        with torch.no_grad():
            out = forward(net, params, two)
        return torch.ones(*out.shape, 1, dtype=out.dtype, device=out.device)

    if originals is not None:
        check_private(net, params, names, originals, pytree.tree_map(lambda t: t[:1].detach(), x))
    tangents = {n: torch.stack([params[n]] * 2) for n in names}
    errors: list[tuple[str, Callable[[], object], Exception]] = []
    for kernels in (False, True):
        with differentiable_kernels(kernels):
            def jacobians(vectorized: bool) -> Callable[[], object]:  # per-example products: memory 2·P, not 2·C·P
                return lambda: per_example_vjps(net, params, two, cotangent(), names, vectorized)

            def pushes(forward_mode: bool) -> Callable[[], object]:
                return lambda: jvp_columns(net, params, two, tangents, forward_mode)

            vectorized = _first_working("per-example products", jacobians, errors, give_up=RANDOM_OPERATION)
            if vectorized is None:
                if RANDOM_OPERATION in str(errors[-1][2]):  # a random network (functional dropout): no route makes
                    return Autodiff()  # it a function of its input; refused by the callers' own checks, which name it
                continue
            forward_mode = _first_working("Jacobian-vector products", pushes, errors)
            if forward_mode is None:
                continue
            return Autodiff(kernels, forward_mode, vectorized)
    what, fn, error = errors[-1]
    with differentiable_kernels(True):
        where = culprit(net, fn)
    module = f"module '{where}' ({type(net.get_submodule(where)).__name__})" if where else "the network's forward"
    raise ValueError(
        f"net cannot be differentiated by ntkgp: {what} fail in {module} with every route tried (forward mode, "
        f"reverse over reverse, per example, math attention kernels): {type(error).__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''}. Replace that module by one built from differentiable "
        "torch operations."
    ) from error
