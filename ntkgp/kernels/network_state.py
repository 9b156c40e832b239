"""The network state a kernel's or a mean's cached results depend on, with a guard on the set of trainable parameters;
the error for a random network.

The prior-precision groups, the Jacobian's columns and the shape of :math:`\\delta` are fixed when the object is
built, from the parameters that require grad then. Freezing or unfreezing a parameter afterwards
(``requires_grad_``) would change what a freshly built object computes (its Jacobian drops or gains columns and
:math:`\\delta` its groups), which no cached or recomputed result can follow: it is refused.
"""

from __future__ import annotations

import torch

from ..ntk import NTKEngine
from ..ntk.network import walk

__all__ = ["RANDOM_NETWORK", "RandomNetworkError", "TrainableParametersChanged", "network_state"]

#: Why a random network is refused, and what to do.
RANDOM_NETWORK = (
    "net is random: its forward pass draws random numbers (functional dropout such as "
    "torch.nn.functional.dropout(x, training=True), or another random operation that eval mode does not switch "
    "off), so its Jacobian, and the NTK, are not defined. Make forward deterministic in eval mode (use "
    "torch.nn.Dropout modules, which net.eval() switches off)"
)


class TrainableParametersChanged(RuntimeError):
    """The network's trainable parameters are no longer those the object was built with."""


class RandomNetworkError(ValueError):
    """The network's outputs are random (:data:`RANDOM_NETWORK`)."""


def network_state(engine: NTKEngine, owner: str) -> list[torch.Tensor]:
    """:meth:`NTKEngine.network_state`, after checking that the trainable parameters are still those of ``engine``.

    Raises:
        TrainableParametersChanged: naming the parameters frozen or unfrozen since ``owner`` was built.
    """
    walked = walk(engine.net)  # one walk of the modules, for the check and the state
    now = [name for name, p in walked.parameters.items() if p.requires_grad]
    built = list(engine.groups.names)
    if now != built:
        frozen = [n for n in built if n not in now]
        unfrozen = [n for n in now if n not in built]
        raise TrainableParametersChanged(
            f"the trainable parameters of net changed since this {owner} was built (frozen: {frozen}, unfrozen: "
            f"{unfrozen}); its parameter groups, Jacobian columns and prior precisions belong to the old set: "
            f"build a new {owner}"
        )
    return engine.core.network_state(walked)
