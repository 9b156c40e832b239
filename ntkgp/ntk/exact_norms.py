r"""Normalizations by the statistics of their own input, computed from elementary operations in the ``torch.func``
passes whose results keep an autograd graph (:mod:`ntkgp.ntk.functional`): their derivatives are then exact.

**Why.** ``torch.func``'s rules for ``aten::native_layer_norm`` give :math:`\gamma`'s part of a batched
vector-Jacobian product (``vmap`` over examples or cotangents: ``vmap(jacrev)``, ``vmap(vjp)``) as
:math:`\sum g \odot (x - \mu)\,r` and its Jacobian-vector product (forward mode) as :math:`\hat x \odot \dot\gamma`,
from the mean :math:`\mu` and inverse deviation :math:`r` that the forward kernel saved; those are
non-differentiable outputs of the kernel. The values are right, but ordinary autograd differentiating them again
(:math:`\partial/\partial x` of a Jacobian, of a Gram, of a product; or :math:`\partial/\partial\theta` of one, as
FSVI does) holds :math:`\mu` and :math:`r` constant and drops :math:`\partial\mu/\partial x` and
:math:`\partial r/\partial x`: a silently wrong gradient (torch 2.13; found by comparing with per-example
Jacobians from ordinary autograd loops and with finite differences, ``tests/ntk/test_layernorm_input_gradients.py``).
``aten::native_batch_norm`` with the statistics of its input (``F.instance_norm`` without running statistics, which
is ``nn.InstanceNorm``'s default, and ``F.batch_norm`` with ``training=True``) has the same fault. ``nn.GroupNorm``
(torch falls back to its composite form under ``torch.func``), a BatchNorm with running statistics (constants) and
``nn.RMSNorm`` are exact; the feature pass's own reverse passes (:mod:`ntkgp.ntk.features`) are exact for all.

**What.** :func:`exact_norms` runs a block under a ``TorchFunctionMode`` (thread-local) that computes
``F.layer_norm`` / ``torch.layer_norm`` / ``torch.native_layer_norm``, ``F.instance_norm`` / ``torch.instance_norm``
with the input's statistics, ``F.batch_norm`` / ``torch.batch_norm`` with ``training=True`` and ``F.rms_norm`` /
``torch.rms_norm`` (whose fused kernels some devices take) from means, differences and ``rsqrt``, whose batching,
forward-mode and double-backward rules are exact:

.. math::
    \mu = \tfrac{1}{m}\textstyle\sum_i x_i, \qquad \sigma^2 = \tfrac{1}{m}\sum_i (x_i - \mu)^2, \qquad
    y = (x - \mu)\,(\sigma^2 + \epsilon)^{-1/2} \odot \gamma + \beta

over the normalized entries (the trailing ``normalized_shape`` for a layer norm, the locations of one example and
channel for an instance norm, the examples and locations of a channel for a batch norm); :math:`y = x\,(\tfrac1m
\sum_i x_i^2 + \epsilon)^{-1/2} \odot \gamma` for an RMS norm. The values equal the kernels' up to rounding. A
normalization that would also update running statistics (``F.batch_norm`` in training mode, ``F.instance_norm``
with ``use_input_stats`` and running statistics), or ``torch.native_batch_norm`` with the input's statistics
called directly, raises ``NotImplementedError`` in such a pass rather than give a wrong derivative. The passes
without a graph (:func:`keeps_graph` false: nothing requires grad) keep torch's fused kernels.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["exact_norms", "keeps_graph"]


def keeps_graph(*trees) -> bool:
    """Whether a pass on these inputs and parameters (tensors or containers of tensors) keeps an autograd graph:
    grad mode is on and one of their tensors requires grad."""
    return torch.is_grad_enabled() and any(
        torch.is_tensor(t) and t.requires_grad for tree in trees for t in pytree.tree_leaves(tree))


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, shape: Sequence[int]) -> Tensor:
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def _normalized(x: Tensor, dims: tuple[int, ...], eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """:math:`(x - \\mu) r`, :math:`\\mu` and :math:`r = (\\sigma^2 + \\epsilon)^{-1/2}` over ``dims`` (kept)."""
    mean = x.mean(dim=dims, keepdim=True)
    centred = x - mean
    rstd = torch.rsqrt(centred.square().mean(dim=dims, keepdim=True) + eps)
    return centred * rstd, mean, rstd


def _trailing(normalized_shape) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def layer_norm(a: dict) -> tuple[Tensor, Tensor, Tensor]:
    """A layer norm from elementary operations (module docstring): the output, :math:`\\mu` and :math:`r`."""
    shape = _trailing(a["normalized_shape"])
    y, mean, rstd = _normalized(a["input"], tuple(range(-len(shape), 0)), a["eps"])
    return _affine(y, a["weight"], a["bias"], shape), mean, rstd


def rms_norm(a: dict) -> Tensor:
    """An RMS norm from elementary operations (module docstring); ``eps=None``: the dtype's machine epsilon, as
    torch."""
    x, shape = a["input"], _trailing(a["normalized_shape"])
    eps = torch.finfo(x.dtype).eps if a["eps"] is None else a["eps"]
    y = x * torch.rsqrt(x.square().mean(dim=tuple(range(-len(shape), 0)), keepdim=True) + eps)
    return _affine(y, a["weight"], None, shape)


def _refuse(what: str) -> None:
    raise NotImplementedError(
        f"{what} updates running statistics or normalizes by the statistics of its input through a kernel whose "
        "torch.func derivatives are not exact when differentiated again: ntkgp does not compute gradients with "
        "respect to inputs or parameters through it (put the network in eval mode with running statistics, or "
        "use nn.LayerNorm / nn.GroupNorm)")


def by_input_statistics(a: dict, use: bool, dims: tuple[int, ...], what: str) -> Tensor | None:
    """An instance or batch norm by its input's statistics over ``dims`` from elementary operations (``None``
    where it uses running statistics: torch's kernel is exact there); refused where it would update them."""
    if not use:
        return None
    if a["running_mean"] is not None or a["running_var"] is not None:
        _refuse(what)
    x = a["input"]
    y, _, _ = _normalized(x, dims, a["eps"])
    return _affine(y, a["weight"], a["bias"], (x.shape[1],) + (1,) * (x.dim() - 2))


