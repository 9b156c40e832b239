"""The checks every metric makes of its inputs: tensors, finite values, shapes, probabilities and labels."""

from __future__ import annotations

import torch
from torch import Tensor

_PROB_TOLERANCE = 1e-6
"""Probabilities within this distance of :math:`[0, 1]` are clipped to it, not refused."""


def _finite(value: object, name: str) -> Tensor:
    """Check that ``value`` is a non-empty tensor of finite numbers; return it."""
    if not torch.is_tensor(value):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds shapes but no values to score")
    if value.numel() == 0:
        raise ValueError(f"{name} is empty")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        count = int((~torch.isfinite(value)).sum())
        raise ValueError(f"{name} contains {count} NaN or infinite value(s)")
    return value


def _is_column(shape: torch.Size) -> bool:
    """Whether ``shape`` is ``(N,)`` or ``(N, 1)``."""
    return len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)


def _match_shape(y: Tensor, reference: Tensor, name: str) -> Tensor:
    """Return ``y`` in ``reference.shape``; only ``(N,)`` and ``(N, 1)`` are interchangeable.

    Any other difference (a transposed ``(C, N)``, a flattened ``(N·C,)``, a broadcastable shape) raises
    ``ValueError`` naming ``name``, even when the numbers of entries agree.
    """
    if y.shape == reference.shape:
        return y
    if _is_column(y.shape) and _is_column(reference.shape) and y.shape[0] == reference.shape[0]:
        return y.reshape(reference.shape)
    raise ValueError(f"{name} has shape {tuple(y.shape)}, incompatible with {tuple(reference.shape)} "
                     "(only (N,) and (N, 1) are interchangeable)")


def _outputs(value: Tensor, name: str) -> Tensor:
    """Check that ``value`` has shape ``(N,)`` or ``(N, C)``; return it."""
    if value.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape (N,) or (N, C), got {tuple(value.shape)}")
    return value


def _class_probs(probs: Tensor) -> Tensor:
    """Return probabilities in ``(N, C)`` form; binary ``(N,)`` / ``(N, 1)`` becomes ``[1 - p, p]``."""
    _finite(probs, "probs")
    if not probs.is_floating_point():
        raise TypeError(f"probs must be floating point, got {probs.dtype}")
    if bool(((probs < -_PROB_TOLERANCE) | (probs > 1 + _PROB_TOLERANCE)).any()):
        raise ValueError("probs must lie in [0, 1] (pass probabilities, not logits)")
    probs = probs.clamp(0.0, 1.0)
    if probs.dim() == 1 or (probs.dim() == 2 and probs.shape[1] == 1):
        p1 = probs.reshape(-1)
        return torch.stack([1.0 - p1, p1], dim=-1)
    if probs.dim() != 2:
        raise ValueError(f"probs must have shape (N,), (N, 1) or (N, C); got {tuple(probs.shape)}")
    # rows sum to one within sqrt(eps) of the dtype, never tighter than float32's (float32 probabilities cast up)
    tolerance = max(torch.finfo(probs.dtype).eps, torch.finfo(torch.float32).eps) ** 0.5
    sums = probs.double().sum(dim=1)
    if bool(((sums - 1).abs() > tolerance).any()):
        row = int((sums - 1).abs().argmax())
        raise ValueError(f"probs rows must sum to 1 (within {tolerance:.1e} for {probs.dtype}); row {row} sums to "
                         f"{float(sums[row]):.6g}. Pass probabilities, not scores; probabilities rounded in a lower "
                         "precision keep its tolerance in their own dtype, or renormalize: p / p.sum(-1, keepdim=True)")
    return probs


def _labels(y: Tensor, num_examples: int, num_classes: int) -> Tensor:
    """Return integer labels of shape ``(N,)`` (from ``(N,)`` or ``(N, 1)``), whole numbers in ``0..num_classes-1``."""
    _finite(y, "y")
    if not _is_column(y.shape):
        raise ValueError(f"y must have shape (N,) or (N, 1), got {tuple(y.shape)}")
    y = y.reshape(-1)
    if y.numel() != num_examples:
        raise ValueError(f"y has {y.numel()} entries but probs has {num_examples} rows")
    if y.is_complex() or (y.is_floating_point() and not bool((y == torch.round(y)).all())):
        raise ValueError("y must hold integer class labels")
    if bool(((y < 0) | (y >= num_classes)).any()):
        raise ValueError(f"y must hold class labels in 0..{num_classes - 1}, found {torch.unique(y).tolist()[:5]}")
    return y.long()

