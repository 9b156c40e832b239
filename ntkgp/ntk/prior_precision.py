r"""The one check of the prior precisions :math:`\delta` (one per parameter group): weight-space curvatures and
posteriors, FSVI."""

from __future__ import annotations

import torch
from torch import Tensor

from .groups import ParameterGroups


def prior_precision_vector(
    value: float | Tensor, groups: ParameterGroups, dtype: torch.dtype, device: torch.device, keep_graph: bool
) -> Tensor:
    r"""``value`` as a ``(G,)`` tensor of positive, finite prior precisions (a scalar is shared by all groups).

    Args:
        value: a number, a numpy number or array, a list or a tensor.
        groups: the prior-precision groups (their number and names for the error).
        dtype, device: of the result (a float is converted straight to ``dtype``, not through float32).
        keep_graph: keep a tensor's graph (an evidence differentiated in :math:`\delta`); otherwise the result is
            a detached copy that later changes of the caller's object cannot reach (a posterior's state).

    Raises:
        TypeError: for a bool, a string, a non-number or a complex or bool dtype, naming ``prior_precision``.
        ValueError: for a wrong shape or a non-positive or non-finite value, naming ``prior_precision``.
    """
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"prior_precision must be a number or a tensor, got {type(value).__name__}")
    source = value if torch.is_tensor(value) and keep_graph else (value.detach() if torch.is_tensor(value) else value)
    try:
        kind = source.dtype if torch.is_tensor(source) else torch.as_tensor(source).dtype
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"prior_precision must be a number or a tensor, got {type(value).__name__}") from error
    if kind == torch.bool or kind.is_complex:  # numpy's bools and complex numbers too
        raise TypeError(f"prior_precision must hold real numbers, got dtype {kind}")
    if torch.is_tensor(source):
        delta = source.to(device=device, dtype=dtype)
    else:
        delta = torch.as_tensor(source, dtype=dtype, device=device)
    if not keep_graph:  # as_tensor and .to may share the caller's memory
        delta = delta.clone()
    if delta.dim() == 0:
        delta = delta.expand(groups.num_groups)
        delta = delta if keep_graph else delta.clone()
    if delta.shape != (groups.num_groups,):
        raise ValueError(
            f"prior_precision must be a scalar or have shape ({groups.num_groups},) (one per group "
            f"{list(groups.group_names)}), got shape {tuple(delta.shape)}"
        )
    values = delta.detach()
    if not bool(torch.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"prior_precision must be positive and finite, got {values.tolist()}")
    return delta
