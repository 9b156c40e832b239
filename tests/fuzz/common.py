"""Shared pieces of the property-based tests: small networks, data with one corruption, and the property.

The property checked at every public entry point (docs/guarantees.md):

* a call with valid arguments succeeds and every tensor it returns is finite;
* a call with one corrupted argument either succeeds with finite results (when the corruption is one the
  entry point documents as accepted, e.g. another float dtype) or raises ``ValueError``/``TypeError`` whose
  message names that argument; never another exception (a raw torch error) and never NaN results;
* in every case the user's network (state_dict bit for bit, train/eval mode of every module, requires_grad
  of every parameter) and every tensor passed in are unchanged afterwards.

Where a call succeeds, the kernel and engine tests and the training and curvature tests also compare its values
with brute-force computations written without ntkgp (tests/fuzz/reference.py).
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch import nn


def fuzz_settings(examples: int) -> settings:
    """``examples`` per test, derandomized (the same examples in every run) so the suite stays fast and
    reproducible; ``NTKGP_FUZZ_EXAMPLES=k`` runs ``k`` random examples instead (a longer exploration)."""
    explore = os.environ.get("NTKGP_FUZZ_EXAMPLES")
    return settings(
        max_examples=int(explore) if explore else examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=not explore,
        database=None,
    )


#: The error types ntkgp documents for bad arguments.
DOCUMENTED_ERRORS = (ValueError, TypeError)

DTYPES = (torch.float32, torch.float64)


# ---------------------------------------------------------------------- networks
class TinyCNN(nn.Module):
    """Conv2d → tanh → Linear on (N, 1, 4, 4) images (given with ``input_shape``)."""

    def __init__(self, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 2)
        self.head = nn.Linear(2 * 3 * 3, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


@dataclass
class Network:
    """A network and the shape of one input (``(D,)`` or ``(1, 4, 4)``)."""

    net: nn.Module
    kind: str
    example: tuple[int, ...]
    outputs: int

    @property
    def features(self) -> int:
        return math.prod(self.example)

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        return self.example if len(self.example) > 1 else None


def make_network(kind: str, outputs: int, dtype: torch.dtype, seed: int, d_in: int = 2) -> Network:
    torch.manual_seed(seed)
    if kind in ("mlp", "frozen"):
        net = nn.Sequential(nn.Linear(d_in, 3), nn.Tanh(), nn.Linear(3, outputs))
        if kind == "frozen":  # a parameter the user froze: not in the kernel, never unfrozen
            net[0].weight.requires_grad_(False)
        example = (d_in,)
    elif kind == "batchnorm":
        net = nn.Sequential(nn.Linear(d_in, 3), nn.BatchNorm1d(3), nn.Tanh(), nn.Linear(3, outputs))
        with torch.no_grad():
            net(torch.randn(8, d_in))  # running statistics, then frozen
        example = (d_in,)
    else:
        net = TinyCNN(outputs)
        example = (1, 4, 4)
    return Network(net.to(dtype).eval(), kind, example, outputs)


networks = st.sampled_from(["mlp", "batchnorm", "cnn", "frozen"])
dtypes = st.sampled_from(DTYPES)


# ---------------------------------------------------------------------- data and corruptions
def inputs(network: Network, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *network.example, generator=g).to(dtype)


INPUT_CORRUPTIONS = ("nan", "inf", "integer", "one_dim", "features", "empty", "list", "other_float")


def corrupt_inputs(x: torch.Tensor, kind: str, row: int) -> object:
    """``x`` with one corruption; ``"other_float"`` is an accepted variant (another floating dtype)."""
    if kind == "nan":
        x = x.clone()
        x.reshape(x.shape[0], -1)[row % x.shape[0], 0] = float("nan")
        return x
    if kind == "inf":
        x = x.clone()
        x.reshape(x.shape[0], -1)[row % x.shape[0], -1] = -float("inf")
        return x
    if kind == "integer":
        return (10 * x).long()
    if kind == "one_dim":
        return x.reshape(-1)
    if kind == "features":
        flat = x.reshape(x.shape[0], -1)
        return torch.cat([flat, flat[:, :1]], dim=1)
    if kind == "empty":
        return x[:0]
    if kind == "list":
        return x.tolist()
    if kind == "other_float":
        return x.to(torch.float64 if x.dtype == torch.float32 else torch.float32)
    raise ValueError(kind)


ACCEPTED_INPUT_CORRUPTIONS = {"other_float"}


def labels(likelihood_kind: str, n: int, outputs: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if likelihood_kind == "gaussian":
        return (
            torch.randn(n, generator=g).to(dtype)
            if outputs == 1
            else torch.randn(n, outputs, generator=g).to(dtype)
        )
    if likelihood_kind == "logistic":
        return torch.randint(0, 2, (n,), generator=g).to(dtype)
    return torch.randint(0, outputs, (n,), generator=g)


LABEL_CORRUPTIONS = (
    "nan",
    "out_of_range",
    "negative",
    "non_integer",
    "length",
    "three_dim",
    "list",
    "whole_floats",
)


def corrupt_labels(y: torch.Tensor, kind: str, likelihood_kind: str, outputs: int, row: int) -> object:
    """``y`` with one corruption; ``"whole_floats"`` is accepted for classification (documented)."""
    row = row % y.shape[0]
    if kind == "nan":
        y = y.to(torch.float64).clone()
        y.reshape(y.shape[0], -1)[row, 0] = float("nan")
        return y
    if kind == "out_of_range":
        y = y.clone()
        if likelihood_kind == "gaussian":
            y.reshape(y.shape[0], -1)[row, 0] = float("inf")
        else:
            y[row] = 2 if likelihood_kind == "logistic" else outputs
        return y
    if kind == "negative":
        y = y.clone()
        if likelihood_kind == "gaussian":
            y.reshape(y.shape[0], -1)[row, 0] = -float("inf")
        else:
            y[row] = -1
        return y
    if kind == "non_integer":
        y = y.to(torch.float64).clone()
        if likelihood_kind == "gaussian":
            y.reshape(y.shape[0], -1)[row, 0] = float("nan")
        else:
            y[row] = 0.5
        return y
    if kind == "length":
        return torch.cat([y, y[:1]])
    if kind == "three_dim":
        return y.reshape(y.shape[0], 1, -1)
    if kind == "list":
        return y.tolist()
    if kind == "whole_floats":
        return y.to(torch.float64) if likelihood_kind != "gaussian" else y
    raise ValueError(kind)


ACCEPTED_LABEL_CORRUPTIONS = {"whole_floats"}


# ---------------------------------------------------------------------- checking the property
def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (NaN payloads included) for bit-for-bit comparison."""
    t = t.detach()
    if t.is_floating_point():
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


