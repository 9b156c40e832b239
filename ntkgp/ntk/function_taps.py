"""Torch-function modes scoped to one module's forward on ntkgp's private copy of a network: how the feature pass
records quantities that no forward hook sees (the projections inside ``nn.MultiheadAttention``,
:mod:`ntkgp.ntk.attention_features`; a free parameter added to the activations, :mod:`ntkgp.ntk.additive_features`).

:func:`attach_mode` makes the module's forward (an instance attribute of the copy, never of the user's module) run
under every ``TorchFunctionMode`` attached to it, innermost last, until the handles are removed (in any order); the
modes are entered and left with the forward, so an exception in it leaves none behind.
"""

from __future__ import annotations

import types
from contextlib import ExitStack

from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["attach_mode"]

_KEY = "_ntkgp_function_modes"


class ModeHandle:
    """Detaches one mode; the last one detached restores the module's forward."""

    def __init__(self, module: nn.Module, mode: TorchFunctionMode) -> None:
        self.module, self.mode = module, mode

    def remove(self) -> None:
        state = self.module.__dict__.get(_KEY)
        if state is None or self.mode not in state["modes"]:
            return
        state["modes"].remove(self.mode)
        if not state["modes"]:
            del self.module.__dict__[_KEY]
            if state["saved"] is None:
                self.module.__dict__.pop("forward", None)
            else:
                self.module.__dict__["forward"] = state["saved"]


def attach_mode(module: nn.Module, mode: TorchFunctionMode) -> ModeHandle:
    """Run ``module``'s forward (ntkgp's private copy) under ``mode`` until the handle is removed (module
    docstring)."""
    state = module.__dict__.get(_KEY)
    if state is None:
        saved = module.__dict__.get("forward")  # a forward bound to the copy as an instance attribute, if any
        state = {"modes": [], "saved": saved}
        module.__dict__[_KEY] = state
        forward = saved if saved is not None else types.MethodType(type(module).forward, module)

        def under_modes(*args, **kwargs):
            with ExitStack() as stack:
                for active in list(state["modes"]):
                    stack.enter_context(active)
                return forward(*args, **kwargs)

        module.__dict__["forward"] = under_modes
    state["modes"].append(mode)
    return ModeHandle(module, mode)
