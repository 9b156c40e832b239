r"""The empirical-NTK engine: Jacobians, per-group Grams, diagonals and matrix-free products.

Everything here is a function of the network at its current weights :math:`\theta^*`. :class:`NTKEngine` is
the front: it validates inputs, decides once per input shape which parameters take which route
(:func:`ntkgp.ntk.structured.build_plan`) and dispatches to the structured route (:mod:`ntkgp.ntk.structured`:
``nn.Linear`` / ``nn.Conv2d`` layers from their layer features, :mod:`ntkgp.ntk.features`, shared with
:mod:`ntkgp.laplace.weight_space`), the contraction route (:mod:`ntkgp.ntk.contraction`: ``vmap(jacrev)`` for every other
parameter) and matrix-free products (:mod:`ntkgp.ntk.products`). Rows are in GPyTorch's interleaved order
``n·C + c`` (``docs/math.md``, "Structured form").

**Input gradients.** When an input requires grad (and grad mode is on) every result keeps its autograd graph
to that input: features are computed with ``create_graph=True`` (second-order autograd through
:math:`\gamma`) and Jacobians through ``torch.func``, in both routes. Otherwise everything is detached (the
fast path).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from ..caching import network_key
from ..options import Strategy, choose, renamed_argument
from . import contraction, products, structured
from .checks import check_count, check_eval_mode, check_fits, check_outputs, check_rows, check_shape
from .checks import check_tangents, prepare_inputs
from .functional import forward
from .groups import GroupSpec, resolve_groups
from .structured import Features, Plan

#: Deprecated: the accepted values of ``strategy=`` are the members of :class:`ntkgp.options.Strategy`.
STRATEGIES = tuple(s.value for s in Strategy)


class NTKEngine:
    """Computes the empirical NTK of ``net`` at its current weights, without modifying the network.

    Args:
        net: any ``nn.Module`` mapping a batch ``(N, *input_shape)`` to outputs ``(N, C)``. It must not
            contain BatchNorm or dropout in training mode. Its weights, dtype, ``requires_grad`` flags,
            hooks and mode are never changed.
        prior_structure: prior-precision groups, see :func:`ntkgp.ntk.resolve_groups`.
        chunk_size: examples per chunk; memory of the contraction route is ``O(chunk_size · C · P)``.
        strategy: ``"auto"`` (structured for every Linear/Conv2d layer that passes the safety rule of
            :mod:`ntkgp.ntk.features`, contraction for the rest), ``"structured"`` (the same, but a layer that
            fails the rule raises) or ``"contraction"`` (``vmap(jacrev)`` for everything).
        input_shape: shape of one input as the network expects it. When given, inputs arriving as
            flat ``(N, D)`` matrices (GPyTorch's convention) are reshaped to ``(N, *input_shape)``.
        max_jacobian_bytes: the contraction route keeps the Jacobian of the second argument in memory
            when it is smaller than this, and recomputes it chunk by chunk otherwise.
        progress: show a tqdm progress bar over chunks.
        **kwargs: ``groups=``, the deprecated name of ``prior_structure``.

    Raises:
        TypeError: ``net`` is not a module, or an unknown keyword.
        ValueError: an invalid option, or BatchNorm/dropout in training mode.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> engine = NTKEngine(net, prior_structure="layer")
        >>> engine.group_grams(torch.randn(5, 3)).shape
        torch.Size([2, 10, 10])
    """

    def __init__(
        self,
        net: nn.Module,
        prior_structure: GroupSpec = "layer",
        chunk_size: int = 256,
        strategy: str = "auto",
        input_shape: tuple[int, ...] | None = None,
        max_jacobian_bytes: int = 2**30,
        progress: bool = False,
        **kwargs,
    ) -> None:
        prior_structure = renamed_argument(kwargs, "groups", "prior_structure", prior_structure, "layer")
        if kwargs:
            raise TypeError(f"NTKEngine() got unexpected keyword arguments {sorted(kwargs)}")
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        self.strategy = choose(Strategy, strategy, "strategy")
        self.chunk_size = check_count(chunk_size, "chunk_size")
        self.max_jacobian_bytes = check_count(max_jacobian_bytes, "max_jacobian_bytes", minimum=0)
        input_shape = check_shape(input_shape, "input_shape")
        if not isinstance(progress, bool):
            raise TypeError(f"progress must be True or False, got {progress!r}")
        check_eval_mode(net)
        self.net = net
        self.prior_structure = prior_structure
        self.groups = resolve_groups(net, prior_structure)
        self.input_shape = input_shape
        self.progress = progress
        self._plans: dict[tuple[int, ...], Plan] = {}
        self._fits: set[tuple] = set()
        self._num_outputs: int | None = None

    def __deepcopy__(self, memo: dict) -> NTKEngine:
        # A copy of a kernel or model refers to the same user network: never duplicate (or detach) it.
        new = copy.copy(self)
        memo[id(self)] = new
        return new

    # ------------------------------------------------------------------ basic properties
    num_groups = property(lambda self: self.groups.num_groups, doc="G, the number of prior groups.")
    num_params = property(lambda self: self.groups.num_params, doc="P, the number of trainable parameters.")

    def parameters(self) -> list[torch.Tensor]:
        """The network's trainable parameters θ*, in the order of ``groups.names``: the network's own tensors
        (not copies; do not modify them). Use them as ``state`` of a :class:`ntkgp.caching.ValueCache`."""
        named = dict(self.net.named_parameters())
        return [named[n] for n in self.groups.names]

    @property
    def dtype(self) -> torch.dtype:
        return self.parameters()[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parameters()[0].device

    def network_state(self) -> list[torch.Tensor]:
        """What the network's outputs depend on, the key of every value cache computed from it
        (:func:`~ntkgp.caching.network_key`): the trainable parameters θ* and the buffers themselves, and a
        fingerprint (exact integer sums of their bit patterns) of the frozen parameters, which change ``J`` without
        being differentiated (a frozen backbone is not copied into every entry). It also checks the network's
        mode: a cached result is never served for a network since switched to training mode (BatchNorm or
        dropout), for which nothing would be recomputed."""
        check_eval_mode(self.net)
        return network_key(self.net, self.parameters())

    def params(self) -> dict[str, torch.Tensor]:
        """The trainable parameters θ*, detached (they share storage with the network's)."""
        return {n: p.detach() for n, p in zip(self.groups.names, self.parameters())}

    def group_sq_norms(self) -> torch.Tensor:
        """``‖θ*_g‖²`` per group at the current weights, shape ``(G,)`` (the prior term is ``Σ_g δ_g ‖θ*_g‖²``)."""
        norms = torch.zeros(self.num_groups, dtype=self.dtype, device=self.device)
        for p, g in zip(self.parameters(), self.groups.group_of):
            norms[g] += p.detach().square().sum()
        return norms

    def params_version(self) -> tuple:
        """Deprecated: a key from ``(data_ptr, _version)`` of the parameters. It misses ``.data`` writes and
        ``load_state_dict``; key caches by value with :class:`ntkgp.caching.ValueCache` and :meth:`parameters`."""
        return tuple((p.data_ptr(), p._version) for p in self.parameters())

    # ------------------------------------------------------------------ inputs
    def prepare(self, x: torch.Tensor, argument: str = "x") -> torch.Tensor:
        """Check ``x`` and bring it into the network's dtype, device and input shape (a copy if needed).

        Raises:
            TypeError: ``x`` is not a real tensor.
            ValueError: ``x`` is empty, has NaN/Inf in some row, or does not fit the network (shape or dtype;
                checked by one forward pass of one example per new input shape), naming ``argument``.
        """
        check_eval_mode(self.net)
        x = prepare_inputs(x, argument, self.dtype, self.device, self.input_shape)
        key = (tuple(x.shape[1:]), x.dtype)
        if key not in self._fits:
            self._num_outputs = check_fits(self.net, self.params(), x, argument, self._num_outputs)
            self._fits.add(key)
        return x

    @staticmethod
    def _graph(*xs: torch.Tensor) -> bool:  # keep a graph to the inputs (else the detached fast path)
        return torch.is_grad_enabled() and any(x.requires_grad for x in xs)

    def outputs(self, x: torch.Tensor, argument: str = "x") -> torch.Tensor:
        """Network outputs ``f(x; θ*)``, shape ``(N, C)``, without gradients to the network (with a graph to
        ``x`` when it requires grad)."""
        x = self.prepare(x, argument)
        with torch.set_grad_enabled(self._graph(x)):
            f = torch.cat([forward(self.net, self.params(), xc) for xc in x.split(self.chunk_size)])
        check_outputs(f, x.shape[0])
        self._num_outputs = f.shape[1]
        return f

    def num_outputs(self, x: torch.Tensor | None = None) -> int:
        """C, the number of network outputs (found by one forward pass of ``x[:1]`` the first time)."""
        if self._num_outputs is None:
            if x is None:
                raise RuntimeError("the number of outputs is unknown until the engine has seen an input")
            self.prepare(x[:1])
        return self._num_outputs

    def plan(self, x: torch.Tensor) -> Plan:
        """Which parameters take which route for inputs shaped like ``x`` (prepared), verified once per input
        shape on the probe ``x[:1]`` (:func:`ntkgp.ntk.structured.build_plan`)."""
        key = tuple(x.shape[1:])
        if key not in self._plans:
            self._plans[key] = structured.build_plan(self, x[:1].detach())
        return self._plans[key]

    def _pair(self, x1: torch.Tensor, x2: torch.Tensor | None) -> tuple:
        """``(x1, x2, sym, plan, C, graph)`` for a two-argument computation, both arguments validated first."""
        x1 = self.prepare(x1, "x1")
        sym = x2 is None
        x2 = x1 if sym else self.prepare(x2, "x2")
        plan = self.plan(x1)
        if not sym and self.plan(x2).routes() != plan.routes():
            raise ValueError("x1 and x2 take different routes through the network (different input shapes)")
        return x1, x2, sym, plan, self.num_outputs(x1), self._graph(x1, x2)

    def _chunks(self, n: int, desc: str) -> Iterator[tuple[int, int]]:
        starts = range(0, n, self.chunk_size)
        for s in tqdm(starts, desc=desc, disable=not self.progress or len(starts) < 2, leave=False):
            yield s, min(s + self.chunk_size, n)

    # ------------------------------------------------------------------ route internals (one place to observe each)
    def _jacobian_chunk(self, x: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
        return contraction.jacobian_chunk(self, x, indices)

    def _features(self, x: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, Features]:
        return structured.factored_features(self, x, plan)

    # ------------------------------------------------------------------ public computations
    def jacobian(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked Jacobian ``J(X)``, shape ``(N·C, P)``, rows ``n·C + c``, columns in parameter order.

        This materialises ``N·C·P`` numbers; the Gram, diagonal and product methods avoid it.
        """
        x = self.prepare(x)
        self.num_outputs(x)
        return contraction.jacobian(self, x)

    def group_grams(self, x1: torch.Tensor, x2: torch.Tensor | None = None) -> torch.Tensor:
        """Per-group Grams ``K_g = J_g(X1) J_g(X2)ᵀ``, shape ``(G, N1·C, N2·C)``, interleaved order.

        With ``x2=None`` the symmetric Gram of ``x1`` is computed (only its lower blocks are contracted).
        """
        x1, x2, sym, plan, c, graph = self._pair(x1, x2)
        n1, n2 = x1.shape[0], x2.shape[0]
        out = torch.empty(self.num_groups, n1 * c, n2 * c, dtype=self.dtype, device=self.device)
        written = structured.structured_grams(self, out, x1, x2, sym, plan, c, graph) if plan.factored else set()
        for g in range(self.num_groups):
            if g not in written:
                out[g].zero_()
        if plan.contracted:
            contraction.contracted_grams(self, out, x1, x2, sym, plan, c, graph)
        return out

    def output_grams(
        self, x1: torch.Tensor, x2: torch.Tensor | None = None, with_diagonal: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-group, per-output Grams ``[K_g]_{(n,c),(m,c)}``, shape ``(G, C, N1, N2)``: the diagonal output
        blocks of :meth:`group_grams` (independent outputs), ``C`` times cheaper than the full Gram; with
        ``x2=None``, ``x2 = x1``. ``with_diagonal=True`` also returns the output diagonals of the per-point
        blocks of ``x2``, ``[J_g(x2_m) J_g(x2_m)ᵀ]_{cc}``, shape ``(G, N2, C)``."""
        x1, x2, sym, plan, c, graph = self._pair(x1, x2)
        kw = {"dtype": self.dtype, "device": self.device}
        out = torch.zeros(self.num_groups, c, x1.shape[0], x2.shape[0], **kw)
        diag = torch.zeros(self.num_groups, x2.shape[0], c, **kw) if with_diagonal else None
        if plan.factored:
            structured.structured_output_grams(self, out, diag, x1, x2, sym, plan, c, graph)
        if plan.contracted:
            contraction.contracted_output_grams(self, out, diag, x1, x2, sym, plan, c, graph)
        return (out, diag) if with_diagonal else out

    def diag_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group, per-point ``C×C`` blocks ``J_g(x_n) J_g(x_n)ᵀ``, shape ``(G, N, C, C)``, without the Gram."""
        x = self.prepare(x)
        plan = self.plan(x)
        c, graph = self.num_outputs(x), self._graph(x)
        out = torch.zeros(self.num_groups, x.shape[0], c, c, dtype=self.dtype, device=self.device)
        if plan.factored:
            structured.structured_diag_blocks(self, out, x, plan, c, graph)
        if plan.contracted:
            contraction.contracted_diag_blocks(self, out, x, plan, c, graph)
        return out

    # ------------------------------------------------------------------ matrix-free products
    def vjp(self, x: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """``J(X)ᵀ v`` for ``v`` of shape ``(N·C,)`` or ``(N·C, k)``: per parameter, shape ``(*p.shape[, k])``."""
        x = self.prepare(x)
        check_rows(v, x.shape[0] * self.num_outputs(x), "v")
        return products.vjp(self, x, v)

    def jvp(self, x: torch.Tensor, u: dict[str, torch.Tensor]) -> torch.Tensor:
        """``J(X) u`` for parameter-shaped tangents ``u`` (optionally with a trailing ``k``): ``(N·C[, k])``."""
        x = self.prepare(x)
        check_tangents(u, dict(zip(self.groups.names, self.groups.shapes)), "u")
        return products.jvp(self, x, u)

    def matvec(self, x: torch.Tensor, v: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Matrix-free ``K v = Σ_g w_g J_g (J_gᵀ v)`` (one vector-Jacobian and one Jacobian-vector product).

        Args:
            x: inputs ``(N, ...)``.
            v: ``(N·C,)`` or ``(N·C, k)`` in interleaved order.
            weights: ``(G,)`` non-negative group weights, e.g. ``1/δ``.

        Raises:
            ValueError: a wrong shape, NaN/Inf or a negative weight, naming the argument.
        """
        x = self.prepare(x)
        check_rows(v, x.shape[0] * self.num_outputs(x), "v")
        check_rows(weights, self.num_groups, "weights", max_dim=1)
        if bool((weights < 0).any()):
            raise ValueError(f"weights must be non-negative, got {weights.detach().tolist()}")
        return products.matvec(self, x, v, weights)
