r"""The network at its current weights :math:`\theta^*`: the one object every pass through it goes through.

:class:`NetworkCore` holds the network and the parameters :math:`\theta` (by default every trainable one) with
their prior groups, the chunking and memory limits, and the passes: input checks, forward passes (at
:math:`\theta^*`, at perturbed or given weights), per-example Jacobians by chunks, forward-mode products,
per-example vector-Jacobian products, layer features, and the layer plan of each input shape
(:mod:`ntkgp.ntk.layer_plan`). The NTK engine's strategies, the weight posteriors, the curvature passes and
FSVI's linearized network all use it.

**The user's module is never touched.** :attr:`NetworkCore.net` is the user's network, read for keys, checks and
plans; every pass runs on ntkgp's private structural copy of it (:meth:`NetworkCore.module`,
:mod:`ntkgp.ntk.private_copy`: its own module objects sharing the user's parameter and buffer tensors, one per
thread, rebuilt when the network changes in structure), called through ``torch.func.functional_call`` with
detached aliases of the parameters (a forward pass at :math:`\theta^*` without a graph, and the layer features at
:math:`\theta^*` where the layers' parameters require grad, by the copy's own call). The user's weights,
``requires_grad`` flags, ``.grad``, mode and hooks are left as they are, and another thread calling the network
meanwhile sees its own ``nn.Parameter``\ s and hooks only.

**Every network that builds is differentiated.** The first input of each shape is also a probe of how the network
can be differentiated (:mod:`ntkgp.ntk.autodiff`: forward mode or reverse over reverse, vectorized over examples or
one at a time, differentiable attention kernels), so that a network whose operations lack a derivative mode takes
another route, or is refused at construction naming the module, never at its first prediction. A parameter the
forward never uses has zero Jacobian columns. Lazy modules not yet initialized are refused at construction.

The layer plan, the check that inputs fit and the autodiff probe are kept per architecture of the network across
cores (:mod:`ntkgp.ntk.architecture`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..caching import network_key
from ..memory import JACOBIAN_BYTES
from ..progress import check_progress, progress_bar
from ..validation import count, positive_count
from .architecture import cached
from .checks import (check_eval_mode, check_fits, check_initialized, check_network_values, check_outputs, check_shape,
                     prepare_inputs)
from .autodiff import Autodiff, probe
from .features import Layer, LayerFeatures, layer_features, own_graph
from .functional import call, forward, jvp_columns, per_example_jacobians, per_example_vjps, vjp_columns
from .groups import GroupSpec, resolve_groups
from .inputs import detach, num_rows, requires_grad, rows, signature, split
from .layer_plan import LayerPlan, cached_plan
from .private_copy import PrivateCopies


class NetworkWalk(NamedTuple):
    """What one walk of a network's modules gives (:func:`walk`)."""

    modules: list[tuple[str, nn.Module]]  #: ``list(net.named_modules())``
    parameters: dict[str, Tensor]  #: ``dict(net.named_parameters())``
    buffers: list[Tensor]  #: ``list(net.buffers())``


def walk(net: nn.Module) -> NetworkWalk:
    """The named modules, named parameters and buffers of ``net``, as ``named_modules()``, ``named_parameters()``
    and ``buffers()`` give them (same order, each tensor once), from one walk of the modules instead of three
    (a network state is read at every cache lookup)."""
    modules = list(net.named_modules())
    parameters: dict[str, Tensor] = {}
    buffers: list[Tensor] = []
    seen_parameters: set[int] = set()  # by id: a tensor's own hash is a Python call
    seen_buffers: set[int] = set()
    for prefix, module in modules:
        if module._parameters:
            for name, p in module._parameters.items():
                if p is not None and id(p) not in seen_parameters:
                    seen_parameters.add(id(p))
                    parameters[f"{prefix}.{name}" if prefix else name] = p
        if module._buffers:
            for b in module._buffers.values():
                if b is not None and id(b) not in seen_buffers:
                    seen_buffers.add(id(b))
                    buffers.append(b)
    return NetworkWalk(modules, parameters, buffers)


