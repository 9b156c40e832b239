r"""A free parameter added to the activations (a learned positional embedding, a bias held outside any layer): its
per-example gradient is the output gradient at the sum, from the feature pass's own backward passes.

For :math:`z_n = h_n + p` (``p`` broadcast over the batch and any dimensions it lacks),

.. math::
    J_n^\top u_{nm} \big|_p = \operatorname{sum\_to\_size}(\Gamma_{nm}, p), \qquad
    \Gamma_{nm} = \partial (u_{nm}^\top f_n) / \partial z_n,

so the curvature passes (KFAC's exact diagonal part, the diagonal GGN) and the NTK need no per-example backward
pass for ``p``: :math:`|p|` numbers per example and column. The sum is found during the pass by a
``TorchFunctionMode`` scoped to the forward of the module that owns ``p`` (on ntkgp's private copy,
:func:`~ntkgp.ntk.function_taps.attach_mode`): an ``add`` (``h + p``, ``p + h``, ``torch.add`` without ``alpha``)
one of whose operands is ``p`` itself, whose output has the batch as its first dimension and to which ``p``
broadcasts without a batch dimension of its own (absent or of size 1). A parameter added at several places sums
its calls (:attr:`~ntkgp.ntk.features.Layer.repeated`); one used otherwise (sliced, scaled, added in place, also
used elsewhere) fails the layer plan's check against autograd on the probe
(:func:`~ntkgp.ntk.layer_plan.verify_layers`) and keeps the generic route. Cost of the recording: a Python call per
torch function in the owner's forward (for a parameter of the root module, every operation of the forward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .function_taps import attach_mode
from .norm_features import ElementwiseLayer

__all__ = ["AdditiveParameter", "ParameterOwner", "additive_candidates"]

_ADDS = {torch.Tensor.add, torch.add, torch.Tensor.__add__, torch.Tensor.__radd__}


def _broadcast_over_batch(p: Tensor, out: Tensor) -> bool:
    """Whether ``p`` broadcasts to ``out`` ``(n, ...)`` without a batch dimension of its own (size 1 or absent)."""
    if out.dim() < max(p.dim(), 1) or (p.dim() == out.dim() and p.shape[0] != 1):
        return False
    try:
        return tuple(torch.broadcast_shapes(p.shape, out.shape)) == tuple(out.shape)
    except RuntimeError:
        return False


class _AddTap(TorchFunctionMode):
    """Records ``(h, z)`` for each ``z = h + p`` with ``p`` the owner's attribute as the forward sees it (swapped by
    ``functional_call``)."""

    def __init__(self, owner: nn.Module, attribute: str, recorder: Callable) -> None:
        super().__init__()
        self.owner, self.attribute, self.recorder = owner, attribute, recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ADDS and len(args) == 2 and not kwargs:
            p = getattr(self.owner, self.attribute, None)
            first, second = args
            other = second if first is p else first if second is p else None
            if p is not None and torch.is_tensor(other) and torch.is_tensor(out) and _broadcast_over_batch(p, out):
                self.recorder(self.owner, (out,), out)
        return out


class ParameterOwner:
    """The module that owns a free parameter, seen as a layer whose ``weight`` is that parameter (``bias``: ``None``),
    as the layer machinery reads ``layer.module``; equal for the same module and attribute."""

    __slots__ = ("attribute", "owner")

    def __init__(self, owner: nn.Module, attribute: str) -> None:
        self.owner, self.attribute = owner, attribute

    @property
    def weight(self) -> Tensor:
        return getattr(self.owner, self.attribute)

    bias = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParameterOwner) and other.owner is self.owner and other.attribute == self.attribute

    def __hash__(self) -> int:
        return hash((id(self.owner), self.attribute))


@dataclass(frozen=True)
class AdditiveParameter(ElementwiseLayer):
    r"""A parameter ``weight`` (the layer's name too; ``module`` its :class:`ParameterOwner`) added to the activations
    (module docstring). Recorded "inputs": the sum :math:`z` (only its batch size is used); gradients: the
    per-example gradients :math:`\operatorname{sum\_to\_size}(\Gamma_n, p)` as ``(n, |p|, 1)``."""

    @property
    def attribute(self) -> str:
        """The parameter's attribute on its module (the last part of its name)."""
        return self.name.rpartition(".")[2]

    @property
    def fan_in(self) -> int:
        return 0

    @property
    def d_out(self) -> int:
        return self.module.weight.numel()

    def attach(self, net: nn.Module, recorder: Callable):
        owner = net.get_submodule(self.name.rpartition(".")[0])
        return attach_mode(owner, _AddTap(owner, self.attribute, recorder))

    def takes(self, inputs: object, n: int) -> bool:
        return torch.is_tensor(inputs) and inputs.dim() >= 2 and inputs.shape[0] == n

    def recorded_inputs(self, inputs: Tensor) -> Tensor:
        """No input feature: an empty ``(n, 0, 1)``."""
        return inputs.new_zeros(inputs.shape[0], 0, 1)

    def recorded_gradients(self, grads: Tensor) -> Tensor:
        r""":math:`\operatorname{sum\_to\_size}(\Gamma_n, p)` ``(n, |p|, 1)`` from the gradient at the sum."""
        shape = tuple(self.module.weight.shape)
        padded = (1,) * (grads.dim() - len(shape)) + shape  # p's shape as broadcast to the sum's, batch first
        n = grads.shape[0]
        return grads.sum_to_size(n, *padded[1:]).reshape(n, -1, 1)

    def jacobians(self, inputs: Tensor, grads: Tensor) -> dict[str, Tensor]:
        """Per-example rows ``{weight: (n, M, |p|)}`` for gradients ``(n, M, |p|, T)`` (``T`` calls summed)."""
        return {self.weight: grads.sum(dim=-1)}


def additive_candidates(net: nn.Module, names: Sequence[str], exclude: set[str] = frozenset()
                        ) -> list[AdditiveParameter]:
    """Every parameter in ``names`` and not in ``exclude`` owned directly by a module other than the layer types
    with routes of their own (``nn.Linear``, ``nn.Conv2d``, normalization layers, ``nn.Embedding``,
    ``nn.MultiheadAttention``, recurrent layers) and by no other module: a candidate for the additive route, to be
    verified on a probe."""
    from .norm_features import NORM_TYPES

    skip = (nn.Linear, nn.Conv2d, nn.Embedding, nn.MultiheadAttention, nn.RNNBase, *NORM_TYPES)
    chosen = set(names) - set(exclude)
    owners: dict[int, int] = {}
    for module in net.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    out = []
    for name, module in net.named_modules():
        if isinstance(module, skip):
            continue
        prefix = f"{name}." if name else ""
        for attribute, p in module._parameters.items():
            if p is not None and prefix + attribute in chosen and owners[id(p)] == 1:
                out.append(AdditiveParameter(prefix + attribute, ParameterOwner(module, attribute), prefix + attribute, None))
    return out
