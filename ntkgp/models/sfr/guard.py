r"""What SFR's statistics were computed at, and the check that it still holds.

SFR's dual statistics are sums over the data of the network's outputs, Jacobians and likelihood derivatives at the
weights :math:`\theta^*` and the inducing inputs :math:`Z` of the pass over the data. If the network's weights
(trainable or frozen parameters, buffers) or :math:`Z` change afterwards, the model no longer describes the network,
and every call raises ``RuntimeError`` instead of mixing old statistics with new Jacobians.

The check has two parts:

* a **key** saved with the model's ``state_dict`` (the buffer ``sfr._state_key``): integer fingerprints
  (:func:`~ntkgp.caching.fingerprint`) of :meth:`~ntkgp.ntk.NTKEngine.network_state` and of :math:`Z` (in
  float64, so that ``sfr.double()`` does not change it). Loading a state dict loads the key of the statistics it
  holds, so statistics saved at other weights raise at the next call, as they must;
* **copies** of the weights and of :math:`Z`, kept in memory while they agree with the key (compared by value:
  the fingerprints' sums could, in principle, miss a permutation of entries; the copies cannot). After a load
  whose key differs from the copies', they are dropped, the key alone is checked, and copies are taken again
  at the first call whose network agrees with the loaded key.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...caching import fingerprint, same_values
from ...kernels.network_state import network_state
from ...ntk import NTKEngine

__all__ = ["StateGuard", "state_key"]

_WEIGHTS_CHANGED = (
    "the network's weights changed after this SFR model was built (trainable or frozen parameters, or buffers such "
    "as BatchNorm's running statistics), or a state_dict saved at other weights was loaded; its dual statistics "
    "were accumulated at other weights, so it no longer describes the network: build a new SFR (or restore the "
    "weights the statistics belong to)"
)
_INDUCING_CHANGED = (
    "sfr.inducing_points was modified in place (or a state_dict whose inducing_points differ from those of its "
    "statistics was loaded); the statistics belong to other inducing inputs: build a new SFR with inducing_points=..."
)


def state_key(engine: NTKEngine, inducing_points: Tensor, state: list[Tensor] | None = None) -> Tensor:
    """The fingerprints of the network's state (``state``, else :meth:`NTKEngine.network_state`) and of :math:`Z`
    (the last two entries), ``int64`` on the CPU."""
    state = engine.network_state() if state is None else state
    return torch.cat([fingerprint(state), fingerprint([inducing_points.detach().double()])])


class StateGuard:
    """The weights :math:`\\theta^*` and inducing inputs the statistics belong to (see the module docstring).

    Args:
        key: :func:`state_key` at construction (or as loaded).
        weights: copies of :meth:`~ntkgp.ntk.NTKEngine.network_state`, or ``None`` (not yet taken).
        inducing_points: a copy of :math:`Z`, or ``None``.
    """

    def __init__(self, key: Tensor, weights: tuple[Tensor, ...] | None, inducing_points: Tensor | None) -> None:
        self.key = key.detach().cpu().clone()
        self.weights = weights
        self.inducing_points = inducing_points

    @classmethod
    def of(cls, engine: NTKEngine, inducing_points: Tensor) -> StateGuard:
        """The guard of statistics computed now, at the network's current weights and ``inducing_points``."""
        weights = tuple(p.detach().clone() for p in engine.network_state())
        return cls(state_key(engine, inducing_points), weights, inducing_points.detach().clone())

    def loaded(self, key: Tensor) -> StateGuard:
        """The guard after ``load_state_dict`` brought ``key``: this one if the keys agree, else an unarmed one."""
        if torch.equal(key.detach().cpu(), self.key):
            return self
        return StateGuard(key, None, None)

    def check(self, engine: NTKEngine, inducing_points: Tensor) -> None:
        """Raise ``RuntimeError`` if the weights or :math:`Z` differ from those of the statistics, or a parameter
        was frozen or unfrozen since (``TrainableParametersChanged``: the statistics' Jacobian columns and
        prior groups belong to the old set of trainable parameters)."""
        state = network_state(engine, "SFR")
        if self.weights is None:  # after loading other statistics: the key decides, then copies are taken
            current = state_key(engine, inducing_points, state)
            if current.shape != self.key.shape or not torch.equal(current[:-2], self.key[:-2]):
                raise RuntimeError(_WEIGHTS_CHANGED)
            if not torch.equal(current[-2:], self.key[-2:]):
                raise RuntimeError(_INDUCING_CHANGED)
            self.weights = tuple(p.detach().clone() for p in state)
            self.inducing_points = inducing_points.detach().clone()
            return
        if not same_values(self.weights, state):
            raise RuntimeError(_WEIGHTS_CHANGED)
        stored = self.inducing_points
        current_z = inducing_points.detach().to(dtype=stored.dtype, device=stored.device)
        if current_z.shape != stored.shape or not torch.equal(current_z, stored):
            raise RuntimeError(_INDUCING_CHANGED)
