"""``load_state_dict`` that refuses before anything is copied.

``torch.nn.Module.load_state_dict`` copies every tensor whose key and shape fit, and only then raises about the
others (a shape mismatch, a missing or unexpected key, a value that is not a tensor): a refused load leaves a
mixture of two models (for `NTKGP`, the noise of one and the prior precision of the other). The models of ntkgp
(`NTKGP`, `SFR`, `FSVI`) check the whole state dict first and raise the same ``RuntimeError`` naming every
problem **before any tensor is copied**, so that a refused load leaves the model exactly as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["CheckedLoad", "load_problems"]


def load_problems(module: nn.Module, state_dict: Mapping[str, object], strict: bool,
                  exempt: tuple[str, ...] = ()) -> list[str]:
    """What ``module.load_state_dict(state_dict, strict)`` would refuse, in torch's wording: values that are not
    tensors or whose shapes differ from the module's, and, with ``strict``, missing and unexpected keys.

    Args:
        exempt: top-level keys whose shape may legitimately differ (data the module stores, checked by itself).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    own = module.state_dict(keep_vars=True)
    problems = []
    for key, value in state_dict.items():
        if key not in own or key in exempt:
            continue
        if not torch.is_tensor(value):
            problems.append(f"While copying the parameter named {key!r}, expected torch.Tensor from checkpoint "
                            f"but received {type(value).__name__}")
        elif value.shape != own[key].shape:
            problems.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                            f"checkpoint, the shape in current model is {tuple(own[key].shape)}")
    if strict:  # a submodule may accept a state dict without its extra state (saved before it had one)
        optional = {f"{name}._extra_state".lstrip(".") for name, sub in module.named_modules()
                    if getattr(sub, "EXTRA_STATE_OPTIONAL", False)}
        missing = [key for key in own if key not in state_dict and key not in optional]
        unexpected = [key for key in state_dict if key not in own]
        if missing:
            problems.append(f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}")
        if unexpected:
            problems.append(f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}")
    return problems


class CheckedLoad:
    """Mixin for an ``nn.Module``: :meth:`load_state_dict` checked in full before anything is copied.

    ``STATE_KEYS`` are the top-level entries the class adds to its state dict beside parameters and buffers
    (data whose shape may differ between two models of the same kind; the class checks them itself).
    """

    STATE_KEYS: tuple[str, ...] = ()

    def load_state_dict(self, state_dict: Mapping[str, object], strict: bool = True, assign: bool = False):
        """``torch.nn.Module.load_state_dict``, checked in full first: a tensor whose shape differs from this
        model's (the state of another network, another number of inducing points, another prior structure), a
        value that is not a tensor and, with ``strict``, a missing or unexpected key raise ``RuntimeError``
        naming them **before anything is copied** (torch's own check copies every tensor that fits, then raises
        about the others, and would leave a mixture of two models)."""
        problems = load_problems(self, state_dict, strict, self.STATE_KEYS)
        if problems:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__} (nothing was loaded):\n\t"
                               + "\n\t".join(problems))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)
