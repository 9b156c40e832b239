"""The empirical neural tangent kernel of a trained network as a GPyTorch kernel."""

from __future__ import annotations

import torch
from gpytorch import settings as gpytorch_settings
from gpytorch.constraints import Interval
from gpytorch.kernels import Kernel
from gpytorch.lazy import LazyEvaluatedKernelTensor
from gpytorch.priors import Prior
from linear_operator.operators import LinearOperator
from torch import nn

from ..ntk import GroupSpec, NTKEngine
from ..ntk.autodiff import RANDOM_OPERATION
from ..ntk.outputs import with_output
from ..ntk.private_copy import model_lock
from ..options import OptionAttribute, Space, Strategy, choice
from ..progress import check_progress
from ..validation import count, positive_count
from .arguments import (check_integer_input, check_network_dtype, input_shape_value, kernel_arguments, kernel_input,
                        prior_precision_tensor, prior_structure_value)
from .batching import distinct_slices, gather, tracks_grad
from .kernel_matrix import kernel_forward, structured_kernel_matrix
from .lazy import NTKLazyKernelTensor
from .network_state import RANDOM_NETWORK, RandomNetworkError, network_state
from .shared_cache import SharedValueCache


class NTKKernel(Kernel):
    r"""The empirical NTK of a network at its current weights, :math:`K(x,x') = J(x) P_0^{-1} J(x')^\top`.

    .. math::
        K(x, x') = \sum_g \delta_g^{-1} J_g(x) J_g(x')^\top \in \mathbb{R}^{C \times C},

    where :math:`J_g(x) = \partial f(x;\theta)/\partial\theta_g` at :math:`\theta^*` and :math:`\delta_g` is
    the prior precision of parameter group :math:`g` (``docs/math.md``, "Empirical NTK"). For inputs
    ``(N1, D)`` and ``(N2, D)`` the kernel is a ``(N1·C, N2·C)`` operator in GPyTorch's interleaved
    multi-output order (row ``n·C + c``), so it plugs into ``MultitaskMultivariateNormal(...,
    interleaved=True)`` models;
    ``num_outputs_per_input`` is ``C``.

    **Shapes.** Inputs ``(*batch, N, D)`` follow GPyTorch's broadcasting rules: ``x1`` of batch shape ``b1``,
    ``x2`` of ``b2`` and a kernel of ``batch_shape`` ``b`` give ``(*broadcast(b1, b2, b), N1·C, N2·C)``. A
    network on images (any input shape) takes ``input_shape``: inputs arrive flat, ``(*batch, N,
    prod(input_shape))``, or with the trailing dimensions equal to ``input_shape``, ``(*batch, N,
    *input_shape)``; the network sees ``(N, *input_shape)``. Each distinct input slice of a batch is
    computed once (identical slices, such as training inputs broadcast against a batch of test points,
    are not recomputed). ``last_dim_is_batch`` is not supported (there is no additive structure over input
    dimensions to exploit).

    **Space** (``space=``, the rule of :func:`ntkgp.options.choose_space`): weight space when ``N·C > 0.85 P``
    (``WEIGHT_SPACE_FROM``, measured):
    a :class:`~linear_operator.operators.LowRankRootLinearOperator` with root :math:`J P_0^{-1/2}` (or, for
    ``x1 ≠ x2``, a :class:`~linear_operator.operators.MatmulLinearOperator` :math:`(J_1 P_0^{-1}) J_2^\top`),
    so that solves and log-determinants after adding noise use Woodbury and the determinant lemma; function
    space otherwise: a :class:`~linear_operator.operators.DenseLinearOperator` of the Gram. The per-group
    pieces (``J`` or the per-group Grams ``J_g J_g^\top``) are cached for the last ``cache_size`` inputs
    (compared by value, together with the network's weights and buffers: any change of the network, by an
    optimizer, ``.data`` or ``load_state_dict``, is seen) and re-weighted when only :math:`\delta` changes: no
    new Jacobians, while gradients w.r.t. :math:`\delta` flow through the re-weighting.

    **Input gradients.** When ``x1`` or ``x2`` requires grad, nothing is served from or stored in the cache
    and the outputs (full, low-rank root, diagonal) carry the engine's graph to the inputs.

    **dtype and device.** The network is held by reference, not registered as a sub-module:
    ``model.hyperparameters()`` and ``state_dict()`` contain the prior precisions, never the network's
    weights, and ``kernel.to(...)``, ``.double()``, ``.float()``, ``.cuda()`` convert the prior precisions
    only (the user's network is never modified). Jacobians are computed in the network's dtype on its
    device (inputs are brought there); the kernel matrix is returned in the dtype and on the device of the
    kernel's hyperparameters. Both are the network's at construction; after ``kernel.double()`` on a float32
    network the Jacobians keep float32 precision and the GP algebra downstream runs in float64.

    **Options after construction** (:class:`ntkgp.options.OptionAttribute`, validated as the constructor
    does): ``space``, ``strategy``, ``chunk_size``, ``cache_size`` and ``progress`` can be assigned, and the
    kernel then equals one built with the new value (``strategy`` and ``chunk_size`` rebuild the engine and
    drop the cached pieces; the pieces serve both spaces); ``prior_structure`` and ``input_shape`` are fixed
    (the parameter groups, the shape of :math:`\delta` and the input layout are built from them): assigning
    another value raises ``AttributeError`` saying to build a new kernel. Freezing or unfreezing a parameter of
    the network after construction is refused at the next call (``RuntimeError``, see
    :mod:`ntkgp.kernels.network_state`).

    Args:
        net: the trained network, mapping ``(N, *input_shape)`` to ``(N, C)``; in eval mode if it has
            BatchNorm or dropout. Never modified.
        prior_precision: initial :math:`\delta`: a positive float, one value per group ``(G,)``, or
            ``(*batch_shape, G)`` for a batched kernel.
        prior_structure: which parameters share a :math:`\delta`: ``"layer"`` (default), ``"network"``,
            ``"parameter"`` or a mapping of parameter names to groups.
        input_shape: shape of one input as the network expects it (see above).
        chunk_size: examples per Jacobian chunk.
        strategy: how Grams are computed, see :class:`ntkgp.ntk.NTKEngine`.
        space: ``"auto"``, ``"function"`` or ``"weight"`` (see above).
        prior_precision_prior: an optional GPyTorch prior on :math:`\delta`.
        prior_precision_constraint: constraint on :math:`\delta`. The default is ``Positive`` with an
            exponential transform, i.e. :math:`\log\delta` is the raw parameter: prior precisions span orders
            of magnitude and an optimizer step then changes :math:`\delta` by a factor, from 1e-3 as from 1e3
            (GPyTorch's softplus default would move a large :math:`\delta` by only about the step size).
        cache_size: how many inputs (or input pairs) to keep pieces for (0 disables the cache).
        progress: ``None`` (auto), ``True`` (a bar) or ``False`` over the chunks of a pass (:mod:`ntkgp.progress`).
        output: for a network returning a dict or a tuple, the key or index of the output to use
            (:mod:`ntkgp.ntk.outputs`); ``None`` (default) for a network returning a tensor.
        batch_shape: GPyTorch's kernel batch shape (one :math:`\delta` vector per batch element).
        active_dims: GPyTorch's ``active_dims``.

    Raises:
        TypeError: a wrongly typed argument or an unknown keyword; a float16/bfloat16 network.
        ValueError: an invalid value (every argument is checked before anything is built).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
        >>> kernel = NTKKernel(net, prior_precision=1.0)
        >>> x = torch.randn(5, 3, dtype=torch.float64)
        >>> kernel(x).shape                                    # (N·C, N·C)
        torch.Size([10, 10])
        >>> kernel(torch.randn(4, 5, 3, dtype=torch.float64)).shape   # a batch of 4
        torch.Size([4, 10, 10])
        >>> kernel.prior_precision = torch.tensor([0.5, 2.0], dtype=torch.float64)   # re-weights cached Grams
    """

    has_lengthscale = False

    prior_structure = OptionAttribute(
        prior_structure_value, fixed="the parameter groups and the shape of prior_precision are built from it"
    )
    input_shape = OptionAttribute(input_shape_value, fixed="the engine lays out every input with it")
    space = OptionAttribute(choice(Space), on_change="_space_changed")
    strategy = OptionAttribute(choice(Strategy), on_change="_engine_option_changed")
    chunk_size = OptionAttribute(positive_count, on_change="_engine_option_changed")
    progress = OptionAttribute(check_progress, on_change="_engine_option_changed")
    cache_size = OptionAttribute(count, on_change="_cache_size_changed")

    def __init__(
        self,
        net: nn.Module,
        prior_precision: float | torch.Tensor = 1.0,
        prior_structure: GroupSpec = "layer",
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 256,
        strategy: str = "auto",
        space: str = "auto",
        prior_precision_prior: Prior | None = None,
        prior_precision_constraint: Interval | None = None,
        cache_size: int = 4,
        progress: bool | None = None,
        output: str | int | None = None,
        **kwargs,
    ) -> None:
        # ---- validate everything before anything is built
        net = with_output(net, output)  # the network's output chosen by output= (ntkgp.ntk.outputs)
        check_network_dtype(net)
        args = kernel_arguments(
            prior_structure,
            input_shape,
            chunk_size,
            strategy,
            space,
            prior_precision_prior,
            prior_precision_constraint,
            cache_size,
            progress,
            kwargs,
        )
        engine = NTKEngine(
            net,
            args.prior_structure,
            chunk_size=args.chunk_size,
            strategy=args.strategy.value,
            input_shape=args.input_shape,
            progress=args.progress,
        )
        init = prior_precision_tensor(
            prior_precision,
            engine.groups.group_names,
            args.batch_shape,
            engine.dtype,
            engine.device,
            args.constraint,
        )

        # ---- build
        super().__init__(**kwargs)
        self.engine = engine
        self.prior_structure = args.prior_structure
        self.input_shape = args.input_shape
        self.space = args.space
        self.strategy = args.strategy
        self.chunk_size = args.chunk_size
        self.progress = args.progress
        self.cache_size = args.cache_size
        self._cache = SharedValueCache(args.cache_size)
        self.register_parameter("raw_prior_precision", nn.Parameter(torch.zeros_like(init)))
        self.register_constraint("raw_prior_precision", args.constraint)
        if args.prior_precision_prior is not None:
            self.register_prior(
                "prior_precision_prior",
                args.prior_precision_prior,
                lambda m: m.prior_precision,
                lambda m, v: m._set_prior_precision(v),
            )
        self._set_prior_precision(init)

    # ------------------------------------------------------------------ options
    def _space_changed(self, name: str) -> None:
        """Nothing the kernel caches depends on the space: the pieces (``J``, per-group Grams) serve both."""

    def _engine_option_changed(self, name: str) -> None:
        """A new engine with the current options (as a fresh kernel builds it), and no pieces computed by the old."""
        self.network_state()  # a frozen parameter is refused, not silently regrouped
        self.engine = NTKEngine(
            self.net,
            self.prior_structure,
            chunk_size=self.chunk_size,
            strategy=self.strategy.value,
            input_shape=self.input_shape,
            progress=self.progress,
        )
        self._cache.clear()

    def _cache_size_changed(self, name: str) -> None:
        self._cache = SharedValueCache(self.cache_size)

    # ------------------------------------------------------------------ hyperparameter
    @property
    def prior_precision(self) -> torch.Tensor:
        """Per-group prior precisions :math:`\\delta`, shape ``(*batch_shape, G)``."""
        return self.raw_prior_precision_constraint.transform(self.raw_prior_precision)

    @prior_precision.setter
    def prior_precision(self, value: float | torch.Tensor) -> None:
        self._set_prior_precision(value)

    def _set_prior_precision(self, value: float | torch.Tensor) -> None:
        raw = self.raw_prior_precision
        constraint = self.raw_prior_precision_constraint
        value = prior_precision_tensor(
            value, self.group_names, self.batch_shape, raw.dtype, raw.device, constraint
        )
        self.initialize(raw_prior_precision=constraint.inverse_transform(value))

    def column_weights(self, power: float) -> torch.Tensor:
        r""":math:`\delta_g^{\text{power}}` per Jacobian column (parameter order), ``(*batch_shape, P)``.

        Args:
            power: the exponent, e.g. ``-1`` for the prior covariance :math:`P_0^{-1}`, ``-0.5`` for its root.
        """
        cols = self.engine.groups.column_groups(device=self.raw_prior_precision.device)
        return self.prior_precision.pow(power)[..., cols]

    # ------------------------------------------------------------------ accessors
    @property
    def net(self) -> nn.Module:
        """The network (held by reference)."""
        return self.engine.net

    @property
    def group_names(self) -> tuple[str, ...]:
        """One label per prior-precision group."""
        return self.engine.groups.group_names

    def num_outputs_per_input(self, x1: torch.Tensor, x2: torch.Tensor) -> int:
        """``C``, the number of network outputs (GPyTorch's multi-output convention)."""
        for x in (x1, x2):
            if x.dim() >= 2 and x.shape[-2] > 0:  # the engine probes x[:1] only while C is unknown
                return self.engine.num_outputs(x if x.dim() == 2 else x.reshape(-1, x.shape[-1])[:1])
        return self.engine.num_outputs(None)

    def is_square(self, x1: torch.Tensor, x2: torch.Tensor) -> bool:
        """Whether ``K(x1, x2)`` is a symmetric Gram: ``x2`` is ``x1``, or equal to it (no graph needed)."""
        if x1 is x2:
            return True
        if tracks_grad(x1) or tracks_grad(x2) or x1.shape != x2.shape:
            return False
        return torch.equal(x1, x2)

    # ------------------------------------------------------------------ cached pieces
    def network_state(self) -> list[torch.Tensor]:
        """What every cached piece depends on (:meth:`ntkgp.ntk.NTKEngine.network_state`).

        Raises:
            RuntimeError: a parameter was frozen or unfrozen since the kernel was built.
        """
        return network_state(self.engine, "NTKKernel")

    def _piece(self, kind: str, *xs: torch.Tensor) -> torch.Tensor:
        """An engine piece for 2-D inputs, through the value cache (bypassed when an input requires grad)."""
        compute = {
            "grams": lambda: self.engine.group_grams(*xs),
            "jacobian": lambda: self.engine.jacobian(xs[0]),
            "diag": lambda: self.engine.diag_blocks(xs[0]),
        }[kind]
        try:
            with model_lock(self):  # one fill at a time per kernel (docs/guarantees.md, "Threads")
                return self._cache.get_or_compute(kind, xs, compute, state=self.network_state())
        except RuntimeError as error:
            if RANDOM_OPERATION not in str(error):
                raise
            raise RandomNetworkError(RANDOM_NETWORK) from None

    def group_grams(self, x1: torch.Tensor, x2: torch.Tensor | None = None) -> torch.Tensor:
        """Cached per-group Grams ``J_g(x1) J_g(x2)ᵀ`` of ``(N, D)`` inputs: ``(G, N1·C, N2·C)``."""
        return self._piece("grams", x1) if x2 is None else self._piece("grams", x1, x2)

    def jacobian(self, x: torch.Tensor) -> torch.Tensor:
        """Cached Jacobian ``J(x)`` for inputs ``(N, D)``: shape ``(N·C, P)``, network dtype."""
        return self._piece("jacobian", x)

    def point_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Per-point ``C×C`` blocks :math:`\\sum_g \\delta_g^{-1} J_g(x_n) J_g(x_n)^\\top` (no Gram formed).

        Args:
            x: inputs ``(*batch, N, D)`` (flat or with trailing ``input_shape``).

        Returns:
            Shape ``(*broadcast(batch, batch_shape), N, C, C)`` in the kernel's dtype.
        """
        x = self._as_input(x, "x")
        if x.dim() == 1:  # GPyTorch's (N,): N inputs of one feature
            x = x.unsqueeze(-1)
        slices = distinct_slices(x)
        n = x.shape[-2]
        c = self.num_outputs_per_input(x, x)
        w = self.prior_precision.reciprocal()
        blocks = self._piece("diag", slices.rows)  # (G, U·N, C, C)
        blocks = blocks.view(blocks.shape[0], -1, n, c, c).movedim(0, 1).to(w)
        return torch.einsum("...g,...gnij->...nij", w, gather(blocks, slices.index))

    def diag_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Alias of :meth:`point_blocks` (shape ``(*batch, N, C, C)``)."""
        return self.point_blocks(x)

    def clear_cache(self) -> None:
        """Drop all cached Jacobians and Grams (e.g. to free memory)."""
        self._cache.clear()

    # ------------------------------------------------------------------ inputs
    def _as_input(self, x: torch.Tensor, argument: str) -> torch.Tensor:
        """Check ``x`` and flatten trailing ``input_shape`` dimensions (:func:`ntkgp.kernels.arguments.kernel_input`)."""
        x = kernel_input(x, argument, self.input_shape)
        check_integer_input(self.engine, x, argument)
        return x

    def __call__(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor | None = None,
        diag: bool = False,
        last_dim_is_batch: bool = False,
        **params,
    ):
        if last_dim_is_batch:
            raise NotImplementedError("NTKKernel does not support last_dim_is_batch=True")
        if isinstance(x1, dict):  # a dict of tensors (token ids and a mask): a dense Gram, ntkgp.ntk.inputs
            return structured_kernel_matrix(self, x1, x2, diag)
        same = x2 is x1
        x1 = self._as_input(x1, "x1")
        x2 = x1 if same else (None if x2 is None else self._as_input(x2, "x2"))
        if x2 is not None and (x1.shape[-1] if x1.dim() > 1 else 1) != (x2.shape[-1] if x2.dim() > 1 else 1):
            raise ValueError(
                f"x1 and x2 must have the same number of features, got shapes {tuple(x1.shape)} and {tuple(x2.shape)}"
            )
        lazy = None if diag else self._lazy(x1, x2, **params)
        if lazy is not None:
            return lazy
        res = super().__call__(x1, x2, diag=diag, **params)
        if type(res) is LazyEvaluatedKernelTensor:
            res = NTKLazyKernelTensor(res.x1, res.x2, kernel=self, last_dim_is_batch=False, **res.params)
        return res

    def _lazy(self, x1: torch.Tensor, x2: torch.Tensor | None = None, **params) -> NTKLazyKernelTensor | None:
        """What GPyTorch's ``Kernel.__call__`` builds for checked inputs ``(*batch, N, D)`` in lazy mode without
        ``active_dims``, as the NTK's own lazy tensor (one object, not GPyTorch's and then ours); ``None`` in the
        other cases (they go through GPyTorch). A model calls it with inputs it has checked as ``__call__`` does."""
        lazy = gpytorch_settings.lazily_evaluate_kernels.on()
        if lazy and self.active_dims is None and x1.dim() > 1 and (x2 is None or x2.dim() > 1):
            return NTKLazyKernelTensor(x1, x1 if x2 is None else x2, kernel=self, last_dim_is_batch=False, **params)
        return None

    # ------------------------------------------------------------------ GPyTorch interface
    def forward(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        diag: bool = False,
        last_dim_is_batch: bool = False,
        **params,
    ) -> torch.Tensor | LinearOperator:
        if last_dim_is_batch:
            raise NotImplementedError("NTKKernel does not support last_dim_is_batch=True")
        return kernel_forward(self, x1, x2, diag)
