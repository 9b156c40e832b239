r"""How :class:`~ntkgp.fsvi.FSVI` reads its inputs: GPyTorch's flat ``(*batch, N, D)`` form, the network's own
input shape, and the checks that the network takes them and gives the likelihood's number of outputs."""

from __future__ import annotations

import math
from collections.abc import Iterator

from torch import Tensor, nn

from ..ntk.checks import check_fits
from ..ntk.data_arguments import check_data
from ..ntk.inputs import is_structured
from ..ntk.packed_inputs import input_packing, pack_inputs, structure_batches, structure_network


def structured_training(net: nn.Module, train_x: object, train_y: object, context: object) -> tuple:
    """For :func:`~ntkgp.fsvi.train_fsvi`: structured inputs (a dict or tuple of tensors with ``train_y``, or a
    re-iterable loader of such batches) as packed rows of bytes and the view of ``net`` that rebuilds them
    (:mod:`ntkgp.ntk.packed_inputs`); context points given as such a structure packed too. Returns
    ``(net, train_x, context)``; other data unchanged. Context points of packed rows are rows of the data
    (``context="auto"``), as for token ids."""
    if train_y is not None and is_structured(train_x):
        check_data(train_x, "train_x")  # a list of numbers is refused as such
        net, train_x = structure_network(net, train_x, "train_x")
    elif train_y is None and not isinstance(train_x, Tensor) and not isinstance(train_x, Iterator):
        net, train_x = structure_batches(net, train_x, "train_x")
    if is_structured(context):  # a dict/tuple of context inputs: packed like the training inputs
        context = pack_inputs(net, context, "context")
    return net, train_x, context


class NetworkInputs:
    """The input handling of :class:`~ntkgp.fsvi.FSVI` (a mixin: it reads ``linearized``,
    ``variational_distribution``, ``likelihood``, ``net`` and ``num_outputs`` of the model). Every check runs
    before anything changes."""

    def _reference(self) -> Tensor:
        """A tensor of the model's dtype and device (the first variational mean)."""
        return self.variational_distribution.mean[0]

    def packed(self, x: object, argument: str = "x") -> object:
        r"""Structured inputs (a dict or tuple of tensors like the training inputs) as packed rows ``(N, B)``
        (:mod:`ntkgp.ntk.packed_inputs`); other inputs as they are. The first structured input seen by a model
        whose network takes tensors so far (built by ``FSVI(net, ...)``, nothing observed yet) fixes the structure,
        as the first image fixes ``input_shape``: the model then evaluates the view of the network that rebuilds
        the structure (the same parameters; :math:`\mu`, :math:`s` and the prior are kept)."""
        if is_structured(x) and input_packing(self.net) is None and self._observed is None:
            net, _ = structure_network(self.net, x, argument)  # checks x before anything changes
            self._use_network(net)
        return pack_inputs(self.net, x, argument)

    def _use_network(self, net: nn.Module) -> None:
        """Evaluate ``net`` (a view of the network sharing its parameters) from now on."""
        from .kernel import MeanFieldNTKKernel
        from .linearized import LinearizedNetwork
        from .mean import VariationalNetworkMean

        old = self.linearized
        self.linearized = LinearizedNetwork(net, input_shape=old.input_shape, strategy=old.strategy,
                                            chunk_size=old.chunk_size)
        self.mean_module = VariationalNetworkMean(self.linearized, self.variational_distribution)
        self.covar_module = MeanFieldNTKKernel(self.linearized, self.variational_distribution)

    def prepare(self, x: Tensor, argument: str = "x") -> Tensor:
        """``x`` in the network's shape, dtype and device (a copy only if needed)."""
        x = self.packed(x, argument)
        if isinstance(x, Tensor) and x.is_meta:
            raise ValueError(f"{argument} is on the meta device, which holds shapes but no values to compute with")
        return self.linearized.prepare(x, self._reference(), argument)

    def _flat(self, x: Tensor, argument: str = "x", batch: bool = True) -> Tensor:
        """GPyTorch's ``(*batch, N, D)`` form of ``x`` (``D`` the product of ``input_shape``); ``batch=False``
        allows only ``(N, D)``. Checked before anything changes.

        Inputs ``(*batch, N, *input_shape)`` are flattened. While the input shape is unknown, an input with more
        than two dimensions is a batch of flat inputs if the network takes rows of its last dimension (one row is
        tried), else one set of inputs ``(N, *input_shape)`` (images): that fixes ``input_shape``, once the network
        was seen to take ``x[:1]``."""
        x = self.packed(x, argument)
        if not isinstance(x, Tensor):
            raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{argument} must have shape (N, ...) with a feature dimension, got {tuple(x.shape)}")
        shape = self.linearized.input_shape
        if shape is None and x.dim() > 2 and not self._takes_rows(x):
            shape = tuple(x.shape[1:])
            self._fits(self.prepare(x[:1], argument), argument)
            self.linearized.input_shape = shape
        if shape is not None and len(shape) > 1 and x.dim() > len(shape) and tuple(x.shape[-len(shape) :]) == shape:
            x = x.flatten(-len(shape))
        if shape is not None and x.shape[-1] != math.prod(shape):
            image = f" or (*batch, N, {', '.join(map(str, shape))})" if len(shape) > 1 else ""
            raise ValueError(
                f"{argument} must have shape (*batch, N, {math.prod(shape)}){image}, got {tuple(x.shape)}"
            )
        if not batch and x.dim() > 2:
            raise ValueError(f"{argument} must have shape (N, ...) without batch dimensions, got {tuple(x.shape)}")
        return x

    def _check_outputs(self, x: Tensor, argument: str = "x") -> None:
        """Raise unless the network gives the likelihood's number of outputs (one forward pass of one row of the
        flat ``x``, the first time; the routes are planned on it)."""
        row = self.prepare(x.reshape(-1, x.shape[-1])[:1], argument)
        c = self.linearized.num_outputs(self.variational_distribution.means(), row)
        if c != self.num_outputs:
            raise ValueError(
                f"net has {c} outputs but the likelihood {type(self.likelihood).__name__} expects {self.num_outputs}"
            )

    def _fits(self, x: Tensor, argument: str, num_outputs: int | None = None) -> int:
        r""":func:`~ntkgp.ntk.checks.check_fits` at :math:`\mu`: the network takes ``x[:1]`` (prepared) and gives
        ``(1, C)`` (``num_outputs`` if given); returns ``C``."""
        means = {n: t.detach() for n, t in self.variational_distribution.means().items()}
        return check_fits(self.linearized.core.module(), means, x, argument, num_outputs)  # ntkgp's private copy

    def _takes_rows(self, x: Tensor) -> bool:
        """Whether the network maps one row of ``x``'s last dimension, ``(1, x.shape[-1])``, to ``(1, C)``."""
        row = x.detach().reshape(-1, x.shape[-1])[:1]
        try:
            self._fits(self.prepare(row), "x")
        except (ValueError, TypeError):
            return False
        return True
