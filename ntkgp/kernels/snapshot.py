r"""Snapshots: what a lazily evaluated result depends on, taken when the result is made.

A lazy result (the kernel tensor ``kernel(x1, x2)``, the covariance of ``model(x)``) is evaluated after it was
returned, when ``.variance``, ``.to_dense()`` or a product is read. By then the user may have changed what it
depends on: :math:`\delta` (a setter, an optimizer step of the evidence) or the network (``.data``, an optimizer
step, ``load_state_dict``). A result is the model *of the moment it was made*, as GPyTorch's ``ExactGP``'s
(docs/guarantees.md, "Distributions are snapshots"). When it is made, :class:`NetworkSnapshot` copies the
trainable parameters :math:`\theta^*` (``P`` numbers) and the buffers and fingerprints the frozen parameters
(:func:`~ntkgp.caching.fingerprint`); :class:`KernelSnapshot` adds the raw :math:`\delta` (``G`` numbers). When
it is evaluated:

* nothing changed (the usual case): the live kernel or engine computes it, with its caches and its graph to
  :math:`\delta`;
* :math:`\delta` changed, the network did not: a copy of the kernel at the old :math:`\delta`, sharing the
  engine and its cached pieces;
* the network changed: a private copy of the network (``copy.deepcopy``) holding the old values, with its own
  engine, built once per snapshot (memory: one copy of the network and its layer plan).

Frozen parameters were fingerprinted, not copied: a change of one raises ``RuntimeError`` (the old values are
not at hand), as does a network that cannot be copied. A result evaluated at copies carries no gradient to the
hyperparameters it was made from (they have changed since).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from ..caching import fingerprint, same_values
from ..memory import JACOBIAN_BYTES
from ..ntk import NTKEngine
from ..ntk.network import walk
from .shared_cache import SharedValueCache

__all__ = ["KernelSnapshot", "NetworkSnapshot"]

_CANNOT_RESTORE = (
    "the network changed after this distribution (or kernel tensor) was made, and its old values cannot be "
    "restored: {reason}. Read the distribution before changing the network, or make it again"
)


def _state(net: nn.Module, names: tuple[str, ...], theta_set: frozenset[str]) -> tuple[list[Tensor], list[str]]:
    """``[θ* in the order of names, buffers, fingerprint of the other parameters]`` and the names that require grad."""
    walked = walk(net)
    params = walked.parameters
    theta = [params[n] for n in names if n in params]
    others = fingerprint([p for n, p in params.items() if n not in theta_set])
    trainable = [n for n, p in params.items() if p.requires_grad]
    return [*theta, *walked.buffers, others], trainable


def engine_on(engine: NTKEngine, net: nn.Module) -> NTKEngine:
    """An engine with the options of ``engine`` on another network (a copy of its own)."""
    core = engine.core
    return NTKEngine(
        net,
        engine.prior_structure,
        chunk_size=engine.chunk_size,
        strategy=engine.strategy.value,
        input_shape=engine.input_shape,
        max_jacobian_bytes=getattr(core, "max_jacobian_bytes", JACOBIAN_BYTES),
        progress=getattr(core, "progress", False),
    )


class NetworkSnapshot:
    """The values the outputs of ``engine``'s network depend on, copied now, and an engine at them later.

    Args:
        engine: the live engine (its network is read, never modified).
    """

    def __init__(self, engine: NTKEngine) -> None:
        self.engine = engine
        self.names = tuple(engine.groups.names)
        self._theta_set = frozenset(self.names)
        state, self._trainable = _state(engine.net, self.names, self._theta_set)
        self.values = tuple(t.detach().clone() for t in state)
        self._copy: NTKEngine | None = None

    def changed(self) -> bool:
        """Whether the network's values (or its set of trainable parameters) differ from the snapshot's."""
        if self._copy is not None:
            return True
        state, trainable = _state(self.engine.net, self.names, self._theta_set)
        return trainable != self._trainable or not same_values(self.values, state)

    def current(self) -> NTKEngine:
        """The live engine if nothing changed, else an engine on a private copy of the network at the old values."""
        return self.frozen() if self.changed() else self.engine

    def frozen(self) -> NTKEngine:
        """An engine on a private copy of the network holding the snapshot's values (built once).

        Raises:
            RuntimeError: the network cannot be copied, its parameters or buffers are no longer those of the
                snapshot, or a frozen parameter changed.
        """
        if self._copy is None:
            self._copy = engine_on(self.engine, self._network())
        return self._copy

    def _network(self) -> nn.Module:
        try:
            net = copy.deepcopy(self.engine.net)
        except Exception as error:  # a module holding something that cannot be copied
            raise RuntimeError(_CANNOT_RESTORE.format(reason=f"copying it failed ({error})")) from error
        walked = walk(net)
        params = walked.parameters
        missing = [n for n in self.names if n not in params]
        count = len(self.names)
        buffers = self.values[count:-1]
        if missing or len(walked.buffers) != len(buffers):
            reason = f"parameters {missing} are gone" if missing else "its buffers are not those it had"
            raise RuntimeError(_CANNOT_RESTORE.format(reason=reason))
        for name, p in params.items():  # the copy's own flags, as the network's were
            p.requires_grad_(name in self._theta_set)
        for name, value in zip(self.names, self.values[:count]):
            params[name].data = value
        for b, value in zip(walked.buffers, buffers):
            b.data = value
        others = fingerprint([p for n, p in params.items() if n not in self._theta_set])
        if not torch.equal(others, self.values[-1]):
            raise RuntimeError(_CANNOT_RESTORE.format(reason="a frozen parameter changed (only fingerprinted)"))
        return net


class KernelSnapshot:
    """:math:`\\delta` and the network of an :class:`~ntkgp.kernels.NTKKernel` as they are now, and a kernel that
    computes at those values whatever changes afterwards (see the module docstring).

    Args:
        kernel: the live kernel.
    """

    def __init__(self, kernel) -> None:
        self.source = kernel
        self.raw = kernel.raw_prior_precision.detach().clone()
        self.network = NetworkSnapshot(kernel.engine)
        self._reweighted = None
        self._frozen = None

    @property
    def dtype(self) -> torch.dtype:
        """The kernel's dtype when the snapshot was taken."""
        return self.raw.dtype

    def kernel(self):
        """The kernel at the snapshot's values: the live one when nothing changed."""
        if self._frozen is not None:
            return self._frozen
        if self.network.changed():
            self._frozen = self._copy(self.network.frozen())
            return self._frozen
        live = self.source
        if same_values((self.raw,), (live.raw_prior_precision,)):
            return live
        if self._reweighted is None:
            self._reweighted = self._copy(None)
        return self._reweighted

    def _copy(self, engine: NTKEngine | None):
        """A copy of the kernel at the old :math:`\\delta`: on ``engine`` with its own cache, or sharing the live
        engine and cache (``None``: the network did not change)."""
        kernel = copy.deepcopy(self.source)  # the engine and its cache are shared by a deep copy
        if engine is not None:
            kernel.engine = engine
            kernel._cache = SharedValueCache(kernel.cache_size)
        kernel.raw_prior_precision.data = self.raw
        kernel.raw_prior_precision.requires_grad_(False)
        return kernel
