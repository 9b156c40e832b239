r"""Regression metrics: the Gaussian negative log predictive density and the root mean squared error."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .checks import _finite, _match_shape, _outputs

__all__ = ["gaussian_nlpd", "rmse"]


def gaussian_nlpd(mean: Tensor, var: Tensor, y: Tensor, y_scale: float | Tensor = 1.0) -> float:
    r"""Mean negative log predictive density of independent Gaussian predictives.

    .. math::
        \mathrm{NLPD} = \frac{1}{N} \sum_{n=1}^N \sum_{c=1}^C
            \Big[\tfrac12 \log(2\pi \sigma^2_{nc}) + \frac{(y_{nc} - \mu_{nc})^2}{2\sigma^2_{nc}}
            + \log s_c\Big]

    Args:
        mean: predictive means :math:`\mu`, shape ``(N,)`` or ``(N, C)``.
        var: predictive variances :math:`\sigma^2` of ``y`` (observation noise included), the same shape as
            ``mean`` (``(N,)`` and ``(N, 1)`` are interchangeable).
        y: targets, the same shape as ``mean`` (``(N,)`` and ``(N, 1)`` are interchangeable).
        y_scale: :math:`s`, the standard deviation used to normalise the targets, a positive real scalar or a
            ``(C,)`` tensor (:math:`C = 1` for ``(N,)`` inputs).
            When ``mean``, ``var`` and ``y`` are in normalised units,
            :math:`y_\text{orig} = s\,y + m`, the result is the NLPD in the original units.

    Returns:
        The NLPD per example (summed over the ``C`` outputs, averaged over the ``N`` examples).

    Raises:
        TypeError: if an input is not a tensor, or ``y_scale`` is neither a real number nor a tensor.
        ValueError: naming the argument, for non-finite values, a non-positive ``var`` or ``y_scale``, a
            ``y_scale`` that is not a scalar or ``(C,)``, or a ``var`` or ``y`` whose shape differs from
            ``mean``'s.

    Example:
        >>> round(gaussian_nlpd(torch.zeros(2), torch.ones(2), torch.zeros(2)), 6)  # ½ log 2π
        0.918939
    """
    mean = _outputs(_finite(mean, "mean"), "mean")
    y = _match_shape(_finite(y, "y"), mean, "y")
    var = _match_shape(_finite(var, "var"), mean, "var")
    if (var <= 0).any():
        raise ValueError("var must be strictly positive")
    num_outputs = mean.shape[1] if mean.dim() == 2 else 1
    if isinstance(y_scale, bool) or not (isinstance(y_scale, numbers.Real) or torch.is_tensor(y_scale)):
        raise TypeError(f"y_scale must be a real number or a tensor, got {type(y_scale).__name__}")
    scale = torch.as_tensor(y_scale)
    if scale.dim() > 1 or (scale.dim() == 1 and scale.shape[0] != num_outputs):
        raise ValueError(f"y_scale must be a scalar or have shape ({num_outputs},) (one per output), "
                         f"got shape {tuple(scale.shape)}")
    if scale.dtype == torch.bool or scale.is_complex() or not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"y_scale must be positive and finite, got {y_scale!r}")
    per_entry = 0.5 * torch.log(2 * math.pi * var) + 0.5 * (y - mean) ** 2 / var
    scale = scale.to(dtype=per_entry.dtype, device=per_entry.device)
    per_entry = per_entry + torch.log(scale if per_entry.dim() == 2 else scale.reshape(()))
    if per_entry.dim() == 2:
        per_entry = per_entry.sum(dim=-1)
    return per_entry.mean().item()


def rmse(pred: Tensor, y: Tensor) -> float:
    r"""Root mean squared error over all entries.

    .. math:: \mathrm{RMSE} = \Big(\frac{1}{NC} \sum_{n,c} (\hat y_{nc} - y_{nc})^2\Big)^{1/2}

    Args:
        pred: predictions, ``(N,)`` or ``(N, C)``.
        y: targets, the same shape as ``pred`` (``(N,)`` and ``(N, 1)`` are interchangeable).

    Returns:
        The RMSE.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: naming the argument, for non-finite values, or a ``y`` whose shape differs from ``pred``'s.

    Example:
        >>> rmse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
        1.4142135381698608
    """
    pred = _outputs(_finite(pred, "pred"), "pred")
    y = _match_shape(_finite(y, "y"), pred, "y")
    return torch.sqrt(((pred - y) ** 2).mean()).item()
