"""The empirical neural tangent kernel of a trained network as a GPyTorch kernel."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from gpytorch.constraints import Interval, Positive
from gpytorch.kernels import Kernel
from gpytorch.priors import Prior
from linear_operator.operators import (
    DenseLinearOperator,
    LinearOperator,
    LowRankRootLinearOperator,
    MatmulLinearOperator,
)
from torch import nn

from ..ntk import GroupSpec, NTKEngine

REPRESENTATIONS = ("auto", "dense", "root")


class _InputCache:
    """A small LRU cache of computations keyed by input tensors (compared by value) and the weights' version."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[int, tuple[tuple, tuple[torch.Tensor, ...], object]] = OrderedDict()
        self._next = 0

    @staticmethod
    def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
        return all(x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and torch.equal(x, y) for x, y in zip(a, b))

    def get_or_compute(self, key: tuple, xs: tuple[torch.Tensor, ...], compute: Callable[[], object]) -> object:
        for slot, (k, stored, value) in self.entries.items():
            if k == key and len(stored) == len(xs) and self._same(stored, xs):
                self.entries.move_to_end(slot)
                return value
        value = compute()
        if self.size > 0:
            self.entries[self._next] = (key, tuple(x.detach().clone() for x in xs), value)
            self._next += 1
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self.entries.clear()