@dataclass
class Snapshot:
    """Everything about the network and the argument tensors that a call must leave unchanged."""

    net: nn.Module
    tensors: list[torch.Tensor]
    state: dict = field(default_factory=dict)
    modes: dict = field(default_factory=dict)
    flags: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)

    @classmethod
    def take(cls, net: nn.Module, *objects: object) -> Snapshot:
        tensors = [t for t in flatten(objects) if torch.is_tensor(t)]
        snap = cls(net, tensors)
        snap.state = {k: bits(v).clone() for k, v in net.state_dict().items()}
        snap.modes = {name: m.training for name, m in net.named_modules()}
        snap.flags = {name: p.requires_grad for name, p in net.named_parameters()}
        snap.copies = [(t, bits(t).clone(), t.dtype, t.shape, t.requires_grad) for t in tensors]
        return snap

    def check(self, state: bool = True) -> None:
        """Compare with the snapshot (``state=False``: everything but the network's weights and buffers)."""
        current = self.net.state_dict()
        assert current.keys() == self.state.keys()
        for k, v in self.state.items():
            assert not state or torch.equal(bits(current[k]), v), f"the network's {k} changed"
        assert {n: m.training for n, m in self.net.named_modules()} == self.modes, "a module's mode changed"
        assert {n: p.requires_grad for n, p in self.net.named_parameters()} == self.flags, (
            "requires_grad changed"
        )
        for t, copy_bits, dtype, shape, requires_grad in self.copies:
            assert t.dtype == dtype and t.shape == shape and t.requires_grad == requires_grad, (
                "an input changed"
            )
            assert torch.equal(bits(t), copy_bits), "an input tensor was modified"


def flatten(objects: Iterable[object]) -> list[object]:
    out: list[object] = []
    for o in objects:
        if isinstance(o, (list, tuple)):
            out.extend(flatten(o))
        elif isinstance(o, dict):
            out.extend(flatten(o.values()))
        else:
            out.append(o)
    return out


def finite_results(result: object) -> None:
    """Every tensor in ``result`` (nested; distributions by mean and variance) is finite."""
    from gpytorch.distributions import MultivariateNormal

    if isinstance(result, MultivariateNormal):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            finite_results([result.mean, result.lazy_covariance_matrix.diagonal()])
            assert bool((result.lazy_covariance_matrix.diagonal() >= 0).all()), "negative variance"
        return
    if hasattr(result, "to_dense") and not torch.is_tensor(result):
        finite_results(result.to_dense())
        return
    if torch.is_tensor(result):
        if result.is_floating_point():
            assert bool(torch.isfinite(result).all()), "non-finite result"
        return
    if isinstance(result, float):
        assert math.isfinite(result), "non-finite result"
        return
    if isinstance(result, (list, tuple)):
        for r in result:
            finite_results(r)


def check_call(
    call: Callable[[], object],
    net: nn.Module,
    arguments: Iterable[object],
    corrupted: str | None,
    names: Iterable[str] = (),
    accepted: bool = False,
    trains: bool = False,
) -> object:
    """Run ``call`` and check the property; returns its result (``None`` when it raised).

    ``trains``: the call trains ``net`` in place when it succeeds (``train_marglik``): then only its weights
    and buffers may change, and only on success.
    """
    snapshot = Snapshot.take(net, *arguments)
    names = list(names)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = call()
    except DOCUMENTED_ERRORS as error:
        snapshot.check()
        assert corrupted is not None and not accepted, f"a valid call raised {type(error).__name__}: {error}"
        message = str(error)
        assert any(name in message for name in names), f"the message does not name {names}: {message}"
        return None
    snapshot.check(state=not trains)
    assert corrupted is None or accepted, f"the corruption {corrupted!r} was accepted"
    finite_results(result)
    return result


def clone_network(network: Network) -> Network:
    return Network(copy.deepcopy(network.net), network.kind, network.example, network.outputs)
