"""Training data given where tensors (or an iterable of ``(x, y)`` batches) are expected, refused by name when it is
neither: an array, or a list of numbers, would otherwise be taken for an iterable of batches and refused later for
the wrong reason ("train_y must be None when train_x is a DataLoader"; docs/guarantees.md, "Errors")."""

from __future__ import annotations

from torch import Tensor
from torch.utils import _pytree as pytree

from .checks import check_not_array

__all__ = ["check_data"]


def check_data(x: object, argument: str) -> None:
    """Raise ``TypeError`` naming ``argument`` unless ``x`` is a tensor, a container of tensors or another iterable
    (a loader): an array (:func:`~ntkgp.ntk.checks.check_not_array`), or a list, tuple or dict that holds something
    other than tensors (a nested list of numbers, ``(x, y)`` pairs of arrays). Containers of tensors (a list of
    ``(x, y)`` batches, a dict of input tensors) and loaders pass: their own checks follow."""
    check_not_array(x, argument)
    if isinstance(x, list | tuple | dict):
        other = next(((path, leaf) for path, leaf in pytree.tree_flatten_with_path(x)[0]
                      if not isinstance(leaf, Tensor)), None)
        if other is not None:
            path, leaf = other
            raise TypeError(f"{argument} must be a torch.Tensor, a dict/tuple of tensors or an iterable of (x, y) "
                            f"batches of tensors, got a {type(x).__name__} holding {type(leaf).__name__} "
                            f"({argument}{pytree.keystr(path)} must be a torch.Tensor, got {type(leaf).__name__}): "
                            "convert it with torch.as_tensor")
