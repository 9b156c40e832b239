r"""One pass over the training data at :math:`\theta^*`: batches, outputs, unit likelihood factors, and
per-example vector-Jacobian products :math:`J_n^\top u_n`.

The network at :math:`\theta^*` is ntkgp's one :class:`~ntkgp.ntk.network.NetworkCore` (prior groups, input checks,
forward passes and per-example products through ``torch.func.functional_call`` with detached aliases of its
parameters): the network's weights, flags, mode and hooks are left as they are. What this module adds is the
pass over the data itself: batches, the likelihood's unit factors, the collected outputs and targets, and the
sums over the ranks of a distributed pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ...distributed import all_gather_rows, all_reduce_sum, check_distributed, check_replicated, together
from ...likelihoods import validate_targets
from ...ntk.inputs import detach, leaves, num_rows, split
from ...ntk.checks import check_outputs
from ...ntk.data_arguments import check_data
from ...ntk.groups import GroupSpec
from ...ntk.network import NetworkCore
from ...progress import progress_bar
from ...validation import positive_count
from . import scaling
from .sampled_ggn import check_generator, check_mc_samples, sampled_unit_hessian_root
from .scaling import output_scale

Data = Tensor | Iterable[tuple[Tensor, Tensor]]
#: ``forward(x_b, root) -> f_b``: a batch's one forward pass, given ``root(f_b)``, the cotangents at its outputs.
BatchForward = Callable[[Tensor, Callable[[Tensor], Tensor]], Tensor]


@dataclass
class DataPass:
    r"""The network at :math:`\theta^*` and the likelihood for one pass over the data.

    Collects the outputs :math:`f_n` and normalised targets of every batch it hands out.

    Attributes:
        core: the network (:class:`~ntkgp.ntk.network.NetworkCore`: prior groups, input checks, passes).
        likelihood: the likelihood.
        scale0: the output scale :math:`s_0` of the likelihood at computation time, ``(K,)``, detached.
        distributed: each rank passes its shard of the data; sums (:meth:`reduce`) and the collected
            outputs and targets (:meth:`collected`) are over all ranks (:mod:`ntkgp.distributed`).
        mc_samples: ``None`` for the exact roots of the likelihood's Hessian, or :math:`S`: the sampled roots of
            :mod:`~ntkgp.laplace.ggn.sampled_ggn` (a softmax likelihood), :math:`S` columns per example.
        generator: the sampled roots' random numbers (``None``: torch's global generator).
    """

    core: NetworkCore
    likelihood: Likelihood
    scale0: Tensor
    outputs: list[Tensor] = field(default_factory=list)
    targets: list[Tensor] = field(default_factory=list)
    distributed: bool = False
    mc_samples: int | None = None
    generator: torch.Generator | None = None

    @classmethod
    def start(
        cls,
        net: nn.Module,
        likelihood: Likelihood,
        prior_structure: GroupSpec = "layer",
        input_shape: tuple[int, ...] | None = None,
        distributed: bool = False,
        mc_samples: int | None = None,
        generator: torch.Generator | None = None,
    ) -> DataPass:
        """Check the network (eval mode, trainable parameters) and the likelihood; record :math:`\\theta^*`
        and :math:`s_0`. With ``distributed``, also check that every rank holds the same network."""
        distributed = check_distributed(distributed)
        mc_samples = check_mc_samples(mc_samples, likelihood)
        generator = check_generator(generator)
        with together("checking the network", distributed):
            core = NetworkCore(net, input_shape=input_shape, prior_structure=prior_structure, fixed_architecture=True)
            scale0 = output_scale(likelihood).detach().to(device=core.device, dtype=core.dtype)
        if distributed:
            check_replicated([*net.parameters(), *net.buffers()], "the network's weights", distributed)
        return cls(core=core, likelihood=likelihood, scale0=scale0, distributed=distributed, mc_samples=mc_samples,
                   generator=generator)

    @classmethod
    def on(cls, core: NetworkCore, likelihood: Likelihood) -> DataPass:
        """A pass (not distributed) over a network already held, e.g. by an :class:`~ntkgp.ntk.NTKEngine`
        (its layer plans and input checks are reused)."""
        scale0 = output_scale(likelihood).detach().to(device=core.device, dtype=core.dtype)
        return cls(core=core, likelihood=likelihood, scale0=scale0)

    @property
    def net(self) -> nn.Module:
        return self.core.net

    @property
    def params(self) -> dict[str, Tensor]:
        """:math:`\theta^*` per trainable parameter name, detached."""
        return self.core.params()

    @property
    def num_data(self) -> int:
        return sum(f.shape[0] for f in self.outputs)

    def forward(self, x: Tensor) -> Tensor:
        """``f(x; θ*)`` of a prepared batch."""
        return self.core.forward(x)

    def check(self, x: Data, y: Tensor | None, batch_size: int) -> int:
        """Validate the whole data set before the pass (tensor inputs: every row of ``x`` and ``y``).

        Returns:
            ``batch_size`` as an ``int``.

        Raises:
            TypeError, ValueError: naming ``x``, ``y`` or ``batch_size``.
        """
        return self._checked(x, y, batch_size)[0]

    def _checked(self, x: Data, y: Tensor | None, batch_size: int
                 ) -> tuple[int, Tensor | None, Tensor | None]:
        """:meth:`check`, and for tensor data the prepared inputs (``None`` where preparing them made a copy: the
        batches are then prepared one at a time, as ever, not held twice) and the normalised targets."""
        batch_size = positive_count(batch_size, "batch_size")
        check_data(x, "x")  # an array is not an iterable of batches
        if torch.is_tensor(x) or isinstance(x, dict):  # a tensor, or a dict of tensors (ntkgp.ntk.inputs)
            prepared = self.core.prepare(x, "x")
            if not torch.is_tensor(y):
                raise TypeError("y must be a tensor of targets when x is a tensor")
            if y.dim() < 1 or y.shape[0] != num_rows(x):
                raise ValueError(f"x has {num_rows(x)} rows but y has shape {tuple(y.shape)}")
            targets = validate_targets(self.likelihood, y, self.core.num_outputs(prepared), num_data=num_rows(x),
                                       name="y")
            shared = all(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                         for a, b in zip(leaves(prepared), leaves(x)))
            return batch_size, detach(prepared) if shared else None, targets
        if y is not None:
            raise ValueError("pass y=None when x is an iterable of (x, y) batches")
        if not isinstance(x, Iterable):
            raise TypeError(f"x must be a tensor or an iterable of (x, y) batches, got {type(x).__name__}")
        return batch_size, None, None

    def batches(self, x: Data, y: Tensor | None, batch_size: int, progress: bool, desc: str,
                forward: BatchForward | None = None) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """Yield ``(x_b, f_b, y_b)``: prepared inputs, outputs ``(n, C)`` (no graph) and normalised targets.

        ``x`` is a tensor ``(N, ...)`` with targets ``y``, split into batches of ``batch_size``; or an
        iterable of ``(x_b, y_b)`` batches (e.g. a ``DataLoader``) with ``y=None``. With :attr:`distributed`,
        invalid data (or an empty shard) on any rank raises on every rank at the end of the pass. Tensor data is
        validated once, in full (:meth:`check`), and its batches are slices of the checked tensors; the batches
        of an iterable are validated as they come.

        ``forward(x_b, root)``, when given, is the batch's only forward pass (e.g. a feature pass with its backward
        passes from the unit likelihood factors): it returns the outputs ``f_b`` without a graph, and calls
        ``root(f_b)`` for :meth:`unit_hessian_root` at them (the outputs and targets checked first) when it needs
        the cotangents. Without it ``f_b`` is one forward pass without a graph.
        """
        with together("the pass over the data", self.distributed):
            yield from self._batches(x, y, batch_size, progress, desc, forward)
            if self.distributed and not self.outputs:
                raise ValueError("this rank's shard of x holds no data (with distributed=True every rank needs some)")
            if not self.outputs:
                raise ValueError("the data is empty: no batch was seen")

    def _batches(self, x: Data, y: Tensor | None, batch_size: int, progress: bool, desc: str,
                 forward: BatchForward | None) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        batch_size, prepared, normalised = self._checked(x, y, batch_size)
        normalised_outputs = None if normalised is None else self.core.num_outputs()
        if torch.is_tensor(x) or isinstance(x, dict):
            pairs: Iterable = zip(split(x if prepared is None else prepared, batch_size),
                                  normalised.split(batch_size))
            total = -(-num_rows(x) // batch_size)
        else:
            pairs, total = x, None
        pairs = progress_bar(pairs, total, desc, progress)
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(
                    "x must be a tensor or an iterable of (x, y) batches; a batch of "
                    f"{len(pair) if isinstance(pair, (tuple, list)) else type(pair).__name__} was found "
                    "(a DataLoader over a dataset of inputs only has no targets)"
                )
            xb, yb = pair
            xb = xb if prepared is not None else detach(self.core.prepare(xb, "x"))
            checked: list[Tensor] = []

            def targets(fb: Tensor, xb=xb, yb=yb) -> Tensor:
                if not checked:
                    check_outputs(fb, num_rows(xb))
                    if normalised is not None and fb.shape[1] == normalised_outputs:  # y checked in full
                        checked.append(yb)
                    else:  # a batch's targets, or outputs unlike the first example's: raises naming them
                        checked.append(validate_targets(self.likelihood, yb, fb.shape[1], num_data=fb.shape[0]))
                return checked[0]

            if forward is None:
                with torch.no_grad():
                    fb = self.forward(xb)
            else:
                fb = forward(xb, lambda f: self.unit_hessian_root(f, targets(f)))
            yb = targets(fb)
            self.outputs.append(fb)
            self.targets.append(yb)
            yield xb, fb, yb

    def unit_hessian_sqrt(self, f: Tensor, y: Tensor) -> Tensor:
        r""":math:`\tilde L_n = S_0^{-1/2} L_n` with :math:`L_n L_n^\top = \Lambda_n`, shape ``(n, C, C)``.

        Gaussian: :math:`\tilde L_n = I`; tempered classification: :math:`L_n \sqrt{T_0}`. With
        :attr:`mc_samples`, the sampled root ``(n, C, S)`` instead (:func:`unit_hessian_root`).
        """
        if self.mc_samples is not None:
            return self.unit_hessian_root(f, y)
        return scaling.unit_hessian_sqrt(self.likelihood, f, y, self.scale0)

    def unit_hessian_root(self, f: Tensor, y: Tensor) -> Tensor:
        r"""A root :math:`R_n` of :math:`\tilde\Lambda_n` with the fewest columns the likelihood allows, shape
        ``(n, C, M)`` (:func:`~ntkgp.laplace.ggn.scaling.unit_hessian_root`: :math:`M = C - 1` for a
        softmax likelihood). A backward pass and a product per example fewer in a pass over cotangent columns
        (:math:`\sum_m (J^\top r_m) (J^\top r_m)^\top` is the same for every root). With :attr:`mc_samples`,
        :math:`S` sampled columns whose outer products average to it
        (:func:`~ntkgp.laplace.ggn.sampled_ggn.sampled_unit_hessian_root`)."""
        if self.mc_samples is not None:
            return sampled_unit_hessian_root(f, self.mc_samples, self.generator)
        return scaling.unit_hessian_root(self.likelihood, f, y, self.scale0)

    def unit_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        r""":math:`\tilde g_n = S_0^{-1} g_n`, shape ``(n, C)`` (Gaussian: :math:`y_n - f_n`)."""
        return scaling.unit_gradient(self.likelihood, f, y, self.scale0)

    def per_example_vjps(self, x: Tensor, cotangents: Tensor, names: list[str]) -> Tensor:
        r"""Rows :math:`J_n^\top u_{nm}` restricted to the parameters ``names``, shape ``(n, M, P_{names})``."""
        return self.core.per_example_vjps(x, cotangents, names)

    def theta_sq_norms(self) -> Tensor:
        r""":math:`\|\theta^*_g\|^2` per group, shape ``(G,)``."""
        return self.core.group_sq_norms()

    def reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        """Sum ``tensors`` over the ranks in place (:func:`ntkgp.distributed.all_reduce_sum`; no-op unless
        :attr:`distributed`)."""
        return all_reduce_sum(tensors, enabled=self.distributed)

    def collected(self) -> tuple[Tensor, Tensor]:
        """All outputs ``(N, C)`` and normalised targets seen so far (of every rank, in rank order, when
        :attr:`distributed`)."""
        if not self.outputs:
            raise ValueError("the data is empty: no batch was seen")
        f, y = torch.cat(self.outputs), torch.cat(self.targets)
        y = y.to(f.dtype) if y.is_floating_point() else y  # one dtype on every rank, whatever each was given
        return all_gather_rows(f, self.distributed), all_gather_rows(y, self.distributed)
