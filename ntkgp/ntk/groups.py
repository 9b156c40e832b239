"""Parameter groups: which prior precision δ_g each trainable parameter of a network carries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..options import PriorStructure, choose
from ..validation import exact_names

#: A grouping of the parameters: a :class:`~ntkgp.options.PriorStructure` string or a mapping name → group.
GroupSpec = str | Mapping[str, str]
#: What ``prior_structure=`` accepts: ``"network"``, ``"layer"``, ``"parameter"`` or a mapping name → group.
PriorStructureSpec = GroupSpec


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
        sizes = [0] * self.num_groups
        for g, n in zip(self.group_of, self.numels):
            sizes[g] += n
        return torch.tensor(sizes, dtype=torch.long)


def resolve_groups(
    net: nn.Module, prior_structure: GroupSpec = "layer", names: Sequence[str] | None = None
) -> ParameterGroups:
    """Partition the trainable parameters of ``net`` (or the parameters ``names``) into prior-precision groups.

    Args:
        net: the network.
        prior_structure: ``"network"`` (one group; laplace-torch's ``"scalar"``),
            ``"layer"`` (one group per module that owns parameters, the default; laplace-torch's
            ``"layerwise"``), ``"parameter"`` (one group per parameter tensor, as laplace-torch's per-layer
            prior precision), or a mapping from every parameter name to a group label.
        names: the parameters, in this order (distinct parameters of ``net``); by default every parameter
            with ``requires_grad=True``.

    Returns:
        The :class:`ParameterGroups`.

    Raises:
        ValueError: for an unknown structure, a mapping that does not name every parameter exactly, a
            network without trainable parameters, or ``names`` that are not distinct parameters of ``net``.
    """
    if names is None:
        named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("net has no trainable parameters (all have requires_grad=False)")
    else:
        every = dict(net.named_parameters())
        names = list(names)
        unknown = [n for n in names if n not in every]
        if unknown or not names or len(set(names)) != len(names):
            raise ValueError(
                f"names must list distinct parameters of net (at least one); unknown {unknown}, got {names}"
            )
        named = [(n, every[n]) for n in names]
    names = tuple(n for n, _ in named)
    if isinstance(prior_structure, Mapping):
        exact_names(prior_structure, names, "prior_structure mapping")
        labels = [str(prior_structure[n]) for n in names]
    else:
        structure = choose(PriorStructure, prior_structure, "prior_structure")
        if structure is PriorStructure.NETWORK:
            labels = ["network"] * len(names)
        elif structure is PriorStructure.LAYER:
            labels = [n.rpartition(".")[0] or n for n in names]
        else:
            labels = list(names)
    group_names = tuple(dict.fromkeys(labels))
    index = {g: i for i, g in enumerate(group_names)}
    return ParameterGroups(
        names=names,
        shapes=tuple(p.shape for _, p in named),
        group_of=tuple(index[label] for label in labels),
        group_names=group_names,
    )
