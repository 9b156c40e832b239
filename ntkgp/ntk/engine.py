r"""The empirical-NTK engine: Jacobians, per-group Grams, diagonals and matrix-free products.

Everything here is a function of the network at its current weights :math:`\theta^*`, held by a
:class:`~ntkgp.ntk.network.NetworkCore`. :class:`NTKEngine` is the front: it validates inputs, takes the layer
plan of each input shape (:mod:`ntkgp.ntk.layer_plan`) and composes the strategies over chunks
(:mod:`ntkgp.ntk.grams`): one feature pass per chunk (:mod:`ntkgp.ntk.feature_pass`), the structured terms
(:mod:`ntkgp.ntk.structured`: ``nn.Linear`` layers from their layer features), the contraction
(:mod:`ntkgp.ntk.contraction`: convolutions from their features, ``vmap(jacrev)`` for every other parameter)
and matrix-free products (:mod:`ntkgp.ntk.products`). Rows are in GPyTorch's interleaved order
``n·C + c`` (``docs/math.md``, "Structured form").

**Input gradients.** When an input requires grad (and grad mode is on) every result keeps its autograd graph
to that input: features are computed with ``create_graph=True`` (second-order autograd through
:math:`\gamma`) and Jacobians through ``torch.func``, in both routes. Otherwise everything is detached (the
fast path).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..memory import JACOBIAN_BYTES
from ..options import Strategy, choose
from ..validation import count
from . import contraction, grams
from .checks import check_rows, check_tangents
from .feature_pass import FeatureSet
from .groups import GroupSpec
from .layer_plan import LayerPlan, plan_layers
from .network import NetworkCore
from .products import NTKProducts
from .inputs import detach, num_rows, requires_grad


class NTKEngine:
    """Computes the empirical NTK of ``net`` at its current weights, without modifying the network.

    Args:
        net: any ``nn.Module`` mapping a batch ``(N, *input_shape)`` to outputs ``(N, C)``. It must not
            contain BatchNorm or dropout in training mode. Its weights, dtype, ``requires_grad`` flags,
            hooks and mode are never changed.
        prior_structure: prior-precision groups, see :func:`ntkgp.ntk.resolve_groups`.
        chunk_size: examples per chunk; memory of the contraction route is ``O(chunk_size · C · P)``.
        strategy: ``"auto"`` (structured for every Linear/Conv2d layer that passes the safety rule of
            :mod:`ntkgp.ntk.layer_plan`, contraction for the rest), ``"structured"`` (the same, but a layer that
            fails the rule raises) or ``"contraction"`` (``vmap(jacrev)`` for everything).
        input_shape: shape of one input as the network expects it. When given, inputs arriving as
            flat ``(N, D)`` matrices (GPyTorch's convention) are reshaped to ``(N, *input_shape)``.
        max_jacobian_bytes: the contraction route keeps the Jacobian of the second argument in memory
            when it is smaller than this, and recomputes it chunk by chunk otherwise.
        progress: over the chunks of each pass: ``False`` (the default: silent), ``None`` (auto: a bar on a
            terminal, else one line with a long pass's estimated time) or ``True`` (a bar): :mod:`ntkgp.progress`.

    Raises:
        TypeError: ``net`` is not a module.
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
        max_jacobian_bytes: int = JACOBIAN_BYTES,
        progress: bool | None = False,
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        self.strategy = choose(Strategy, strategy, "strategy")
        self.core = NetworkCore(net, None, input_shape, chunk_size, prior_structure, max_jacobian_bytes, progress)
        self.prior_structure = prior_structure

    def __deepcopy__(self, memo: dict) -> NTKEngine:
        # A copy of a kernel or model refers to the same user network: never duplicate (or detach) it.
        new = copy.copy(self)
        memo[id(self)] = new
        return new

    # ------------------------------------------------------------------ the network (its core)
    net = property(lambda self: self.core.net, doc="The network (held by reference).")
    groups = property(lambda self: self.core.groups, doc="The prior groups (:class:`~ntkgp.ntk.ParameterGroups`).")
    input_shape = property(lambda self: self.core.input_shape, doc="The shape of one input, or ``None``.")
    chunk_size = property(lambda self: self.core.chunk_size, doc="Examples per chunk.")
    num_groups = property(lambda self: self.core.groups.num_groups, doc="G, the number of prior groups.")
    num_params = property(lambda self: self.core.num_params, doc="P, the number of trainable parameters.")
    dtype = property(lambda self: self.core.dtype, doc="The network's dtype.")
    device = property(lambda self: self.core.device, doc="The network's device.")

    def parameters(self) -> list[torch.Tensor]:
        """The network's trainable parameters θ*, in the order of ``groups.names``: the network's own tensors
        (not copies; do not modify them). Use them as ``state`` of a :class:`ntkgp.caching.ValueCache`."""
        return self.core.parameters()

    def params(self) -> dict[str, torch.Tensor]:
        """The trainable parameters θ*, detached (they share storage with the network's)."""
        return self.core.params()

    def network_state(self) -> list[torch.Tensor]:
        """The key of every value cache computed from the network (:meth:`NetworkCore.network_state
        <ntkgp.ntk.network.NetworkCore.network_state>`)."""
        return self.core.network_state()

    def group_sq_norms(self) -> torch.Tensor:
        """``‖θ*_g‖²`` per group at the current weights, shape ``(G,)`` (the prior term is ``Σ_g δ_g ‖θ*_g‖²``)."""
        return self.core.group_sq_norms()

    def prepare(self, x: torch.Tensor, argument: str = "x") -> torch.Tensor:
        """Check ``x`` and bring it into the network's dtype, device and input shape (a copy if needed).

        Raises:
            TypeError: ``x`` is not a real tensor.
            ValueError: ``x`` is empty, has NaN/Inf in some row, or does not fit the network (shape or dtype;
                checked by one forward pass of one example per new input shape), naming ``argument``.
        """
        return self.core.prepare(x, argument)

    def outputs(self, x: torch.Tensor, argument: str = "x") -> torch.Tensor:
        """Network outputs ``f(x; θ*)``, shape ``(N, C)``, without gradients to the network (with a graph to
        ``x`` when it requires grad)."""
        return self.core.outputs(x, argument)

    def num_outputs(self, x: torch.Tensor | None = None) -> int:
        """C, the number of network outputs (found by one forward pass of ``x[:1]`` the first time)."""
        return self.core.num_outputs(x)

    # ------------------------------------------------------------------ the plan
    def plan(self, x: torch.Tensor) -> LayerPlan:
        """Which parameters take which route for inputs shaped like ``x`` (prepared), verified once per input
        shape on the probe ``x[:1]`` (:meth:`NetworkCore.layer_plan <ntkgp.ntk.network.NetworkCore.layer_plan>`).

        Raises:
            ValueError: with ``strategy="structured"``, when a Linear/Conv2d layer fails the rule for a reason
                other than an unsupported convolution configuration.
        """
        if self.strategy is Strategy.CONTRACTION:
            return plan_layers(self.net, {}, self.core.names, None)
        plan = self.core.layer_plan(x)
        unsafe = plan.unsafe()
        if self.strategy is Strategy.STRUCTURED and unsafe:
            reasons = "; ".join(str(e) for e in unsafe.values())
            raise ValueError(f"strategy='structured' cannot treat layers {sorted(unsafe)} ({reasons}); use strategy='auto'")
        return plan

    @staticmethod
    def _graph(*xs: torch.Tensor) -> bool:  # keep a graph to the inputs (else the detached fast path)
        return torch.is_grad_enabled() and any(requires_grad(x) for x in xs)

    def _pair(self, x1: torch.Tensor, x2: torch.Tensor | None) -> tuple:
        """``(x1, x2, sym, plan, C, graph)`` for a two-argument computation, both arguments validated first."""
        x1 = self.prepare(x1, "x1")
        sym = x2 is None
        x2 = x1 if sym else self.prepare(x2, "x2")
        plan = self.plan(x1)
        if not sym and self.plan(x2).routes() != plan.routes():
            raise ValueError("x1 and x2 take different routes through the network (different input shapes)")
        return x1, x2, sym, plan, self.num_outputs(x1), self._graph(x1, x2)

    # ------------------------------------------------------------------ public computations
    def jacobian(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked Jacobian ``J(X)``, shape ``(N·C, P)``, rows ``n·C + c``, columns in parameter order.

        This materialises ``N·C·P`` numbers; the Gram, diagonal and product methods avoid it.
        """
        x = self.prepare(x)
        self.num_outputs(x)
        return contraction.jacobian(self.core, x)

    def feature_set(self, x: torch.Tensor, keep: bool | int = True, window: int = 0) -> FeatureSet:
        """The layer features of ``x`` (checked and prepared, no graph), kept: given as ``x1_features`` to
        :meth:`group_grams` and :meth:`output_grams` they spare recomputing ``x1`` at every call (a set of inputs
        used many times, as SFR's inducing inputs). Memory: ``N·C·P_c`` numbers for the contracted columns
        (convolutions and generic parameters, :func:`~ntkgp.ntk.feature_pass.contracted_width`) and
        ``N·(Σ d_in + C Σ d_out)`` for the linear layers. ``keep``: ``True`` keeps every chunk's contracted columns;
        a number of points keeps those of the leading chunks within it and recomputes the others at each use (a
        memory budget). ``window``: the points of the others that a pass over many chunks recomputes once and holds
        together (:mod:`~ntkgp.ntk.feature_windows`; ``0``: recomputed for each chunk of the other inputs).
        :meth:`FeatureSet.converted <ntkgp.ntk.feature_pass.FeatureSet.converted>` gives them in another dtype."""
        window = count(window, "window")
        x = detach(self.prepare(x))
        return FeatureSet(self.core, self.plan(x), x, graph=False, keep=keep, window=window)

    def _given(self, x1: torch.Tensor, features: FeatureSet | None, plan, graph: bool) -> FeatureSet | None:
        """``features`` checked against ``x1`` (same number of points and routes) and usable (no graph)."""
        if features is None:
            return None
        if not isinstance(features, FeatureSet):
            raise TypeError(f"x1_features must be a FeatureSet (NTKEngine.feature_set), got {type(features).__name__}")
        if features.num_points != num_rows(x1) or features.plan.routes() != plan.routes():
            raise ValueError("x1_features are not those of x1 (another number of points or other routes)")
        if graph:  # a graph to the inputs: the given features carry none
            raise ValueError("x1_features cannot be combined with inputs that require grad")
        return features

    def group_grams(
        self, x1: torch.Tensor, x2: torch.Tensor | None = None, x1_features: FeatureSet | None = None,
        with_blocks: bool = False, with_outputs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Per-group Grams ``K_g = J_g(X1) J_g(X2)ᵀ``, shape ``(G, N1·C, N2·C)``, interleaved order.

        With ``x2=None`` the symmetric Gram of ``x1`` is computed (only its lower blocks are contracted).
        ``x1_features`` (:meth:`feature_set` of ``x1``) spares recomputing ``x1``'s features; with it and ``x2``,
        ``with_blocks=True`` also returns :meth:`diag_blocks` of ``x2``, and ``with_outputs=True`` (after them) the
        network outputs :math:`f(x_2)` and :math:`J(x_2)\\theta^*` ``(N2, C)``, from the same pass over ``x2``
        (as :meth:`output_grams`). ``x1_features`` in a finer dtype than the network's (features of a float64 copy
        of a float32 network) give the Grams and blocks in that dtype, ``x2``'s features promoted to it before they
        are contracted (:mod:`ntkgp.ntk.grams`).
        """
        x1, x2, sym, plan, c, graph = self._pair(x1, x2)
        f1 = self._given(x1, x1_features, plan, graph)
        for flag, name in ((with_blocks, "with_blocks"), (with_outputs, "with_outputs")):
            if flag and (f1 is None or sym):
                raise ValueError(f"{name}=True needs x1_features and x2")
        blocks = outputs = None
        if with_blocks:
            blocks = torch.zeros(self.num_groups, num_rows(x2), c, c, dtype=grams.gram_dtype(self.core, f1),
                                 device=self.device)
        if with_outputs:
            outputs = tuple(torch.empty(num_rows(x2), c, dtype=self.dtype, device=self.device) for _ in range(2))
        out = grams.group_grams(self.core, plan, x1, x2, sym, c, graph, f1, blocks, outputs)
        extra = ((blocks,) if with_blocks else ()) + (outputs or ())
        return (out, *extra) if extra else out

    def output_grams(
        self, x1: torch.Tensor, x2: torch.Tensor | None = None, with_diagonal: bool = False,
        x1_features: FeatureSet | None = None, with_outputs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Per-group, per-output Grams ``[K_g]_{(n,c),(m,c)}``, shape ``(G, C, N1, N2)``: the diagonal output
        blocks of :meth:`group_grams` (independent outputs), ``C`` times cheaper than the full Gram; with
        ``x2=None``, ``x2 = x1``. ``with_diagonal=True`` also returns the output diagonals of the per-point
        blocks of ``x2``, ``[J_g(x2_m) J_g(x2_m)ᵀ]_{cc}``, shape ``(G, N2, C)``. ``x1_features`` as in
        :meth:`group_grams`. ``with_outputs=True`` (with ``x1_features`` and ``x2``) also returns, after them, the
        network outputs :math:`f(x_2)` and :math:`J(x_2)\\theta^*` ``(N2, C)`` from the same pass over ``x2``
        (:func:`~ntkgp.ntk.feature_pass.chunk_features`; no other forward or Jacobian-vector product)."""
        x1, x2, sym, plan, c, graph = self._pair(x1, x2)
        f1 = self._given(x1, x1_features, plan, graph)
        outputs = None
        if with_outputs:
            if f1 is None or sym:
                raise ValueError("with_outputs=True needs x1_features and x2")
            outputs = tuple(torch.empty(num_rows(x2), c, dtype=self.dtype, device=self.device) for _ in range(2))
        out, diag = grams.output_grams(self.core, plan, x1, x2, sym, c, graph, with_diagonal, f1, outputs)
        extra = ((diag,) if with_diagonal else ()) + (outputs or ())
        return (out, *extra) if extra else out

    def diag_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group, per-point ``C×C`` blocks ``J_g(x_n) J_g(x_n)ᵀ``, shape ``(G, N, C, C)``, without the Gram."""
        x = self.prepare(x)
        return grams.diag_blocks(self.core, self.plan(x), x, self.num_outputs(x), self._graph(x))

    # ------------------------------------------------------------------ matrix-free products
    def products(self, x: torch.Tensor) -> NTKProducts:
        """The products :math:`J(X)^\\top v` and :math:`J(X) u` at ``x``, prepared once for many calls (the layer
        features of the structured layers computed and kept; :class:`~ntkgp.ntk.products.NTKProducts`); ``x``
        is checked and prepared, no graph is kept."""
        x = detach(self.prepare(x))
        return NTKProducts(self.core, self.plan(x), x, engine=self)

    def _one_shot(self, x: torch.Tensor) -> NTKProducts:
        """Products for one use: nothing kept, every parameter by ``torch.func`` chunk by chunk."""
        return NTKProducts(self.core, plan_layers(self.net, {}, self.core.names, None), x, graph=self._graph(x))

    def vjp(self, x: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """``J(X)ᵀ v`` for ``v`` of shape ``(N·C,)`` or ``(N·C, k)``: per parameter, shape ``(*p.shape[, k])``."""
        x = self.prepare(x)
        check_rows(v, num_rows(x) * self.num_outputs(x), "v")
        columns = v if v.dim() == 2 else v.unsqueeze(-1)
        out = self._one_shot(x).transpose(columns)
        return {
            n: t.reshape(*shape, -1) if v.dim() == 2 else t.reshape(shape)
            for n, shape, t in zip(self.core.names, self.core.shapes, out)
        }

    def jvp(self, x: torch.Tensor, u: dict[str, torch.Tensor]) -> torch.Tensor:
        """``J(X) u`` for parameter-shaped tangents ``u`` (optionally with a trailing ``k``): ``(N·C[, k])``."""
        x = self.prepare(x)
        shapes = dict(zip(self.core.names, self.core.shapes))
        check_tangents(u, shapes, "u")
        batched = any(u[n].dim() == len(shapes[n]) + 1 for n in u)
        tangents = [u[n].reshape(shapes[n].numel(), -1) for n in self.core.names]
        out = self._one_shot(x).apply(tangents)
        return out if batched else out.squeeze(-1)

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
        check_rows(v, num_rows(x) * self.num_outputs(x), "v")
        check_rows(weights, self.num_groups, "weights", max_dim=1)
        if bool((weights < 0).any()):
            raise ValueError(f"weights must be non-negative, got {weights.detach().tolist()}")
        columns = v if v.dim() == 2 else v.unsqueeze(-1)
        out = self._one_shot(x).matvec(columns, weights)
        return out if v.dim() == 2 else out.squeeze(-1)