class NTKKernel(Kernel):
    r"""The empirical NTK of a network at its current weights, :math:`K(x,x') = J(x) P_0^{-1} J(x')^\top`.

    .. math::
        K(x, x') = \sum_g \delta_g^{-1} J_g(x) J_g(x')^\top \in \mathbb{R}^{C \times C},

    where :math:`J_g(x) = \partial f(x;\theta)/\partial\theta_g` at :math:`\theta^*` and :math:`\delta_g` is the
    prior precision of parameter group :math:`g`. For inputs ``(N1, D)`` and ``(N2, D)`` the kernel is a
    ``(N1·C, N2·C)`` operator in GPyTorch's interleaved multi-output order (row ``n·C + c``), so it plugs
    into ``MultitaskMultivariateNormal(..., interleaved=True)`` models; ``num_outputs_per_input`` is ``C``.

    **Inputs.** GPyTorch kernels take ``(N, D)`` matrices. A network on images (or any input shape) is
    handled by passing ``input_shape``: the kernel receives flat inputs ``x.flatten(1)`` of shape
    ``(N, prod(input_shape))`` and reshapes them to ``(N, *input_shape)`` before calling the network.
    Batch dimensions before ``N`` are not supported.

    **Representation** (chosen by cost): when the Gram is square and ``P < N·C`` the kernel is a
    :class:`~linear_operator.operators.LowRankRootLinearOperator` with root ``J P_0^{-1/2}``, so that
    solves and log-determinants after adding noise use Woodbury and the determinant lemma; otherwise a
    dense Gram. The per-group pieces (``J`` or the per-group Grams ``J_g J_g^\top``) are cached for the
    last ``cache_size`` inputs and re-weighted when only :math:`\delta` changes: no new Jacobians, while
    gradients w.r.t. :math:`\delta` flow through the re-weighting. The cache is invalidated when the
    network's weights change.

    The network is held by reference, not registered as a sub-module: ``model.hyperparameters()`` and
    ``state_dict()`` contain the prior precisions, never the network's weights. Its device and dtype
    decide where and in which precision the kernel is computed.

    Args:
        net: the trained network, mapping ``(N, *input_shape)`` to ``(N, C)``; in eval mode if it has
            BatchNorm or dropout. Never modified.
        prior_precision: initial :math:`\delta`, a float or a tensor with one value per group.
        groups: ``"layer"`` (default), ``"network"``, ``"parameter"`` or a mapping of parameter names to groups.
        input_shape: shape of one input as the network expects it (see above).
        chunk_size: examples per Jacobian chunk.
        strategy: how Grams are computed, see :class:`ntkgp.ntk.NTKEngine`.
        representation: ``"auto"``, ``"dense"`` or ``"root"`` (force one form).
        prior_precision_prior: an optional GPyTorch prior on :math:`\delta`.
        prior_precision_constraint: constraint on :math:`\delta`. The default is ``Positive`` with an exponential
            transform, i.e. :math:`\log\delta` is the raw parameter: prior precisions span orders of magnitude and
            an optimiser step then changes :math:`\delta` by a factor, from 1e-3 as from 1e3 (GPyTorch's softplus
            default would move a large :math:`\delta` by only about the step size).
        cache_size: how many input pairs to keep pieces for.
        progress: show progress bars over chunks.

    Example:
        >>> kernel = NTKKernel(net, prior_precision=1.0)
        >>> K = kernel(x_train).to_dense()            # (N*C, N*C)
        >>> kernel.prior_precision = torch.tensor([0.5, 2.0, 1.0])   # re-weights cached Grams
    """

    has_lengthscale = False

    def __init__(
        self,
        net: nn.Module,
        prior_precision: float | torch.Tensor = 1.0,
        groups: GroupSpec = "layer",
        input_shape: tuple[int, ...] | None = None,
        chunk_size: int = 256,
        strategy: str = "auto",
        representation: str = "auto",
        prior_precision_prior: Prior | None = None,
        prior_precision_constraint: Interval | None = None,
        cache_size: int = 4,
        progress: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if representation not in REPRESENTATIONS:
            raise ValueError(f"representation must be one of {REPRESENTATIONS}, got {representation!r}")
        self.engine = NTKEngine(
            net, groups=groups, chunk_size=chunk_size, strategy=strategy, input_shape=input_shape, progress=progress
        )
        self.representation = representation
        self.groups_spec = groups
        self._cache = _InputCache(cache_size)
        num_groups = self.engine.num_groups
        init = torch.as_tensor(prior_precision, dtype=self.engine.dtype, device=self.engine.device)
        if init.dim() == 0:
            init = init.expand(num_groups).clone()
        if init.shape != (num_groups,):
            raise ValueError(
                f"prior_precision must be a float or have one value per group ({num_groups}: "
                f"{list(self.engine.groups.group_names)}), got shape {tuple(init.shape)}"
            )
        if not (torch.isfinite(init).all() and (init > 0).all()):
            raise ValueError(f"prior_precision must be positive and finite, got {init.tolist()}")
        self.register_parameter(
            "raw_prior_precision", nn.Parameter(torch.zeros(num_groups, dtype=init.dtype, device=init.device))
        )
        constraint = prior_precision_constraint or Positive(transform=torch.exp, inv_transform=torch.log)
        self.register_constraint("raw_prior_precision", constraint)
        if prior_precision_prior is not None:
            self.register_prior(
                "prior_precision_prior",
                prior_precision_prior,
                lambda m: m.prior_precision,
                lambda m, v: m._set_prior_precision(v),
            )
        self._set_prior_precision(init)

    # ------------------------------------------------------------------ hyperparameter
    @property
    def prior_precision(self) -> torch.Tensor:
        """Per-group prior precisions :math:`\\delta`, shape ``(G,)``."""
        return self.raw_prior_precision_constraint.transform(self.raw_prior_precision)

    @prior_precision.setter
    def prior_precision(self, value: float | torch.Tensor) -> None:
        self._set_prior_precision(value)

    def _set_prior_precision(self, value: float | torch.Tensor) -> None:
        value = torch.as_tensor(value, dtype=self.raw_prior_precision.dtype, device=self.raw_prior_precision.device)
        value = value.expand(self.raw_prior_precision.shape)
        self.initialize(raw_prior_precision=self.raw_prior_precision_constraint.inverse_transform(value))

    # ------------------------------------------------------------------ accessors
    @property
    def net(self) -> nn.Module:
        return self.engine.net

    @property
    def group_names(self) -> tuple[str, ...]:
        return self.engine.groups.group_names

    def num_outputs_per_input(self, x1: torch.Tensor, x2: torch.Tensor) -> int:
        return self.engine.num_outputs(x1)

    def _column_weights(self, power: float) -> torch.Tensor:
        """``δ_g^power`` for every Jacobian column, shape ``(P,)``."""
        cols = self.engine.groups.column_groups(device=self.raw_prior_precision.device)
        return self.prior_precision.pow(power)[cols]

    # ------------------------------------------------------------------ cached pieces
    def _cached(self, kind: str, *xs: torch.Tensor) -> torch.Tensor:
        compute = {
            "grams": lambda: self.engine.group_grams(*xs),
            "jacobian": lambda: self.engine.jacobian(xs[0]),
            "diag": lambda: self.engine.diag_blocks(xs[0]),
        }[kind]
        key = (kind, self.engine.params_version())
        return self._cache.get_or_compute(key, xs, compute)

    def group_grams(self, x1: torch.Tensor, x2: torch.Tensor | None = None) -> torch.Tensor:
        """Cached per-group Grams ``J_g(x1) J_g(x2)ᵀ``, shape ``(G, N1·C, N2·C)``."""
        return self._cached("grams", x1) if x2 is None else self._cached("grams", x1, x2)

    def jacobian(self, x: torch.Tensor) -> torch.Tensor:
        """Cached Jacobian ``J(x)``, shape ``(N·C, P)``."""
        return self._cached("jacobian", x)

    def diag_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Cached per-point ``C×C`` blocks of the kernel, weighted by ``1/δ``: shape ``(N, C, C)``."""
        return torch.einsum("g,gnij->nij", self.prior_precision.reciprocal(), self._cached("diag", x))

    def clear_cache(self) -> None:
        """Drop all cached Jacobians and Grams (e.g. to free memory)."""
        self._cache.clear()

    def _choose(self, n1c: int, n2c: int, square: bool) -> str:
        if self.representation != "auto":
            return self.representation
        return "root" if self.engine.num_params < min(n1c, n2c) else "dense"

    # ------------------------------------------------------------------ GPyTorch interface
    def forward(
        self, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params
    ) -> torch.Tensor | LinearOperator:
        if last_dim_is_batch:
            raise NotImplementedError("NTKKernel does not support last_dim_is_batch")
        if x1.dim() != 2 or x2.dim() != 2:
            raise ValueError(
                "NTKKernel takes inputs of shape (N, D) without batch dimensions, got "
                f"{tuple(x1.shape)} and {tuple(x2.shape)}; flatten inputs of other shapes and pass input_shape"
            )
        square = x1 is x2 or (x1.shape == x2.shape and torch.equal(x1, x2))
        if diag:
            if square:
                blocks = self.diag_blocks(x1)
                return torch.diagonal(blocks, dim1=-2, dim2=-1).reshape(-1)
            return self.forward(x1, x2).to_dense().diagonal()
        c = self.engine.num_outputs(x1)
        form = self._choose(x1.shape[0] * c, x2.shape[0] * c, square)
        if form == "root":
            if square:
                return LowRankRootLinearOperator(self.jacobian(x1) * self._column_weights(-0.5))
            return MatmulLinearOperator(self.jacobian(x1) * self._column_weights(-1.0), self.jacobian(x2).mT)
        grams = self.group_grams(x1) if square else self.group_grams(x1, x2)
        return DenseLinearOperator(torch.einsum("g,gij->ij", self.prior_precision.reciprocal(), grams))