class NetworkCore:
    r"""The network :math:`\theta \mapsto f(x; \theta)` at :math:`\theta^*`, restricted to the parameters ``names``.

    Args:
        net: any ``nn.Module`` mapping ``(N, *input_shape)`` to ``(N, C)``; BatchNorm/dropout must be in eval
            mode. Held by reference, never modified.
        names: the parameters :math:`\theta` (names as in ``net.named_parameters()``), in the order of the
            flat vectors; ``None`` takes every parameter with ``requires_grad=True``. The others are held at
            their values.
        input_shape: the shape of one input; flat ``(N, D)`` inputs are reshaped to ``(N, *input_shape)``.
        chunk_size: examples per chunk of Jacobian computations (memory ``O(chunk_size · C · P)``).
        prior_structure: the prior groups of :math:`\theta` (:func:`~ntkgp.ntk.groups.resolve_groups`).
        max_jacobian_bytes: Jacobians up to this size may be kept between chunks (the NTK's contraction).
        progress: ``None`` (auto), ``True`` (a bar) or ``False`` (silent) over the chunks of a pass
            (:mod:`ntkgp.progress`).
        fixed_architecture: the network's modules are not changed while this core is used (a core for one pass
            over the data): its fit checks and layer plans take the architecture cache's entry of its first look-up
            without walking the modules again (:func:`~ntkgp.ntk.architecture.cached`, ``held``).

    Raises:
        TypeError: ``net`` is not an ``nn.Module``, or ``progress`` not ``True``, ``False`` or ``None``.
        ValueError: an invalid option, unknown or repeated ``names``, no trainable parameter, or
            BatchNorm/dropout in training mode.
    """

    def __init__(
        self,
        net: nn.Module,
        names: Sequence[str] | None = None,
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 256,
        prior_structure: GroupSpec = "layer",
        max_jacobian_bytes: int = JACOBIAN_BYTES,
        progress: bool | None = False,
        fixed_architecture: bool = False,
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        check_initialized(net)
        check_network_values(net)
        self.chunk_size = positive_count(chunk_size, "chunk_size")
        self.max_jacobian_bytes = count(max_jacobian_bytes, "max_jacobian_bytes")
        self.input_shape = check_shape(input_shape, "input_shape")
        check_progress(progress)
        check_eval_mode(net)
        self.groups = resolve_groups(net, prior_structure, names)
        self.net = net
        self.progress = progress
        self.names: list[str] = list(self.groups.names)
        self.shapes = list(self.groups.shapes)
        self.numels = list(self.groups.numels)
        self.offsets = [0, *accumulate(self.numels)]
        self._fits: set[tuple] = set()  # input shapes and dtypes seen to fit the network
        self._num_outputs: int | None = None
        self._plans: dict[tuple, LayerPlan] = {}
        self._architecture: list | None = [] if fixed_architecture else None  # architecture.cached's ``held``
        self._copies = PrivateCopies(net)  # ntkgp's private copy of the network, one per thread
        self._autodiff: dict[tuple, Autodiff] = {}  # per input shape: how the network is differentiated

    def __deepcopy__(self, memo: dict) -> NetworkCore:
        # A copy of a kernel or model refers to the same user network: never duplicate (or detach) it.
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        memo[id(self)] = new
        return new

    def module(self) -> nn.Module:
        """This thread's private structural copy of the network as it is now (:mod:`ntkgp.ntk.private_copy`):
        what every pass runs on. Rebuilt when the network changed in structure since the last pass."""
        return self._copies.get()

    def autodiff(self, x) -> Autodiff:
        """How the network is differentiated for inputs shaped like the prepared ``x`` (:mod:`ntkgp.ntk.autodiff`),
        probed on ``x[:1]`` once per input shape and architecture of the network.

        Raises:
            ValueError: no route differentiates the network (naming the module whose forward fails)."""
        leaves = pytree.tree_leaves(x)
        key = tuple((tuple(t.shape[1:]), t.dtype, t.device) for t in leaves)
        found = self._autodiff.get(key)
        if found is None:
            module = self.module()
            found = cached(self.net, ("autodiff", tuple(self.names), *key),
                           lambda: probe(module, self.functional_params(), self.names, x,
                                         dict(self.net.named_parameters())), self._architecture)
            if found.kernels:
                self._copies.kernels = True
            self._autodiff[key] = found
        return found

    # ------------------------------------------------------------------ parameters
    @property
    def num_params(self) -> int:
        """:math:`P`, the number of coordinates of :math:`\\theta`."""
        return self.offsets[-1]

    def parameters(self) -> list[Tensor]:
        """The parameters :math:`\\theta^*` in the order of :attr:`names`: the network's own tensors (not
        copies; do not modify them)."""
        named = dict(self.net.named_parameters())
        return [named[n] for n in self.names]

    def params(self) -> dict[str, Tensor]:
        """:math:`\\theta^*` per name, detached (sharing storage with the network's)."""
        return {n: p.detach() for n, p in zip(self.names, self.parameters())}

    def functional_params(self) -> dict[str, Tensor]:
        """Every parameter of the network, detached: what ``functional_call`` is given (parameters outside
        :math:`\\theta` are held, and never receive a gradient)."""
        return {n: p.detach() for n, p in self.net.named_parameters()}

    def _first(self) -> Tensor:
        """The first parameter of :math:`\\theta`, looked up by its path (not a walk of every module)."""
        return self.net.get_parameter(self.names[0])

    @property
    def dtype(self) -> torch.dtype:
        return self._first().dtype

    @property
    def device(self) -> torch.device:
        return self._first().device

    def network_state(self, walked: NetworkWalk | None = None) -> list[Tensor]:
        """What the network's outputs depend on, the key of every value cache computed from it
        (:func:`~ntkgp.caching.network_key`): :math:`\\theta^*` and the buffers themselves, and a fingerprint
        (exact integer sums of their bit patterns) of the other parameters. It also checks the network's mode:
        a cached result is never served for a network since switched to training mode. ``walked``:
        :func:`walk` of the network when the caller has just walked it (one walk of the modules in all)."""
        walked = walk(self.net) if walked is None else walked
        check_eval_mode(self.net, modules=walked.modules)
        named = walked.parameters
        return network_key(self.net, [named[n] for n in self.names], named.values(), walked.buffers)

    def group_sq_norms(self) -> Tensor:
        """``‖θ*_g‖²`` per prior group, shape ``(G,)``."""
        params = self.parameters()  # one walk over the modules
        squares = torch.stack([p.detach().square().sum() for p in params])
        if self.groups.num_groups == 1:
            return squares.sum().reshape(1)
        index = torch.tensor(self.groups.group_of, device=squares.device)
        return squares.new_zeros(self.groups.num_groups).index_add_(0, index, squares)

    def theta(self) -> Tensor:
        r""":math:`\theta^*` as a flat vector ``(P,)`` (a copy)."""
        return torch.cat([p.reshape(-1) for p in self.params().values()])

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
        """Check ``x`` and bring it to the network's dtype, device and input shape (a copy when needed).

        The first input of each shape and dtype is checked to fit the network (one forward pass of one
        example), so that a wrong shape or dtype is reported naming ``argument``, before any other pass.

        Raises:
            TypeError: ``x`` is not a real tensor.
            ValueError: ``x`` is empty, has NaN/Inf in some row, does not fit the network, or gives another
                number of outputs than earlier inputs, naming ``argument``.
        """
        check_eval_mode(self.net)
        x = prepare_inputs(x, argument, self.dtype, self.device, self.input_shape)
        key = signature(x)  # shape of one example, dtype, device (of each entry of a dict/tuple input)
        if key not in self._fits:  # once per core; the forward pass once per architecture of the network
            c = cached(self.net, ("fits", *key),
                       lambda: check_fits(self.module(), self.functional_params(), x, argument, None),
                       self._architecture)
            if self._num_outputs is not None and c != self._num_outputs:  # raises, naming the argument
                check_fits(self.module(), self.functional_params(), x, argument, self._num_outputs)
            self._num_outputs = c
            self.autodiff(x)  # how the network is differentiated: a route for every network, or a clear error now
            self._fits.add(key)
        return x

    def num_outputs(self, x: Tensor | None = None) -> int:
        """C, the number of network outputs (found by one forward pass of ``x[:1]`` the first time)."""
        if self._num_outputs is None:
            if x is None:
                raise RuntimeError("the number of outputs is unknown until the network has seen an input")
            self.prepare(rows(x, 0, 1))
        return self._num_outputs

    def call(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
        """``f(x; θ)`` with the parameters ``params`` (e.g. FSVI's mean, differentiable) and the others held."""
        return forward(self.module(), {**self.functional_params(), **params}, x)

    def forward(self, x: Tensor, perturbation: Tensor | None = None) -> Tensor:
        r""":math:`f(x; \theta^* + \eta)` for a prepared batch ``x`` and a flat ``perturbation`` :math:`\eta`
        ``(P,)`` (``None``: :math:`\eta = 0`), shape ``(N, C)``."""
        if perturbation is None and not torch.is_grad_enabled():
            return call(self.module(), None, x)  # without a graph the copy's own call is the functional one
        params = self.functional_params()
        if perturbation is not None:
            for n, d in self.unflatten(perturbation).items():
                params[n] = params[n] + d
        return forward(self.module(), params, x)

    def outputs(self, x: Tensor, argument: str = "x") -> Tensor:
        r""":math:`f(x; \theta^*)`, shape ``(N, C)``, by chunks; ``x`` is checked and prepared. No graph to the
        network; a graph to ``x`` when it requires grad (and grad mode is on)."""
        x = self.prepare(x, argument)
        with torch.set_grad_enabled(torch.is_grad_enabled() and requires_grad(x)):
            f = torch.cat([self.forward(xc) for xc in split(x, self.chunk_size)])
        check_outputs(f, num_rows(x))
        self._num_outputs = f.shape[1]
        return f

    def chunks(self, n: int, desc: str) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` of the chunks of ``chunk_size`` examples among ``n``, with the progress
        :attr:`progress` asks (:func:`~ntkgp.progress.progress_bar`; nothing for a single chunk), called ``desc``
        (or ``"name (desc)"`` within :func:`~ntkgp.progress.reporting`)."""
        starts = range(0, n, self.chunk_size)
        progress = self.progress if len(starts) > 1 else False
        name = getattr(self, "pass_name", None)  # set by ntkgp.progress.reporting
        for s in progress_bar(starts, len(starts), f"{name} ({desc})" if name else desc, progress, "chunk"):
            yield s, min(s + self.chunk_size, n)

    # ------------------------------------------------------------------ derivatives
    def jacobian_chunk(
        self, x: Tensor, names: Sequence[str], params: dict[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """Per-example Jacobians ``{name: (n, C, numel)}`` of the parameters ``names`` on a prepared chunk
        ``x``, by ``vmap(jacrev)`` (memory :math:`O(n C P_{names})`), at :math:`\theta^*` or at ``params``
        (differentiable in those that require grad)."""
        given = self.functional_params() if params is None else {**self.functional_params(), **params}
        return per_example_jacobians(self.module(), given, x, names, self.autodiff(x).vectorized)

    def jacobian(self, x: Tensor, names: Sequence[str] | None = None) -> Tensor:
        r"""Per-example Jacobians :math:`J(x_n)`, shape ``(N, C, P)`` (``P`` of ``names``, default all of
        :math:`\theta`, columns in that order), on a prepared batch ``x``: call it on chunks."""
        names = self.names if names is None else list(names)
        jac = self.jacobian_chunk(x, names)
        return torch.cat([jac[n] for n in names], dim=-1)

    def jvp(self, x: Tensor, tangents: Tensor) -> Tensor:
        r"""Jacobian-vector products :math:`J(x) \eta_s` for flat tangents ``(S, P)``, shape ``(S, N, C)``.

        Forward mode (``torch.func.jvp``, vectorized over the tangents by ``vmap``): the cost of about
        three forward passes per tangent; :math:`J` is never formed. Networks without forward-mode derivatives take
        reverse over reverse (:mod:`ntkgp.ntk.autodiff`).
        """
        return self.jvp_dict(x, self.unflatten(tangents.to(self.dtype)))[1]

    def jvp_dict(self, x, tangents: dict[str, Tensor], params: dict[str, Tensor] | None = None
                 ) -> tuple[Tensor, Tensor]:
        r""":math:`f(x)` ``(N, C)`` and :math:`J(x) u_s` ``(S, N, C)`` for tangents ``{name: (S, *shape)}`` of some
        parameters of :math:`\theta`, at :math:`\theta^*` or at ``params`` (differentiable in them), by the route
        the network takes (:func:`~ntkgp.ntk.functional.jvp_columns`)."""
        given = self.functional_params() if params is None else {**self.functional_params(), **params}
        return jvp_columns(self.module(), given, x, tangents, self.autodiff(x).forward_mode)

    def value_and_jvp(self, x, tangent: dict[str, Tensor], params: dict[str, Tensor] | None = None
                      ) -> tuple[Tensor, Tensor]:
        r""":math:`f(x)` and :math:`J(x) u` ``(N, C)`` for one parameter-shaped tangent ``{name: shape}`` (e.g.
        :math:`u = \theta^*`: the linearized network's offset), one pass."""
        f, pushed = self.jvp_dict(x, {n: t.unsqueeze(0) for n, t in tangent.items()}, params)
        return f, pushed[0]

    def vjp_columns(self, x, names: Sequence[str], v: Tensor) -> dict[str, Tensor]:
        r""":math:`J(X)^\top V` of the parameters ``names`` for cotangent columns ``v`` ``(N, C, k)``,
        ``{name: (*shape, k)}`` (:func:`~ntkgp.ntk.functional.vjp_columns`)."""
        return vjp_columns(self.module(), self.functional_params(), x, names, v)

    def per_example_vjps(self, x: Tensor, cotangents: Tensor, names: Sequence[str]) -> Tensor:
        r"""Rows :math:`J_n^\top u_{nm}` restricted to the parameters ``names``, shape ``(n, M, P_{names})``
        (:func:`ntkgp.ntk.functional.per_example_vjps`)."""
        return per_example_vjps(self.module(), self.functional_params(), x, cotangents, names,
                                self.autodiff(x).vectorized)

    # ------------------------------------------------------------------ layers
    def layer_plan(self, x: Tensor, modules: Sequence[str] | None = None) -> LayerPlan:
        """The layer plan of :math:`\\theta` for inputs shaped like the prepared ``x``, verified on the probe
        ``x[:1]`` once per input shape (and ``modules``) and architecture of the network, whatever the number of
        cores built on it (:func:`~ntkgp.ntk.layer_plan.cached_plan`); within a core, once per input shape."""
        key = (signature(x), None if modules is None else tuple(modules))
        if key not in self._plans:
            self._plans[key] = cached_plan(self.net, self.functional_params, self.names, detach(rows(x, 0, 1)), modules,
                                           self._architecture, self.module())
        return self._plans[key]

    def features(
        self, x: Tensor, layers: Sequence[Layer], cotangents: Tensor | Callable | None = None, graph: bool = False,
        params: dict[str, Tensor] | None = None, reduce: Callable[..., Tensor | None] | None = None,
    ) -> LayerFeatures:
        """Layer inputs and output gradients of ``layers`` on a prepared batch ``x``
        (:func:`~ntkgp.ntk.features.layer_features`), at :math:`\\theta^*` or at ``params``."""
        if params is None and not graph and own_graph(layers):  # the network's own call, without the swaps
            given = None
        else:
            given = self.functional_params() if params is None else {**self.functional_params(), **params}
        return layer_features(self.module(), given, layers, x, cotangents, graph, reduce)
