r"""The network as a function of (a subset of) its weights, :math:`\theta \mapsto f(x; \theta)`, at
:math:`\theta^*`.

Everything a weight-space posterior needs from the network: outputs, outputs at perturbed weights
:math:`f(x; \theta^* + \eta)`, per-example Jacobians :math:`J(x) = \partial f / \partial \theta` and
Jacobian-vector products :math:`J(x) \eta` by forward mode (``torch.func.jvp``), never forming :math:`J`.
The passes themselves are ntkgp's shared functional ones (:mod:`ntkgp.ntk.functional`).

The parameters :math:`\theta` are a list of the network's parameter names, flattened in that order (each
tensor row-major): the coordinates of every flat vector of a posterior. Parameters outside the list are
held at their values. The network is called through ``torch.func.functional_call`` with detached copies of
its parameters: its weights, ``requires_grad`` flags, mode and hooks are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.func import jvp, vmap

from ...ntk import check_eval_mode, check_outputs
from ...ntk.checks import check_fits, prepare_inputs
from ...ntk.functional import forward, per_example_jacobians


class NetworkFunction:
    r"""The map :math:`\theta \mapsto f(x; \theta)` of a network restricted to the parameters ``names``.

    Args:
        net: the trained network ``(N, *input_shape) -> (N, C)``; BatchNorm/dropout must be in eval mode.
            Held by reference, never modified.
        names: the parameters :math:`\theta` (names as in ``net.named_parameters()``), in the order of the
            flat vectors; ``None`` takes every parameter with ``requires_grad=True``.
        input_shape: the shape of one input; flat ``(N, D)`` inputs are reshaped to ``(N, *input_shape)``.
        chunk_size: examples per chunk of Jacobian computations (memory ``O(chunk_size · C · P)``).

    Raises:
        TypeError: if ``net`` is not an ``nn.Module``.
        ValueError: for unknown or repeated ``names``, an empty list, or BatchNorm/dropout in training mode.
    """

    def __init__(
        self,
        net: nn.Module,
        names: Sequence[str] | None = None,
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 256,
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        check_eval_mode(net)
        named = dict(net.named_parameters())
        if names is None:
            names = [n for n, p in named.items() if p.requires_grad]
        names = list(names)
        unknown = [n for n in names if n not in named]
        if unknown or not names or len(set(names)) != len(names):
            raise ValueError(
                f"names must list distinct parameters of net (at least one); unknown {unknown}, got {names}"
            )
        self.net = net
        self.names = names
        self.shapes = [named[n].shape for n in names]
        self.numels = [named[n].numel() for n in names]
        self.offsets = [0, *torch.tensor(self.numels).cumsum(0).tolist()]
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.chunk_size = chunk_size
        self._fits: set[tuple] = set()  # input shapes and dtypes seen to fit the network

    # ------------------------------------------------------------------ parameters
    @property
    def num_params(self) -> int:
        """:math:`P`, the number of coordinates of :math:`\\theta`."""
        return self.offsets[-1]

    def params(self) -> dict[str, Tensor]:
        """Every parameter of the network, detached (shares storage with the network's)."""
        return {n: p.detach() for n, p in self.net.named_parameters()}

    @property
    def dtype(self) -> torch.dtype:
        return dict(self.net.named_parameters())[self.names[0]].dtype

    @property
    def device(self) -> torch.device:
        return dict(self.net.named_parameters())[self.names[0]].device

    def theta(self) -> Tensor:
        r""":math:`\theta^*` as a flat vector ``(P,)`` (a copy)."""
        params = self.params()
        return torch.cat([params[n].reshape(-1) for n in self.names])

    def unflatten(self, v: Tensor) -> dict[str, Tensor]:
        """Split flat vectors ``(..., P)`` into parameter-shaped tensors ``(..., *shape)``."""
        lead = v.shape[:-1]
        return {
            n: v[..., s:e].reshape(*lead, *shape)
            for n, shape, s, e in zip(self.names, self.shapes, self.offsets[:-1], self.offsets[1:])
        }

    def offset(self, name: str) -> int:
        """The position of parameter ``name`` in the flat vector."""
        return self.offsets[self.names.index(name)]

    # ------------------------------------------------------------------ inputs and outputs
    def prepare(self, x: Tensor, argument: str = "x") -> Tensor:
        """Check ``x`` and bring it to the network's dtype, device and input shape (a copy when needed); the
        first input of each shape and dtype is checked to fit the network (one forward pass of one example),
        so that a wrong shape or dtype is reported naming ``argument``, before any other network pass."""
        check_eval_mode(self.net)
        x = prepare_inputs(x, argument, self.dtype, self.device, self.input_shape)
        key = (tuple(x.shape[1:]), x.dtype)
        if key not in self._fits:
            check_fits(self.net, self.params(), x, argument, None)
            self._fits.add(key)
        return x

    def forward(self, x: Tensor, perturbation: Tensor | None = None) -> Tensor:
        r""":math:`f(x; \theta^* + \eta)` for a prepared batch ``x`` and a flat ``perturbation`` :math:`\eta`
        ``(P,)`` (``None``: :math:`\eta = 0`), shape ``(N, C)``."""
        params = self.params()
        if perturbation is not None:
            for n, d in self.unflatten(perturbation).items():
                params[n] = params[n] + d
        return forward(self.net, params, x)

    def outputs(self, x: Tensor, argument: str = "x") -> Tensor:
        r""":math:`f(x; \theta^*)`, shape ``(N, C)``, without a graph; ``x`` is checked and prepared."""
        x = self.prepare(x, argument)
        with torch.no_grad():
            f = torch.cat([self.forward(xc) for xc in x.split(self.chunk_size)])
        check_outputs(f, x.shape[0])
        return f

    # ------------------------------------------------------------------ derivatives
    def jacobian(self, x: Tensor, names: Sequence[str] | None = None) -> Tensor:
        r"""Per-example Jacobians :math:`J(x_n)`, shape ``(N, C, P)`` (``P`` of ``names``, default all of
        :math:`\theta`, columns in that order), by ``vmap(jacrev)`` on a prepared batch ``x``.

        Memory :math:`O(NCP)`: call it on chunks of ``chunk_size`` examples.
        """
        names = self.names if names is None else list(names)
        jac = per_example_jacobians(self.net, self.params(), x, names)
        return torch.cat([jac[n] for n in names], dim=-1)

    def jvp(self, x: Tensor, tangents: Tensor) -> Tensor:
        r"""Jacobian-vector products :math:`J(x) \eta_s` for flat tangents ``(S, P)``, shape ``(S, N, C)``.

        Forward mode (``torch.func.jvp``, vectorized over the tangents by ``vmap``): the cost of about
        three forward passes per tangent, memory of one forward pass per tangent; :math:`J` is never formed.
        """
        params = self.params()
        primals = {n: params[n] for n in self.names}

        def push(tangent: dict[str, Tensor]) -> Tensor:
            return jvp(lambda p: forward(self.net, {**params, **p}, x), (primals,), (tangent,))[1]

        return vmap(push)(self.unflatten(tangents.to(self.dtype)))
