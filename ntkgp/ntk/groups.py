"""Parameter groups: which prior precision δ_g each trainable parameter of a network carries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

GroupSpec = str | Mapping[str, str]


@dataclass(frozen=True)
class ParameterGroups:
    """The trainable parameters of a network, partitioned into prior-precision groups.

    Attributes:
        names: parameter names (as in ``net.named_parameters()``), trainable ones only.
        shapes: their shapes.
        group_of: for each parameter, the index of its group.
        group_names: one label per group, in index order.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    group_of: tuple[int, ...]
    group_names: tuple[str, ...]

    @property
    def num_groups(self) -> int:
        return len(self.group_names)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)

    @property
    def num_params(self) -> int:
        return sum(self.numels)

    def column_groups(self, device: torch.device | None = None) -> torch.Tensor:
        """Group index of every column of the flattened Jacobian, shape ``(P,)``."""
        return torch.repeat_interleave(
            torch.tensor(self.group_of, device=device), torch.tensor(self.numels, device=device)
        )

    def group_sizes(self) -> torch.Tensor:
        """Number of parameters in each group, shape ``(G,)``."""
        sizes = torch.zeros(self.num_groups, dtype=torch.long)
        for g, n in zip(self.group_of, self.numels):
            sizes[g] += n
        return sizes


def resolve_groups(net: nn.Module, groups: GroupSpec = "layer") -> ParameterGroups:
    """Partition the trainable parameters of ``net`` into prior-precision groups.

    Args:
        net: the network; parameters with ``requires_grad=False`` are excluded.
        groups: ``"network"`` (one group), ``"layer"`` (one group per module that owns
            parameters, the default), ``"parameter"`` (one group per parameter tensor, as
            laplace-torch's per-layer prior precision), or a mapping from every trainable
            parameter name to a group label.
    """
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("net has no trainable parameters (all have requires_grad=False)")
    names = tuple(n for n, _ in named)
    if isinstance(groups, Mapping):
        missing = [n for n in names if n not in groups]
        unknown = [n for n in groups if n not in names]
        if missing or unknown:
            raise ValueError(
                f"groups mapping must name every trainable parameter exactly: missing {missing}, "
                f"unknown {unknown}"
            )
        labels = [str(groups[n]) for n in names]
    elif groups == "network":
        labels = ["network"] * len(names)
    elif groups == "layer":
        labels = [n.rpartition(".")[0] or n for n in names]
    elif groups == "parameter":
        labels = list(names)
    else:
        raise ValueError(
            f"groups must be 'network', 'layer', 'parameter' or a mapping of parameter names, got {groups!r}"
        )
    group_names = tuple(dict.fromkeys(labels))
    index = {g: i for i, g in enumerate(group_names)}
    return ParameterGroups(
        names=names,
        shapes=tuple(p.shape for _, p in named),
        group_of=tuple(index[label] for label in labels),
        group_names=group_names,
    )