#: The arguments of each function handled, in order (``torch.*``: the ATen signatures).
_ARGUMENTS = {
    F.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps"),
    torch.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"),
    torch.native_layer_norm: ("input", "normalized_shape", "weight", "bias", "eps"),
    F.rms_norm: ("input", "normalized_shape", "weight", "eps"),
    torch.rms_norm: ("input", "normalized_shape", "weight", "eps"),
    F.instance_norm: ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum",
                      "eps"),
    torch.instance_norm: ("input", "weight", "bias", "running_mean", "running_var", "use_input_stats", "momentum",
                          "eps", "cudnn_enabled"),
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    torch.batch_norm: ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
                       "cudnn_enabled"),
    torch.native_batch_norm: ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum",
                              "eps"),
}
_DEFAULTS = {"weight": None, "bias": None, "running_mean": None, "running_var": None, "use_input_stats": True,
             "training": False, "momentum": 0.1}


def _dispatch(func, args, kwargs):
    """The decomposed result of ``func(*args, **kwargs)``, or ``NotImplemented`` to run ``func`` itself."""
    names = _ARGUMENTS.get(func)
    if names is None:
        return NotImplemented
    eps = None if func in (F.rms_norm, torch.rms_norm) else 1e-5
    a = {**_DEFAULTS, "eps": eps, **dict(zip(names, args)), **kwargs}
    if func in (F.layer_norm, torch.layer_norm):
        return layer_norm(a)[0]
    if func is torch.native_layer_norm:
        return layer_norm(a)
    if func in (F.rms_norm, torch.rms_norm):
        return rms_norm(a)
    x = a["input"]
    if func in (F.instance_norm, torch.instance_norm):
        out = by_input_statistics(a, a["use_input_stats"], tuple(range(2, x.dim())), "an instance norm")
    elif func is torch.native_batch_norm:
        if a["training"]:
            _refuse("torch.native_batch_norm with the statistics of its input")
        out = None
    else:
        out = by_input_statistics(a, a["training"], (0, *range(2, x.dim())), "a batch norm in training mode")
    return NotImplemented if out is None else out


class _ExactNorms(TorchFunctionMode):
    """The mode of :func:`exact_norms`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _dispatch(func, args, kwargs)
        return func(*args, **kwargs) if out is NotImplemented else out


@contextmanager
def exact_norms(on: bool = True) -> Iterator[None]:
    """Normalizations from elementary operations while the block runs (``on``; module docstring)."""
    if not on:
        yield
        return
    with _ExactNorms():
        yield
